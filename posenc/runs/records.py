"""Run records: the files a run directory holds and the one way to write and read them.

A run directory holds:

- ``.hydra/config.yaml``: the composed config; ``checkpoints/last.ckpt``: the latest checkpoint, and
  ``checkpoints/last-previous.ckpt`` the one before it, what a resume falls back on if the latest cannot be read;
- ``run.json``: the summary (steps, tokens, eval figures), refreshed when the run is re-evaluated;
- ``done.json``: written last, the mark of a complete run (a relaunched sweep skips it);
- ``failed.json``: why a run stopped (a non-finite loss), and its stability record up to there; a relaunch retries it
  and the report lists it apart;
- ``wandb_id``: the W&B run id, so a resumed run continues its own W&B run; ``wandb_step``: the last W&B step
  it logged at, so that an evaluation after training logs past it (``posenc.runs.loggers``).

``RunError`` carries every message meant for a user: one line saying what is wrong and what to do.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from posenc.jsonio import write_json, write_text

DONE_FILE = "done.json"
FAILED_FILE = "failed.json"
RUN_FILE = "run.json"
WANDB_ID_FILE = "wandb_id"
WANDB_STEP_FILE = "wandb_step"
CHECKPOINT = Path("checkpoints") / "last.ckpt"
PREVIOUS_CHECKPOINT = CHECKPOINT.with_name("last-previous.ckpt")


class RunError(SystemExit):
    """A run that cannot go on as asked: the message says why and what to do (exit status 1, no traceback)."""


# ---------------------------------------------------------------------------------------------------------------
# Markers and records


def read_json(path: Path) -> Any:
    """A JSON record; a damaged one fails with one line naming the file."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RunError(f"{path} is not readable JSON ({err}): delete or restore it") from None


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def write_done(run_dir: Path, config: Mapping[str, Any], steps: int) -> None:
    """Mark a run complete; call it last. A failure record from an earlier attempt is removed first."""
    (run_dir / FAILED_FILE).unlink(missing_ok=True)
    record = {"run_name": config.get("run_name"), "finished_at": now(), "steps": steps, "config": config}
    write_json(run_dir / DONE_FILE, record)


def write_failed(
    run_dir: Path, config: Mapping[str, Any], reason: str, step: int, details: Mapping[str, Any] | None = None
) -> None:
    """Record why a run stopped; the report lists it apart, a relaunched sweep retries it.

    ``details``: what the run measured before it stopped (its ``stability`` record), kept beside the reason.
    """
    record = {"run_name": config.get("run_name"), "failed_at": now(), "step": step, "reason": reason, "config": config}
    record.update(details or {})
    write_json(run_dir / FAILED_FILE, record)


def update_run_summary(run_dir: Path, eval_summary: dict[str, Any]) -> None:
    """Replace the ``eval`` figures of ``run.json`` (after a re-evaluation); no-op for a run without one."""
    path = run_dir / RUN_FILE
    if path.is_file():
        summary = read_json(path)
        summary["eval"] = eval_summary
        write_json(path, summary)


def global_batch(batch_size: int, trainer: Any, seq_len: int) -> dict[str, int]:
    """What one optimizer step consumes across all ranks of a Lightning ``trainer`` (run.json, loggers, results)."""
    windows = batch_size * trainer.accumulate_grad_batches * trainer.world_size
    return {"world_size": trainer.world_size, "global_batch_size": windows, "tokens_per_step": windows * seq_len}


def training_record(
    steps: int, max_steps: int, tokens_per_step: int | None, checkpoint_step: int | None
) -> dict[str, Any]:
    """What the evaluated weights were trained for, recorded in every ``results.json`` (``training``).

    ``steps`` is the optimizer steps behind the evaluated weights, ``checkpoint_step`` the step of the checkpoint
    they came from (or of the run's last one), ``finished`` whether they reached ``trainer.max_steps``: the report
    leaves unfinished runs out of its columns unless asked, and ``posenc.evaluate`` warns about them.
    """
    return {
        "steps": steps,
        "max_steps": max_steps,
        "finished": steps >= max_steps,
        "tokens": steps * tokens_per_step if tokens_per_step else None,
        "tokens_per_step": tokens_per_step,
        "checkpoint_step": checkpoint_step,
    }


def wandb_id(run_dir: Path) -> str:
    """The W&B run id of this run directory, created once: a resumed single run continues its own W&B run."""
    path = run_dir / WANDB_ID_FILE
    if path.is_file():
        return path.read_text().strip()
    run_id = secrets.token_hex(8)
    write_text(path, run_id)
    return run_id


def global_rank() -> int:
    """The rank of this process from the launcher's variables (0 outside distributed runs), before Lightning."""
    for key in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    return 0
