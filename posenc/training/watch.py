"""What watches a run while it trains, and what the run records of itself when it ends.

Split from the loop (``posenc/training/loop.py``) so that the loop reads as its steps: set up, train, record. The
callbacks here are the run's only observers (checkpoints, token accounting, drift, stability, the end-of-training
evaluation under each protocol), and ``run_summary`` reads each of them once into ``run.json``.
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.plugins.environments import SLURMEnvironment

from posenc.attention.auto import resolved
from posenc.evaluate import RESULTS_FILE, sliding_dir
from posenc.evaluate.curve import ValidationAccuracy
from posenc.evaluate.drift import PositionalDrift
from posenc.evaluate.runner import ExtrapolationEval
from posenc.runs import CHECKPOINT, global_batch, read_checkpoint
from posenc.runs.checkpoint_io import AtomicCheckpointIO
from posenc.training.callbacks import SaveFinal, SaveOnInterrupt, TokenAccounting
from posenc.training.console import CountedModelSummary
from posenc.training.stability import StabilityMonitor


@dataclass
class Watchers:
    """The callbacks a run trains with, and the ones whose records its summary reads by name."""

    accounting: TokenAccounting
    drift: PositionalDrift
    stability: StabilityMonitor
    curve: ValidationAccuracy | None = None
    evaluation: ExtrapolationEval | None = None
    callbacks: list[Callback] = field(default_factory=list)

    @property
    def evaluations(self) -> list[ExtrapolationEval]:
        return [c for c in self.callbacks if isinstance(c, ExtrapolationEval)]


def watchers(
    config: dict[str, Any],
    run_dir: Path,
    info: dict[str, Any],
    datamodule: Any,
    resume: tuple[int, str | None],
    logged: bool,
) -> Watchers:
    """Every callback of a run: checkpoints, accounting, drift, stability, and the evaluation under each protocol.

    ``resume`` is (the step a resumed run starts from, the command that resumes it); ``logged``: whether any logger
    runs (the learning-rate monitor refuses to run without one).
    """
    trainer_cfg, (resume_step, resume_command) = config["trainer"], resume
    seq_len = config["data"]["seq_len"]
    watch = Watchers(
        TokenAccounting(trainer_cfg["max_steps"], resume_step),
        PositionalDrift(trainer_cfg["max_steps"], seq_len),
        StabilityMonitor(trainer_cfg["max_steps"]),
    )
    checkpoints = ModelCheckpoint(
        dirpath=run_dir / "checkpoints",
        save_last=True,
        save_top_k=0,
        every_n_train_steps=config["checkpoint_every_n_steps"],
    )
    interrupt = SaveOnInterrupt(run_dir / CHECKPOINT, resume_command or f"resume=last in {run_dir}")
    # SaveFinal first: SaveOnInterrupt's on_train_end may hand a requeued job over (and exit) before later callbacks.
    final = SaveFinal(run_dir / CHECKPOINT)
    watch.callbacks = [checkpoints, final, watch.accounting, interrupt, watch.drift, watch.stability]
    if logged:
        watch.callbacks.append(LearningRateMonitor(logging_interval="step"))
    if trainer_cfg.get("enable_model_summary", True):  # ours in place of Lightning's default (training/console.py)
        watch.callbacks.append(CountedModelSummary())
    task = config["data"].get("task")
    if task:  # a task run's in-length accuracy at every validation
        watch.curve = ValidationAccuracy()
        watch.callbacks.append(watch.curve)
    if config["eval"]["at_end"]:
        watch.callbacks += _evaluations(config, run_dir, info, datamodule, watch)
        watch.evaluation = next(iter(watch.evaluations), None)
    return watch


def _evaluations(
    config: dict[str, Any], run_dir: Path, info: dict[str, Any], datamodule: Any, watch: Watchers
) -> list[ExtrapolationEval]:
    """The end-of-training evaluation, and the other protocol from the same run beside it (sliding windows)."""
    eval_cfg, task = config["eval"], config["data"].get("task")
    # Held-out text for language-modelling runs (task runs are scored on their task); picklable, for ddp_spawn.
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
    found = [ExtrapolationEval(info, eval_cfg, run_dir / "eval", stream, task, watch.drift)]
    # Sliding windows at each stride fixed in advance, beside eval/. The attention statistics read the same windows
    # whatever the protocol: the end-of-training evaluation's serve.
    for fraction in [] if task else eval_cfg.get("sliding_fractions") or []:
        sliding = {**eval_cfg, "mode": "sliding", "stride": None, "stride_fraction": fraction}
        sliding["attention_stats"] = False
        found.append(ExtrapolationEval(info, sliding, run_dir / sliding_dir(fraction), stream, task, watch.drift))
    return found


def plugins(trainer_cfg: dict[str, Any]) -> list[Any]:
    """Lightning plugins every run has, beside any the config names."""
    # Checkpoints written whole or not at all, beside where they land, the one before kept (runs/checkpoint_io.py).
    found = [*(trainer_cfg.get("plugins") or []), AtomicCheckpointIO()]
    if os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        # submitit requeues a job that is running out of time (SaveOnInterrupt saves first); Lightning's own
        # auto-requeue would requeue it a second time, from a checkpoint taken inside its signal handler.
        found.append(SLURMEnvironment(auto_requeue=False))
    return found


def run_summary(
    config: dict[str, Any],
    info: dict[str, Any],
    trainer: L.Trainer,
    module: Any,
    run_dir: Path,
    watch: Watchers,
    resume: tuple[Path | None, int],
    started: float,
) -> dict[str, Any]:
    """``run.json``: steps, tokens and seconds over the whole run, and what each watcher recorded.

    The whole run includes a resumed run's earlier processes; ``segment`` is what this process trained.
    ``started``: ``time.perf_counter()`` when this process began to fit.
    """
    (checkpoint, resume_step), seq_len = resume, config["data"]["seq_len"]
    accounting = global_batch(config["data"]["batch_size"], trainer, seq_len)
    steps = trainer.global_step or _checkpoint_step(run_dir)  # 0 here under ddp_spawn: it trained in children
    resumed_from = None
    if checkpoint is not None:
        first_window = resume_step * accounting["global_batch_size"]
        resumed_from = {"checkpoint": str(checkpoint), "step": resume_step, "start_sample": first_window}
    seconds, loop_seconds = time.perf_counter() - started, watch.accounting.loop_seconds
    spent = watch.accounting.spent(seconds, loop_seconds) or {"train_seconds": None, "train_loop_seconds": None}
    model = module.model
    return {
        **info,
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
        "tokens_per_sec": watch.accounting.tokens_per_sec(steps),
        "train_conditions": {
            **watch.accounting.conditions(module.device),
            # Which backend each layer's scheme trained on: ``auto`` resolves by device and declaration.
            "resolved": resolved(
                config["attention"]["name"],
                model.layer_encodings,
                module.device,
                sink=model.sink != "none",
                windows=model.layer_windows,
            ),
        },
        "checkpoint": str(run_dir / CHECKPOINT),
        "val_loss": float(trainer.callback_metrics.get("val/loss", float("nan"))),
        "val_curve": watch.curve.history if watch.curve is not None else None,
        "eval": _eval_summary(watch.evaluation, run_dir),
        "scheme_lr_multiplier": float(config["optim"].get("scheme_lr_multiplier", 1.0)),
        "positional_drift": watch.drift.record(model),
        "stability": watch.stability.record(),
    }


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
