"""``python -m posenc.train +encoding=<scheme>``: train the shared decoder with one positional scheme.

Hydra composes the config (``conf/train.yaml``), Lightning trains, and the run ends with the extrapolation
evaluation (perplexity at 1×…32× the training length, printed and written to ``<run>/eval``). Everything a
run writes lands in its directory under ``outputs/``: the resolved config, checkpoints, logs, ``run.json``, and
last ``done.json``, the mark of a complete run. ``-m`` runs a sweep (``sweeps/``, ``posenc/sweep.py``).

Every value is checked before any work (``posenc.runs.validate``): a bad input ends with one line saying what to
do, and leaves no run directory behind. The training loop itself is ``posenc/training.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, MissingMandatoryValue, open_dict

from posenc.config import CONF_DIR, remove_if_only_bookkeeping, require_encoding, to_container
from posenc.runs import CHECKPOINT, DONE_FILE, FAILED_FILE, RunError, validate
from posenc.sweep import job_state, join_submitit_tasks, wandb_group, wandb_run_id


def train(cfg: DictConfig, run_dir: Path, resume_command: str | None = None) -> dict[str, Any]:
    """Check ``cfg``, then train one run into ``run_dir``; return its summary (also ``run_dir/run.json``)."""
    try:
        config = to_container(cfg)
    except MissingMandatoryValue as err:
        raise RunError(f"{err.full_key} must be set (e.g. {_example(err.full_key)})") from None
    validate(config)
    from posenc.training import fit  # Lightning is imported only for a config that can run

    return fit(config, run_dir, resume_command)


def _example(key: str) -> str:
    return "data.corpus_options.paths=[notes.txt]" if key.endswith("paths") else f"{key}=..."


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def main(cfg: DictConfig) -> None:
    hydra_config = HydraConfig.get()
    run_dir = Path(hydra_config.runtime.output_dir)
    require_encoding(cfg, "posenc.train", run_dir)
    multirun = hydra_config.mode == RunMode.MULTIRUN
    if multirun:
        join_submitit_tasks()
        state = job_state(run_dir, to_container(cfg))
        if state.finished:
            print(f"{cfg.run_name}: finished earlier ({run_dir / DONE_FILE}); skipping")
            return
        with open_dict(cfg):
            if cfg.resume is None and state.checkpoint is not None:
                cfg.resume = str(state.checkpoint)
            if cfg.logger.kind == "wandb":
                cfg.logger.group = cfg.logger.group or wandb_group(Path(hydra_config.sweep.dir), cfg.sweep_name)
                cfg.logger.id = wandb_run_id(cfg.logger.group, cfg.run_name)
    overrides = [o for o in hydra_config.overrides.task if not o.startswith(("resume=", "hydra.run.dir="))]
    resume_command = (
        " ".join(["python -m posenc.train", *overrides, "resume=last", f"hydra.run.dir={run_dir}"])
        if not multirun
        else f"the same sweep command again (it resumes {run_dir.name})"
    )
    try:
        train(cfg, run_dir, resume_command)
    except RunError as err:
        if not (run_dir / CHECKPOINT).exists():
            remove_if_only_bookkeeping(run_dir)
        if not multirun or not (run_dir / FAILED_FILE).exists():
            raise
        # A diverged job of a sweep: recorded in failed.json; the sweep goes on and its report lists it apart.
        print(f"error: {err}", file=sys.stderr)


if __name__ == "__main__":
    main()
