"""Experiment loggers from config: W&B (default, never blocks), CSV, or none.

W&B must never hang or prompt: with ``mode: auto`` the run goes online only when an API key is configured and
the W&B host answers within two seconds; otherwise it is written offline into the run directory and can be
uploaded later with ``wandb sync``. ``WANDB_MODE`` in the environment always wins. wandb is imported only when
the W&B logger is actually built.

Sweep jobs log into their sweep's group, under a run id that stays the same when a job is relaunched, so a
resumed job continues its own W&B run (offline: ``wandb sync`` uploads the pieces of one run in order).
Only rank zero talks to W&B.

W&B's step is set, not counted: the optimizer step while training, and for a later evaluation one past the last
step the run logged (recorded in the run directory, ``wandb_step``). A resumed or re-evaluated run starts a new
process, and offline a new folder, whose own count would restart at 0; W&B drops history rows below a resumed run's
step, so a counted history would lose the resumed steps and every re-evaluation once synced.
"""

from __future__ import annotations

import csv
import io
import os
import socket
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from lightning.pytorch.loggers import CSVLogger, Logger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only

from posenc.jsonio import write_text
from posenc.runs import global_rank
from posenc.runs.checks import wandb_key_configured
from posenc.runs.records import WANDB_STEP_FILE


def _reachable(url: str, timeout: float = 2.0) -> bool:
    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname, parsed.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def resolve_wandb_mode(requested: str) -> str:
    """``online``/``offline``/``disabled``: the environment first, then the request, ``auto`` decided here."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if requested != "auto":
        return requested
    base_url = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    return "online" if wandb_key_configured() and _reachable(base_url) else "offline"


class ResumedCSVLogger(CSVLogger):
    """A CSV logger that continues ``metrics.csv`` instead of replacing it (Lightning's deletes it on start).

    Rows from step ``resume_step`` on are dropped first: the resumed run logs those steps again.
    """

    def __init__(self, *args: Any, resume_step: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resume_step = resume_step

    @property
    def experiment(self) -> Any:
        if self._experiment is not None:
            return self._experiment
        path = Path(self.log_dir) / "metrics.csv"
        rows, header = [], []
        if path.is_file():
            with path.open(newline="") as handle:
                reader = csv.DictReader(handle)
                header = list(reader.fieldnames or [])
                rows = [row for row in reader if not row.get("step") or int(float(row["step"])) < self.resume_step]
        with warnings.catch_warnings():  # "previous log files will be deleted": not so, they are continued here
            warnings.filterwarnings("ignore", message="Experiment logs directory .* exists and is not empty")
            writer = super().experiment  # creates the writer, which deletes metrics.csv
        if header:
            text = io.StringIO(newline="")
            out = csv.DictWriter(text, fieldnames=header)
            out.writeheader()
            out.writerows(rows)
            write_text(path, text.getvalue())
            writer.metrics_keys = header
        return writer


class SteppedWandbLogger(WandbLogger):
    """Lightning's W&B logger with W&B's step set to the step Lightning logs at, and without a W&B warning.

    Lightning passes the step as a metric (``trainer/global_step``, the charts' x axis) and lets W&B count its own
    ``_step``; here both are the optimizer step, so the history of a run resumed in a new process continues where
    it was instead of restarting at 0. Lightning also passes W&B ``anonymous=None``, which W&B answers with a
    warning that the setting does nothing: it is not passed.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, resume="allow", **kwargs)
        self._wandb_init.pop("anonymous", None)

    @rank_zero_only
    def log_metrics(self, metrics: Any, step: int | None = None) -> None:
        if step is None:
            super().log_metrics(metrics, step)
            return
        self.experiment.log({**metrics, "trainer/global_step": step}, step=step)


def record_wandb_step(run_dir: Path, step: int) -> None:
    """Note the last W&B step a run logged at: a later evaluation logs one past it."""
    write_text(run_dir / WANDB_STEP_FILE, str(step))


def next_wandb_step(run_dir: Path, trained_steps: int) -> int:
    """The W&B step for an evaluation after training: past the run's last logged step and its trained steps."""
    path = run_dir / WANDB_STEP_FILE
    last = int(path.read_text().strip()) if path.is_file() and path.read_text().strip().isdigit() else -1
    return max(last, trained_steps) + 1


def build_loggers(
    cfg: dict[str, Any],
    run_dir: Path,
    run_name: str,
    config: dict[str, Any],
    tags: list[str],
    resume_step: int | None = None,
) -> list[Logger]:
    """The loggers the run asked for; ``tags`` (scheme, length, seed) are added to W&B's.

    For W&B, ``cfg`` may carry ``group`` (a sweep's) and ``id`` (a run id to continue when it exists). A resumed
    run (``resume_step``) continues its CSV metrics.
    """
    kind = cfg.get("kind", "none")
    if kind == "none":
        return []
    if kind == "csv":
        if resume_step is not None:
            return [ResumedCSVLogger(save_dir=str(run_dir), name="csv", version="", resume_step=resume_step)]
        return [CSVLogger(save_dir=str(run_dir), name="csv", version="")]
    if kind == "wandb":
        mode = resolve_wandb_mode(cfg.get("mode", "auto"))
        if mode == "disabled":
            return []
        # Under ddp_spawn the workers attach to the run and put its media under WANDB_DIR, which they inherit.
        os.environ["WANDB_DIR"] = str(run_dir)
        logger = SteppedWandbLogger(
            project=cfg.get("project", "posenc"),
            entity=cfg.get("entity"),
            name=run_name,
            group=cfg.get("group"),
            tags=sorted(set(tags) | set(cfg.get("tags") or [])),
            save_dir=str(run_dir),
            mode=mode,
            config=config,
            id=cfg.get("id"),  # with resume="allow": continue that run if it exists
        )
        if mode == "offline" and global_rank() == 0:
            print(f"W&B is offline; the run is in {run_dir}/wandb. Upload it later with:")
            print(f"  wandb sync {run_dir}/wandb/offline-run-*")
        return [logger]
    raise ValueError(f"unknown logger kind {kind!r}; use logger=wandb, logger=csv or logger=none")


def finish_loggers(loggers: list[Logger], success: bool) -> None:
    """Close the run's loggers; W&B's run is finished so that the next job of a sweep starts its own.

    (Lightning's ``WandbLogger`` reuses any W&B run still open in the process, and a multirun's jobs share one.)
    """
    for logger in loggers:
        logger.finalize("success" if success else "failed")
        if isinstance(logger, WandbLogger):
            import wandb

            if wandb.run is not None:
                wandb.finish(exit_code=0 if success else 1)
