"""``launcher=submitit_slurm``: Hydra's submitit launcher, told what a posenc sweep knows about its jobs.

The launcher class is ``hydra_plugins.posenc_launcher.PosencSlurmLauncher`` (Hydra takes plugins from there only);
what it does is here.

hydra-submitit-launcher turns a multirun into one SLURM job array and waits for its results. posenc keeps
that, and adds what a sweep of long runs needs:

- a job that finished in an earlier launch (``done.json``) is not submitted again, so relaunching a finished sweep
  submits nothing and a half-finished one submits only the rest (the jobs resume from their checkpoints); a
  relaunch while jobs of an earlier launch are still queued or running is refused, since it would run them twice;
- an ``sbatch`` refusal is one line naming the setting to change, instead of submitit's traceback;
- the wait reports each job as it ends, and a job that ends without a result (``scancel``, a setting the job
  itself refused, a time limit past ``max_num_timeout``) is one line naming its state, its reason and its log,
  once every job has ended. submitit learns that a job is gone from ``sacct``; a cluster without accounting has no
  ``sacct``, so ``squeue`` is asked as well, and the wait cannot outlive the jobs.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from omegaconf import OmegaConf

from posenc.training.sweep import SweepError, composed_job_state, forget_launch, job_dir_and_config

# SLURM job states after which a job will not run again (REQUEUED, PREEMPTED with requeue, PENDING... will).
ENDED_STATES = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "TIMEOUT"}
RESULT_GRACE_S = 10

# What to set when sbatch refuses a job: (words of sbatch's error, lowercased) -> hint.
SBATCH_HINTS = (
    (
        ("generic resource", "gres"),
        "the partition has no GPUs to give: train on CPUs with trainer.accelerator=cpu (no GPU is asked for then), "
        "or pick a partition with GPUs (hydra.launcher.partition=...)",
    ),
    (
        ("more processors", "cpu count", "cpus per"),
        "a node has fewer CPUs than trainer.devices × hydra.launcher.cpus_per_task: lower hydra.launcher.cpus_per_task",
    ),
    (("partition",), "set hydra.launcher.partition to a partition `sinfo` lists (null: the cluster's default)"),
    (("account",), "set hydra.launcher.account to an account you may charge"),
    (("qos",), "set hydra.launcher.qos to a QOS you may use (null: the default)"),
    (("time limit",), "lower hydra.launcher.timeout_min to the partition's limit (`sinfo --format=%l`)"),
    (("memory",), "lower hydra.launcher.mem_gb (null: the partition's default)"),
)
SBATCH_DEFAULT_HINT = (
    "no node of the partition has what each job asks for (hydra.launcher.nodes, tasks_per_node = trainer.devices, "
    "cpus_per_task, gpus_per_node, mem_gb): compare them with `sinfo --Node --long`"
)


def sbatch_refusal(error: str) -> str:
    """One line for an ``sbatch`` error: what SLURM said, then what to set."""
    said = [line.strip() for line in error.splitlines() if line.strip()]
    said = [line for line in said if "error" in line.lower()] or said or ["no reason given"]
    reason = said[-1].removeprefix("sbatch: error: ")
    lowered = reason.lower()
    hint = next((hint for words, hint in SBATCH_HINTS if any(word in lowered for word in words)), SBATCH_DEFAULT_HINT)
    return f"sbatch refused this sweep's jobs ({reason}): {hint}"


def launch(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[JobReturn]:
    """Submit the jobs that have not finished, wait until each has ended, return every job's outcome.

    ``launcher`` is the Hydra plugin (``hydra_plugins.posenc_launcher``): its settings, and the callable each SLURM
    job runs (hydra-submitit-launcher's ``__call__``, and ``checkpoint``, which resubmits it on requeue).
    """
    assert launcher.config is not None and launcher.hydra_context is not None
    returns: dict[int, JobReturn] = {}
    to_submit: list[tuple[int, Sequence[str], str]] = []
    for index, overrides in enumerate(job_overrides):
        job_config = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, list(overrides))
        run_dir, task_config = job_dir_and_config(job_config)
        if composed_job_state(job_config).finished:
            returns[index] = JobReturn(
                overrides=list(overrides),
                cfg=task_config,
                hydra_cfg=job_config,
                working_dir=str(run_dir),
                status=JobStatus.COMPLETED,
            )
        else:
            to_submit.append((index, overrides, run_dir.name))
    if not to_submit:
        print("nothing to submit: every job of this sweep finished in an earlier launch")
        return [returns[index] for index in range(len(job_overrides))]
    active = _still_queued(Path(str(launcher.params["submitit_folder"])).parent)
    if active:  # submitting again would run a second copy of a job in the same directory
        forget_launch(Path(str(launcher.config.hydra.sweep.dir)))
        raise SweepError(
            f"jobs of an earlier launch of this sweep are still queued or running ({', '.join(active)}): wait for "
            f"them to end (squeue --jobs={','.join(active)}) or cancel them (scancel {' '.join(active)}), then relaunch"
        )
    jobs = _submit(launcher, to_submit, initial_job_idx)
    names = {job.job_id: name for job, (_, _, name) in zip(jobs, to_submit, strict=True)}
    problems = _wait(jobs, names)
    for job, (index, _, _) in zip(jobs, to_submit, strict=True):
        if job.job_id not in problems:
            returns[index] = job.results()[0]
    if problems:
        raise SweepError(
            f"{len(problems)} of {len(jobs)} submitted jobs did not finish:\n  "
            + "\n  ".join(problems.values())
            + "\nRelaunch the same command to resume them; "
            f"`python -m posenc.report {launcher.config.hydra.sweep.dir}` reports the jobs that finished."
        )
    return [returns[index] for index in range(len(job_overrides))]


def _submit(launcher: Any, to_submit: list[tuple[int, Sequence[str], str]], initial_job_idx: int) -> list[Any]:
    """One job array through submitit, built as hydra-submitit-launcher builds it; sbatch's refusal in one line."""
    import submitit

    executor_name, params = launcher._EXECUTOR, dict(launcher.params)
    executor = submitit.AutoExecutor(
        cluster=executor_name,
        folder=params.pop("submitit_folder"),
        **{f"{executor_name}_max_num_timeout": params.pop("max_num_timeout")},
    )
    shared = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{key if key in shared else f"{executor_name}_{key}": v for key, v in params.items()})
    Path(str(launcher.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
    job_params = []
    for index, overrides, name in to_submit:
        print(f"  #{initial_job_idx + index} {name}: {' '.join(filter_overrides(overrides))}", flush=True)
        job_number = initial_job_idx + index
        job_params.append(
            (list(overrides), "hydra.sweep.dir", job_number, f"job_id_for_{job_number}", Singleton.get_state())
        )
    folder = Path(str(executor.folder)).parent  # <sweep dir>/.submitit: pickles, then one folder of logs per job
    before = set(folder.iterdir()) if folder.is_dir() else set()
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # submitit echoes sbatch's error before raising it
            jobs = executor.map_array(launcher, *zip(*job_params, strict=True))
    except submitit.core.utils.FailedJobError as error:
        for path in set(folder.iterdir()) - before:  # the refused jobs' pickles and sbatch script
            path.unlink()
        forget_launch(Path(str(launcher.config.hydra.sweep.dir)))
        raise SweepError(sbatch_refusal(str(error))) from None
    first = jobs[0].job_id.split("_")[0]
    print(
        f"submitted {len(jobs)} job(s) as SLURM job {first} (watch: squeue --jobs={first}); "
        f"scheduler logs in {folder}/<job id>/",
        flush=True,  # the launch's log is often a file (nohup, a batch script): show progress as it happens
    )
    return jobs


def _wait(jobs: list[Any], names: dict[str, str]) -> dict[str, str]:
    """Wait until every job has a result or has left the queue without one; one line per job without a result.

    A job's end is its result file (written by submitit as the job returns), or SLURM saying it ended (or no longer
    knowing it) with no result file after ``RESULT_GRACE_S``: on a shared filesystem the file may show late.
    """
    started, ended, problems = time.monotonic(), set(), {}
    gone_since: dict[str, float] = {}
    while len(ended) < len(jobs):
        running = [job for job in jobs if job.job_id not in ended]
        states = _queue_states([job.job_id for job in running])
        for job in running:
            state = None if states is None else states.get(job.job_id, "UNKNOWN TO SLURM")
            if _has_result(job):
                problem = _failure(job, names[job.job_id])
            elif state in ENDED_STATES or state == "UNKNOWN TO SLURM" or (state is None and job.done()):  # sacct
                since = gone_since.setdefault(job.job_id, time.monotonic())
                if time.monotonic() - since < RESULT_GRACE_S:
                    continue
                problem = _no_result(job, names[job.job_id], state or job.state)
            else:
                continue
            ended.add(job.job_id)
            if problem:
                problems[job.job_id] = problem
            print(f"{problem or names[job.job_id] + ': finished'} ({len(ended)}/{len(jobs)} jobs ended)", flush=True)
        if len(ended) < len(jobs):
            time.sleep(min(30.0, 2.0 + (time.monotonic() - started) / 20))  # light on slurmctld for long sweeps
    return problems


def _has_result(job: Any) -> bool:
    return all(job.task(index).paths.result_pickle.exists() for index in range(job.num_tasks))


def _failure(job: Any, name: str) -> str | None:
    """``None`` for a job whose training returned; else one line: the error rank zero ended with, and its log."""
    error = job.exception()  # raised outside the job's function (submitit's own)
    if error is None:
        outcome = job.results()[0]  # Hydra's JobReturn: an exception the job raised is kept in it
        if outcome.status != JobStatus.FAILED:
            return None
        error = outcome._return_value
    message = _last_line(str(error)).rstrip(".")
    if "timed-out too many times" in message:
        message += (
            ": every attempt ran into the time limit; raise hydra.launcher.timeout_min or max_num_timeout, and "
            "relaunch to resume it"
        )
    return f"{name} (SLURM job {job.job_id}) failed: {message}; its log: {job.paths.stderr}"


def _no_result(job: Any, name: str, state: str) -> str:
    """One line for a job that ended without a result: its SLURM state, why, and where its log is."""
    log = job.paths.stderr
    reason = _last_line(log.read_text(errors="replace")) if log.exists() else ""
    if state == "FAILED" and reason:  # the job's own one-line error (a setting it refused)
        return f"{name} (SLURM job {job.job_id}) failed: {reason}; its log: {log}"
    return f"{name} (SLURM job {job.job_id}) ended {state}; relaunching the sweep resumes it; its log: {log}"


def _last_line(text: str) -> str:
    """The last line a job wrote that is its own (not srun's or slurmstepd's notices about it)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    own = [line for line in lines if not line.startswith(("srun:", "slurmstepd:", "submitit "))]
    return (own or lines or [""])[-1]


def _still_queued(folder: Path) -> list[str]:
    """Jobs submitted by an earlier launch (submitit keeps a folder per job) that SLURM has not finished."""
    if not folder.is_dir():
        return []
    ids = sorted({path.name.split("_")[0] for path in folder.iterdir() if path.name.split("_")[0].isdigit()})
    states = _queue_states(ids) if ids else {}
    return sorted(job for job, state in (states or {}).items() if state not in ENDED_STATES)


def _queue_states(job_ids: list[str]) -> dict[str, str] | None:
    """SLURM's state of each job (array tasks as ``<array>_<task>``), from ``squeue``; ``None`` if it did not answer.

    A job SLURM no longer knows (purged ``MinJobAge`` after it ended) is missing from the answer.
    """
    command = ["squeue", "--noheader", "--array", "--states=all", "--format=%i %T", f"--jobs={','.join(job_ids)}"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode and "invalid job id" not in done.stderr.lower():
        return None
    return dict(line.split(maxsplit=1) for line in done.stdout.splitlines() if len(line.split()) == 2)
