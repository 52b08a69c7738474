"""Sweeps (``python -m posenc.train -m …``): relaunchable, refusing what cannot work, one W&B group each.

A sweep's jobs live in ``<output_root>/sweeps/<sweep_name>/<run_name>/`` (``run_name`` = scheme, training length,
seed). The path holds the sweep's *name*, not its launch time, so relaunching the same sweep (after a crash, a
SLURM time limit, or to add seeds) lands every job in its own directory again. There a job

- **skips** when it finished earlier: ``done.json``, written last (after the evaluation, ``run.json`` and the
  loggers), is the proof; a job killed at any earlier point has none;
- **resumes** from ``checkpoints/last.ckpt`` when it started but did not finish;
- **refuses** when that earlier run had other settings (a different ``trainer.max_steps``, say): mixing two
  experiments under one name would make the sweep's report lie. Settings that only change how a run executes
  or logs (``RUNTIME_KEYS``) may change between launches.

The launch time lives in the W&B group instead (``<sweep_name>-<first launch time>``, kept in ``sweep.json``),
so every launch of a sweep logs into one group, and a resumed job continues its own W&B run (a stable run id).

Before the first job starts, ``SweepPreflight`` (a Hydra callback, ``conf/train.yaml``) composes every job's
config and stops with one message, before anything is written, on what cannot work: a scheme missing, two jobs
sharing a directory, changed settings, or Lightning's ``ddp`` under a launcher that runs jobs as plain local
processes (Lightning starts ranks 1… by re-running the command line, which re-runs the whole multirun in each
rank: Lightning issue #11300).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from posenc.config import remove_if_only_bookkeeping, require_encoding, to_container
from posenc.runs import (
    CHECKPOINT,
    DONE_FILE,
    FAILED_FILE,
    INTRODUCED,
    experiment_settings,
    last_good_checkpoint,
    read_checkpoint,
    read_json,
    resolve,
    validate,
    write_json,
)

SWEEP_FILE = "sweep.json"
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
# Launchers that run a job as one task per device (SLURM's model): Lightning joins the tasks, starts nothing.
TASK_LAUNCHERS = ("hydra_plugins.hydra_submitit_launcher.", "hydra_plugins.posenc_launcher.")


class SweepError(SystemExit):
    """A sweep that cannot run as asked: the message says why and what to do (no traceback)."""


# ---------------------------------------------------------------------------------------------------------------
# Job state: finished, interrupted, new


def setting_changes(before: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """``key: old -> new`` for every experiment setting that differs between two configs.

    A setting introduced since the earlier config was written (``INTRODUCED``) reads there as what it did then.
    """
    old, new = experiment_settings(before), experiment_settings(now)
    old = {**{key: value for key, value in INTRODUCED.items() if key in new}, **old}
    missing = object()
    return [
        f"{key}: {old.get(key, '(unset)')!r} -> {new.get(key, '(unset)')!r}"
        for key in sorted(old.keys() | new.keys())
        if old.get(key, missing) != new.get(key, missing)
    ]


@dataclass(frozen=True)
class JobState:
    """What a relaunched job finds in its directory."""

    run_dir: Path
    finished: bool = False
    checkpoint: Path | None = None  # set when the job resumes
    step: int = 0  # the checkpoint's global step
    failed: str | None = None  # why an earlier attempt stopped (failed.json): the job is retried

    @property
    def action(self) -> str:
        if self.finished:
            return "finished"
        action = f"resume from step {self.step}" if self.checkpoint else "new"
        if self.checkpoint is not None and self.checkpoint.name != CHECKPOINT.name:
            action += f" ({CHECKPOINT.name} is unreadable: from {self.checkpoint.name}, the checkpoint before it)"
        return f"failed earlier ({self.failed}); retrying: {action}" if self.failed else action


def job_state(run_dir: Path, config: Mapping[str, Any]) -> JobState:
    """Finished (``done.json``), interrupted (a last checkpoint) or new; ``SweepError`` on changed settings."""
    done, failed = run_dir / DONE_FILE, run_dir / FAILED_FILE
    reason = read_json(failed).get("reason") if failed.exists() else None
    if done.exists():
        earlier, what = read_json(done)["config"], "finished"
        state = JobState(run_dir, finished=True)
    elif (checkpoint := last_good_checkpoint(run_dir, announce=False)) is not None:
        step, earlier = read_checkpoint(checkpoint)
        what = f"was interrupted at step {step}"
        state = JobState(run_dir, checkpoint=checkpoint, step=step, failed=reason)
    else:
        return JobState(run_dir, failed=reason)
    # A length setting left unset resolves as the earlier launch resolved it (posenc/encodings/length.py).
    config = resolve(config, earlier.get("encoding"))
    changes = setting_changes(earlier, config)
    if changes:
        raise SweepError(
            f"{run_dir} {what} with other settings than this launch asks for ({'; '.join(changes)}). "
            "A sweep keeps its settings across relaunches: give this one a new sweep_name=..., or delete that "
            "job's directory to run it again."
        )
    return state


# ---------------------------------------------------------------------------------------------------------------
# Multi-process training under a launcher


def processes_per_node(trainer: Mapping[str, Any]) -> int:
    """How many ranks Lightning will run on each node for these ``trainer`` settings."""
    devices = trainer.get("devices", "auto")
    if isinstance(devices, int) and devices > 0:
        return devices
    if isinstance(devices, list | tuple):
        return len(devices)
    if isinstance(devices, str) and devices.strip() not in ("auto", "-1"):
        return int(devices) if devices.strip().isdigit() else len([d for d in devices.split(",") if d.strip()])
    if trainer.get("accelerator", "auto") in ("auto", "gpu", "cuda"):  # "auto" or -1: every visible GPU
        import torch

        return max(1, torch.cuda.device_count())
    return 1


def reruns_command(trainer: Mapping[str, Any]) -> bool:
    """Whether Lightning would start ranks 1… by running this process's command line again.

    That is its ``ddp``/``fsdp``/``deepspeed`` launch (and ``auto``, which picks ``ddp``) with more than one
    process per node, unless the processes already exist (SLURM tasks); ``*_spawn``/``*_fork`` start them from
    inside this process instead.
    """
    strategy = str(trainer.get("strategy") or "auto")
    if processes_per_node(trainer) < 2 or any(word in strategy for word in ("spawn", "fork", "notebook")):
        return False
    return strategy == "auto" or strategy.startswith(("ddp", "fsdp", "deepspeed"))


def check_launch(config: DictConfig) -> None:
    """Stop with one message when this multirun's launcher cannot run its jobs' training strategy."""
    trainer = OmegaConf.to_container(config.trainer, resolve=True)
    assert isinstance(trainer, dict)
    launcher = str(OmegaConf.select(config, "hydra.launcher._target_", default=""))
    if launcher.endswith("SlurmLauncher") and shutil.which("srun") is None:  # submitit would fail mid-launch
        raise SweepError(
            f"launcher={_launcher_name(config)} submits the sweep to SLURM, but there is no `srun` on this machine: "
            "launch it from a SLURM login node, or run it here with launcher=submitit_local or the default launcher"
        )
    procs = processes_per_node(trainer)
    if launcher.startswith(TASK_LAUNCHERS):
        devices = trainer.get("devices")
        tasks = OmegaConf.select(config, "hydra.launcher.tasks_per_node", throw_on_resolution_failure=False)
        if not isinstance(devices, int) or devices < 1 or tasks != devices:
            raise SweepError(
                f"launcher={_launcher_name(config)} runs one task per device: set trainer.devices to the number "
                f"of devices per node and leave hydra.launcher.tasks_per_node to follow it (now devices={devices!r}, "
                f"tasks_per_node={tasks!r})."
            )
        return
    if reruns_command(trainer):
        raise SweepError(
            f"trainer.strategy={trainer.get('strategy')} on {procs} devices cannot run inside a Hydra multirun "
            "with this launcher: Lightning starts the other ranks by re-running the command line, which would "
            "launch the whole sweep again in each of them (Lightning issue #11300). Use launcher=submitit_slurm "
            "(or launcher=submitit_local on this machine: one task per device), or run each job as a single run "
            "without -m (python -m posenc.train +encoding=... trainer=ddp), or trainer.strategy=ddp_spawn."
        )


def _launcher_name(config: DictConfig) -> str:
    return str(OmegaConf.select(config, "hydra.runtime.choices", default={}).get("hydra/launcher", "?"))


def join_submitit_tasks() -> None:
    """Under submitit's local executor, give Lightning the ranks of the job's tasks (as SLURM's variables do).

    Without them every task would think it is rank 0 and start its own processes.
    """
    if os.environ.get("SUBMITIT_EXECUTOR") != "local":
        return
    from submitit import JobEnvironment
    from submitit.helpers import TorchDistributedEnvironment

    if JobEnvironment().num_tasks > 1:
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


# ---------------------------------------------------------------------------------------------------------------
# The sweep: W&B group, preflight


def wandb_group(sweep_dir: Path, fallback: str) -> str:
    """The sweep's W&B group, recorded at its first launch (``fallback`` when run outside a recorded sweep)."""
    path = sweep_dir / SWEEP_FILE
    return json.loads(path.read_text())["group"] if path.exists() else fallback


def wandb_run_id(group: str, run_name: str) -> str:
    """A W&B run id that is the same at every launch of a sweep's job, so a resumed job continues its run."""
    return hashlib.sha256(f"{group}/{run_name}".encode()).hexdigest()[:16]


def sweep_jobs(config: DictConfig) -> Iterator[tuple[list[str], DictConfig]]:
    """(overrides, composed config) of every job of a basic-sweeper multirun, as the sweeper will compose them."""
    loader = GlobalHydra.instance().config_loader()
    params = [f"{key}={value}" for key, value in (config.hydra.sweeper.get("params") or {}).items()]
    arguments = params + list(config.hydra.overrides.task)
    overrides = OverridesParser.create(config_loader=loader).parse_overrides(arguments)
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    for job_overrides in BasicSweeper.split_arguments(overrides, None)[0]:
        yield job_overrides, loader.load_sweep_config(config, job_overrides)


class SweepPreflight(Callback):
    """Hydra callback: checks a multirun before its first job and records its W&B group in ``sweep.json``."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # Hydra turns a callback's exceptions into warnings and carries on: a check that cannot run must stop
        # the sweep instead, so every error leaves as a SweepError (a SystemExit, which Hydra lets through).
        try:
            self._check(config)
        except SweepError:
            raise
        except Exception as error:
            raise SweepError(f"posenc could not check this sweep before starting it: {error}") from error

    def _check(self, config: DictConfig) -> None:
        check_launch(config)
        sweep_dir = Path(config.hydra.sweep.dir)
        states = self._job_states(config) if config.hydra.sweeper._target_ == BASIC_SWEEPER else None
        record = _record_launch(sweep_dir, str(config.sweep_name), list(config.hydra.overrides.task))
        summary = f"sweep {config.sweep_name!r} in {sweep_dir} (W&B group {record['group']})"
        if states is not None:
            finished = sum(state.finished for state in states)
            resumed = [state for state in states if state.checkpoint is not None]
            new = len(states) - finished - len(resumed)
            summary += f": {len(states)} jobs, {new} new, {len(resumed)} to resume, {finished} finished (skipped)"
            noted = [state for state in states if state.checkpoint is not None or state.failed]
            summary += "".join(f"\n  {state.run_dir.name}: {state.action}" for state in noted)
        print(summary)

    def _job_states(self, config: DictConfig) -> list[JobState]:
        hydra_config, states, dirs = HydraConfig.instance(), [], {}
        previous = hydra_config.cfg
        jobs = list(sweep_jobs(config))
        common = set.intersection(*(set(overrides) for overrides, _ in jobs)) if jobs else set()
        try:
            for overrides, job_config in jobs:
                hydra_config.set_config(job_config)  # for ${hydra:...} in the job's directory name
                check_launch(job_config)
                run_dir, task_config = job_dir_and_config(job_config)
                require_encoding(task_config, "posenc.train")
                if run_dir in dirs:
                    raise SweepError(
                        f"two jobs of this sweep would share the directory {run_dir} ({' '.join(dirs[run_dir])} | "
                        f"{' '.join(overrides)}): it names scheme, length and seed only. Add what else you sweep "
                        "to it, e.g. hydra.sweep.subdir='${run_name}-${hydra:runtime.choices.model}'."
                    )
                dirs[run_dir] = overrides
                try:
                    # A job that cannot run stops the sweep before any starts; a SLURM job has the GPUs it asks for.
                    submitted = str(OmegaConf.select(job_config, "hydra.launcher._target_", default="")).endswith(
                        "SlurmLauncher"
                    )
                    plain = OmegaConf.to_container(task_config, resolve=True, throw_on_missing=False)
                    validate(plain, cuda=True if submitted else None)  # type: ignore[arg-type]
                    states.append(job_state(run_dir, to_container(task_config)))
                except SystemExit as error:  # a bad value, a damaged checkpoint or record: name the job by its values
                    swept = " ".join(o for o in overrides if o not in common) or " ".join(overrides)
                    raise SweepError(f"job {swept} ({run_dir}): {error}; nothing was started") from None
        finally:
            hydra_config.cfg = previous
        return states


def job_dir_and_config(job_config: DictConfig) -> tuple[Path, DictConfig]:
    """A composed job's run directory and its config without the ``hydra`` node, as the job itself sees them.

    ``${hydra:...}`` in the directory name resolves against the Hydra config in use: set it to ``job_config``.
    """
    task_config = copy.deepcopy(job_config)
    with open_dict(task_config):
        del task_config["hydra"]
    return Path(job_config.hydra.sweep.dir) / str(job_config.hydra.sweep.subdir), task_config


def composed_job_state(job_config: DictConfig) -> JobState:
    """What a job of a sweep will find in its directory, from its composed config (``hydra`` node included)."""
    hydra_config = HydraConfig.instance()
    previous = hydra_config.cfg
    hydra_config.set_config(job_config)
    try:
        run_dir, task_config = job_dir_and_config(job_config)
        return job_state(run_dir, to_container(task_config))
    finally:
        hydra_config.cfg = previous


def _record_launch(sweep_dir: Path, name: str, overrides: list[str]) -> dict[str, Any]:
    path = sweep_dir / SWEEP_FILE
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    record = json.loads(path.read_text()) if path.exists() else {"name": name, "group": f"{name}-{stamp}"}
    record.setdefault("launches", []).append({"time": stamp, "overrides": overrides})
    write_json(path, record)
    return record


def forget_launch(sweep_dir: Path) -> None:
    """Undo the bookkeeping of a launch whose jobs were refused: its record, and the directory if it made it."""
    path = sweep_dir / SWEEP_FILE
    if not path.exists():
        return
    record = json.loads(path.read_text())
    record["launches"] = record.get("launches", [])[:-1]
    if record["launches"]:
        write_json(path, record)
        return
    path.unlink()
    remove_if_only_bookkeeping(sweep_dir, ("multirun.yaml", ".submitit"))
