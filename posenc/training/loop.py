"""The training loop behind ``python -m posenc.train``: Lightning, checkpoints, token accounting, the final eval.

``posenc.train`` checks the config first and imports this module only then, so that a bad input is refused in
the time it takes to import torch, not Lightning.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.exceptions import SIGTERMException

from posenc.attention.auto import resolved
from posenc.encodings.length import coverage, coverage_lines, settings_line
from posenc.evaluate import RESULTS_FILE, sliding_dir
from posenc.evaluate.curve import ValidationAccuracy
from posenc.evaluate.drift import PositionalDrift, console_lines
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
    global_batch,
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
from posenc.runs.checkpoint_io import AtomicCheckpointIO
from posenc.runs.loggers import SteppedWandbLogger, build_loggers, finish_loggers, record_wandb_step
from posenc.runtime import resolve_precision
from posenc.training.callbacks import SaveOnInterrupt, TokenAccounting
from posenc.training.console import CountedModelSummary, quiet_libraries, route_lightning_logging
from posenc.training.lit import DivergedError, LitDecoder
from posenc.training.stability import StabilityMonitor


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
    trainer_cfg = dict(config["trainer"])
    trainer_cfg["precision"] = resolve_precision(trainer_cfg["precision"], trainer_cfg["accelerator"])
    if isinstance(trainer_cfg.get("val_check_interval"), int):  # one epoch is the whole run: validate within it
        trainer_cfg["val_check_interval"] = min(trainer_cfg["val_check_interval"], trainer_cfg["max_steps"])
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
    if parent is not None and lineage is not None:
        checkpoint = parent[0]
        if resume is None:
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
    loggers = build_loggers(
        config["logger"], run_dir, config["run_name"], logged_config, tags, resume_step if resume else None
    )
    callbacks: list[Callback] = [
        ModelCheckpoint(
            dirpath=run_dir / "checkpoints",
            save_last=True,
            save_top_k=0,
            every_n_train_steps=config["checkpoint_every_n_steps"],
        ),
        accounting_callback := TokenAccounting(trainer_cfg["max_steps"], resume_step),
        SaveOnInterrupt(run_dir / CHECKPOINT, resume_command or f"resume=last in {run_dir}"),
        drift := PositionalDrift(trainer_cfg["max_steps"], seq_len),
        stability := StabilityMonitor(trainer_cfg["max_steps"]),
    ]
    if loggers:  # it only logs, and refuses to run without a logger
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    if trainer_cfg.pop("enable_model_summary", True):  # ours in place of Lightning's default (training/console.py)
        callbacks.append(CountedModelSummary())
    task = config["data"].get("task")
    curve = ValidationAccuracy() if task else None  # a task run's in-length accuracy at every validation
    if curve is not None:
        callbacks.append(curve)
    evaluation = None
    if config["eval"]["at_end"]:
        # Held-out text for language-modelling runs (task runs are scored on their task); picklable, for ddp_spawn.
        eval_cfg = config["eval"]
        stream = (
            None
            if task
            else functools.partial(
                datamodule.heldout_stream,
                eval_cfg["split"],
                eval_cfg.get("max_containment"),
                eval_cfg.get("near_copies", "lines"),
            )
        )
        evaluation = ExtrapolationEval(info, config["eval"], run_dir / "eval", stream, task, drift)
        callbacks.append(evaluation)
        # The other protocol from the same run: sliding windows at each stride fixed in advance, beside eval/. The
        # attention statistics read the same windows whatever the protocol: the end-of-training evaluation's serve.
        for fraction in [] if task else config["eval"].get("sliding_fractions") or []:
            sliding = {**config["eval"], "mode": "sliding", "stride": None, "stride_fraction": fraction}
            sliding["attention_stats"] = False
            callbacks.append(ExtrapolationEval(info, sliding, run_dir / sliding_dir(fraction), stream, task, drift))
    # Checkpoints written whole or not at all, beside where they land, the one before kept (runs/checkpoint_io.py).
    trainer_cfg["plugins"] = [*(trainer_cfg.get("plugins") or []), AtomicCheckpointIO()]
    if os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        # submitit requeues a job that is running out of time (SaveOnInterrupt saves first); Lightning's own
        # auto-requeue would requeue it a second time, from a checkpoint taken inside its signal handler.
        trainer_cfg["plugins"].append(SLURMEnvironment(auto_requeue=False))
    trainer = L.Trainer(
        **trainer_cfg,
        enable_model_summary=False,  # Lightning's own would print beside ours, after a line saying it skipped itself
        logger=loggers or False,
        callbacks=callbacks,
        default_root_dir=str(run_dir),
    )
    started = time.perf_counter()
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
            details = {"label": label, "diverged": True, "stability": stability.record()}
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
    accounting = global_batch(config["data"]["batch_size"], trainer, seq_len)
    steps = trainer.global_step or _checkpoint_step(run_dir)  # 0 here under ddp_spawn: it trained in children
    resumed_from = None
    if resume is not None:
        first_window = resume_step * accounting["global_batch_size"]
        resumed_from = {"checkpoint": str(resume), "step": resume_step, "start_sample": first_window}
    seconds, loop_seconds = time.perf_counter() - started, accounting_callback.loop_seconds
    spent = accounting_callback.spent(seconds, loop_seconds) or {"train_seconds": None, "train_loop_seconds": None}
    summary: dict[str, Any] = {
        **info,
        # steps, tokens and seconds over the same span: the whole run, from step 0 (a resumed run's earlier
        # processes included); "segment" is what this process trained
        "steps": steps,
        **accounting,
        "tokens": steps * accounting["tokens_per_step"],
        "resumed_from": resumed_from,
        "train_seconds": spent["train_seconds"],
        "train_loop_seconds": spent["train_loop_seconds"] or None,
        "segment": {
            "from_step": resume_step,
            "steps": steps - resume_step,
            "tokens": (steps - resume_step) * accounting["tokens_per_step"],
            "train_seconds": seconds,
            "train_loop_seconds": loop_seconds or None,
        },
        "tokens_per_sec": accounting_callback.tokens_per_sec(steps),
        "train_conditions": {
            **accounting_callback.conditions(module.device),
            # Which backend each layer's scheme trained on: ``auto`` resolves by device and declaration.
            "resolved": resolved(
                config["attention"]["name"],
                module.model.layer_encodings,
                module.device,
                sink=module.model.sink != "none",
                windows=module.model.layer_windows,
            ),
        },
        "checkpoint": str(run_dir / CHECKPOINT),
        "val_loss": float(trainer.callback_metrics.get("val/loss", float("nan"))),
        "val_curve": curve.history if curve is not None else None,
        "eval": _eval_summary(evaluation, run_dir),
        "scheme_lr_multiplier": float(config["optim"].get("scheme_lr_multiplier", 1.0)),
        "positional_drift": (positional_drift := drift.record(module.model)),
        "stability": stability.record(),
    }
    try:
        finish_loggers(loggers, success=True)
        if trainer.is_global_zero:
            if any(isinstance(logger, SteppedWandbLogger) for logger in loggers):
                record_wandb_step(run_dir, trainer.global_step)  # a later evaluation logs past it
            for line in console_lines(positional_drift, label):
                print(line)
            write_json(run_dir / RUN_FILE, summary)
            write_done(run_dir, config, steps)
            print(_where(run_dir, [c for c in callbacks if isinstance(c, ExtrapolationEval)]))  # the last line
    except OSError as err:
        if (full := _disk_full(err)) is None:
            raise
        raise _full_disk_error(full, config, run_dir, resume_command) from None
    return summary


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


def _checkpoint_step(run_dir: Path) -> int:
    """The last checkpoint's step, for when this process's trainer did not train (ddp_spawn)."""
    path = run_dir / CHECKPOINT
    return read_checkpoint(path)[0] if path.exists() else 0


def _eval_summary(evaluation: ExtrapolationEval | None, run_dir: Path) -> dict[str, float] | None:
    if evaluation is None:
        return None
    if evaluation.results:
        return evaluation.results["summary"]
    written = run_dir / "eval" / RESULTS_FILE  # ddp_spawn: rank zero evaluated in a child process
    return json.loads(written.read_text())["summary"] if written.exists() else None
