"""The training loop behind ``python -m posenc.train``: Lightning, checkpoints, token accounting, the final eval.

``posenc.train`` checks the config first and imports this module only then, so that a bad input is refused in
the time it takes to import torch, not Lightning.
"""

from __future__ import annotations

import contextlib
import errno
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException

from posenc.encodings.length import coverage, coverage_lines, settings_line
from posenc.evaluate import RESULTS_FILE
from posenc.evaluate.drift import console_lines
from posenc.evaluate.runner import ExtrapolationEval
from posenc.jsonio import DiskFullError
from posenc.runs import (
    CHECKPOINT,
    RUN_FILE,
    Parent,
    RunError,
    build_datamodule,
    check_data,
    disk_full_message,
    lineage_tags,
    load_parent_weights,
    provenance,
    read_checkpoint,
    resume_checkpoint,
    run_info,
    wandb_id,
    write_done,
    write_failed,
    write_json,
)
from posenc.runs.loggers import SteppedWandbLogger, build_loggers, finish_loggers, record_wandb_step
from posenc.runtime import resolve_precision
from posenc.training.console import quiet_libraries, route_lightning_logging
from posenc.training.lit import DivergedError, LitDecoder
from posenc.training.watch import Watchers, plugins, run_summary, watchers


def fit(
    config: dict[str, Any],
    run_dir: Path,
    resume_command: str | None = None,
    parent: tuple[Parent, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Train one run into ``run_dir`` with a validated, resolved config; return its summary (``run.json``).

    ``parent`` (``posenc.runs.inherit``: a run with ``init_from``) is the checkpoint whose backbone the model starts
    from and the lineage recorded with the run; a resumed run takes its weights from its own checkpoint instead.

    Ends by writing ``run_dir/done.json`` on rank zero, after the evaluation and the loggers: a run without it
    did not finish, which is how a relaunched sweep tells what to skip. A non-finite loss stops the run with
    ``failed.json`` (with its stability record up to there) and a ``RunError`` naming the step; the last checkpoint
    on disk is the last good one. ``run.json`` records the run's stability (``posenc/training/stability.py``).
    """
    route_lightning_logging()
    quiet_libraries()
    resume = resume_checkpoint(config.get("resume"), run_dir)
    resume_step = read_checkpoint(resume)[0] if resume is not None else 0
    L.seed_everything(config["seed"], workers=True, verbose=False)
    trainer_cfg = _trainer_settings(config["trainer"])
    # Sized for one process here; TokenAccounting resizes it for the world size once Lightning knows it.
    samples = trainer_cfg["max_steps"] * config["data"]["batch_size"] * trainer_cfg["accumulate_grad_batches"]
    datamodule = build_datamodule(config, samples)
    data_info = check_data(datamodule)
    lineage = parent[1] if parent is not None else None
    what = "; ".join(provenance(config, lineage))
    print(f"run {config['run_name']}{f' ({what})' if what else ''}: {_shown(run_dir)}")  # the first line
    run_dir.mkdir(parents=True, exist_ok=True)
    if config["logger"].get("kind") == "wandb" and not config["logger"].get("id"):
        config["logger"] = {**config["logger"], "id": wandb_id(run_dir)}  # a resumed run continues its W&B run
    module = LitDecoder(config, vocab_size=datamodule.vocab_size, precision=trainer_cfg["precision"])
    info, logged_config, tags = _describe(config, module, data_info, parent, resume is None)
    loggers = build_loggers(
        config["logger"], run_dir, config["run_name"], logged_config, tags, resume_step if resume else None
    )
    watch = watchers(config, run_dir, info, datamodule, (resume_step, resume_command), bool(loggers))
    trainer_cfg.pop("enable_model_summary", None)  # ours in place of Lightning's (a watcher, training/console.py)
    trainer_cfg["plugins"] = plugins(trainer_cfg)
    trainer = L.Trainer(
        **trainer_cfg,
        enable_model_summary=False,  # Lightning's own would print beside ours, after a line saying it skipped itself
        logger=loggers or False,
        callbacks=watch.callbacks,
        default_root_dir=str(run_dir),
    )
    started = time.perf_counter()
    _train(trainer, module, datamodule, resume, loggers, (config, run_dir, resume_command), info["label"], watch)
    summary = run_summary(config, info, trainer, module, run_dir, watch, (resume, resume_step), started)
    try:
        finish_loggers(loggers, success=True)
        if trainer.is_global_zero:
            if any(isinstance(logger, SteppedWandbLogger) for logger in loggers):
                record_wandb_step(run_dir, trainer.global_step)  # a later evaluation logs past it
            for line in console_lines(summary["positional_drift"], info["label"]):
                print(line)
            write_json(run_dir / RUN_FILE, summary)
            write_done(run_dir, config, summary["steps"])
            print(_where(run_dir, watch.evaluations))  # the last line
    except OSError as err:
        if (full := _disk_full(err)) is None:
            raise
        raise _full_disk_error(full, config, run_dir, resume_command) from None
    return summary


def _trainer_settings(trainer: dict[str, Any]) -> dict[str, Any]:
    """Lightning's Trainer arguments from the config: precision resolved, validation inside the one epoch."""
    settings = dict(trainer)
    settings["precision"] = resolve_precision(settings["precision"], settings["accelerator"])
    if isinstance(settings.get("val_check_interval"), int):  # one epoch is the whole run: validate within it
        settings["val_check_interval"] = min(settings["val_check_interval"], settings["max_steps"])
    return settings


def _describe(
    config: dict[str, Any],
    module: LitDecoder,
    data_info: dict[str, Any],
    parent: tuple[Parent, dict[str, Any]] | None,
    fresh: bool,
) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(the run's record before training, the config its loggers get, its tags); says what it cannot reach.

    A run started from a parent (``fresh``: not resumed from its own checkpoint) takes the parent's weights here.
    """
    label = module.model.label
    info = run_info(config, label, data_info)
    seq_len = config["data"]["seq_len"]
    # Before the first step: which positional parameters training at this length cannot reach, one line each.
    info["coverage"] = coverage(module.model, seq_len)
    info["budget"] = budget(module.model, config)
    for line in [settings_line(info["length_settings"], seq_len), *coverage_lines(info["coverage"])]:
        if line is not None:
            print(line)
    tags = [label, f"L{seq_len}", f"seed{config['seed']}", *module.model.scheme_names]
    logged_config = {**config, "label": label, "data_info": data_info}
    if parent is not None:
        checkpoint, lineage = parent
        if fresh:
            load_parent_weights(module.model, checkpoint, lineage)
            print(
                f"init_from: {len(lineage['copied'])} tensors copied from {checkpoint.checkpoint} (step "
                f"{checkpoint.step}); fresh: {', '.join(lineage['fresh']) or 'none'}; dropped: "
                f"{', '.join(lineage['dropped']) or 'none'}"
            )
            for note in lineage.get("notes") or []:
                print(f"note: {note}")
        info["lineage"] = logged_config["lineage"] = lineage
        tags += lineage_tags(lineage)
    return info, logged_config, tags


def _train(
    trainer: L.Trainer,
    module: LitDecoder,
    datamodule: Any,
    resume: Path | None,
    loggers: list[Any],
    run: tuple[dict[str, Any], Path, str | None],
    label: str,
    watch: Watchers,
) -> None:
    """``trainer.fit``, with each way a run can stop early said in one line (``run``: config, directory, resume)."""
    config, run_dir, resume_command = run
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=resume)
    except SIGTERMException:
        finish_loggers(loggers, success=False)
        raise RunError(
            f"{config['run_name']}: stopped by SIGTERM at step {trainer.global_step} and saved {run_dir / CHECKPOINT}; "
            "a requeued SLURM job resumes there by itself, else resume with "
            f"{resume_command or f'resume=last in {run_dir}'}"
        ) from None
    except DivergedError as err:
        finish_loggers(loggers, success=False)
        checkpoint = run_dir / CHECKPOINT
        kept = f"the last good checkpoint is {checkpoint}" if checkpoint.exists() else "no checkpoint was saved"
        message = f"{config['run_name']}: training diverged: {err}; {kept}. Lower optim.lr or raise warmup"
        if trainer.is_global_zero:  # kept as diverged, with what it measured up to there (the report's stability)
            details = {"label": label, "diverged": True, "stability": watch.stability.record()}
            write_failed(run_dir, config, str(err), err.step, details)
        raise RunError(message) from None
    except BaseException as err:
        full = _disk_full(err)
        if full is None:
            finish_loggers(loggers, success=False)
            raise
        with contextlib.suppress(OSError):  # a logger's own files are on the same full disk
            finish_loggers(loggers, success=False)
        raise _full_disk_error(full, config, run_dir, resume_command) from None


def budget(model: Any, config: dict[str, Any]) -> dict[str, Any]:
    """The training budget a run plans, in tokens per parameter: what says how far from converged a comparison is.

    Parameters are all the model's trainable ones (embeddings included: at the tiny size the byte vocabulary's
    tables are a small share); tokens are ``max_steps`` × the global batch × the training length on one process
    (``run.json`` records the tokens each process count actually trained).
    """
    parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    trainer = config["trainer"]
    tokens = trainer["max_steps"] * config["data"]["batch_size"] * trainer.get("accumulate_grad_batches", 1)
    tokens *= config["data"]["seq_len"]
    return {"parameters": parameters, "tokens": tokens, "tokens_per_parameter": tokens / max(1, parameters)}


def _shown(path: Path) -> Path:
    """``path`` as typed from here: relative where it lies below the working directory (Hydra's are absolute)."""
    with contextlib.suppress(ValueError):
        return path.relative_to(Path.cwd())
    return path


def _where(run_dir: Path, evaluations: list[ExtrapolationEval]) -> str:
    """The run's last console line: where its results and plots are."""
    run = _shown(run_dir)
    if not evaluations:
        return f"done: {run}/{RUN_FILE} (no evaluation: eval.at_end=false; python -m posenc.evaluate {run})"
    folders = ", ".join(f"{_shown(e.out_dir)}/{RESULTS_FILE}" for e in evaluations)
    plots = sum(len(list(e.out_dir.glob("*.png"))) for e in evaluations)  # on disk: under ddp_spawn a child wrote them
    shown = f"{plots} plot(s) beside them" if plots else "no plots (eval.plots=false)"
    return f"done: results in {folders}; {shown}; {run}/{RUN_FILE}"


def _full_disk_error(full: OSError, config: dict[str, Any], run_dir: Path, resume_command: str | None) -> RunError:
    """The one line a full disk ends a run with (``posenc.runs.disk_full_message``)."""
    message = disk_full_message(full, run_dir, resume_command or f"resume=last in {run_dir}")
    return RunError(f"{config['run_name']}: {message}")


def _disk_full(err: BaseException | None) -> OSError | None:
    """The full disk behind ``err``, if any: posenc's ``DiskFullError`` first, which says what it needed.

    Lightning finalises the loggers when a run fails, and a logger writing to the same full disk raises in turn:
    the first failure is then the exception's context.
    """
    chain = []
    while err is not None and len(chain) < 16:
        chain.append(err)
        err = err.__context__
    full = [e for e in chain if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)]
    return next((e for e in full if isinstance(e, DiskFullError)), full[0] if full else None)
