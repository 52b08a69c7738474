"""Sweeps on a real SLURM scheduler: a one-node cluster on this machine (the ``slurm_cluster`` fixture).

Submitted as a job array; relaunched without submitting anything; refused by sbatch in one line; two SLURM tasks
joined into one DDP world; a time limit and a preemption survived by saving, requeueing and resuming at the step
where the job stopped (identical to an uninterrupted run); a cancelled job resumed by relaunching the sweep; a bad
setting failing once. Every wait has a bound, and every test leaves the queue empty.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from posenc.cluster import local
from posenc.cluster.local import REQUEUE_DELAY_S, LocalCluster
from posenc.config import CONF_DIR
from posenc.runs import DONE_FILE

pytestmark = pytest.mark.slurm

SWEEPS = CONF_DIR.parent / "sweeps"
# The smoke sweep (two schemes, 20 CPU steps) through SLURM, one CPU per task: the local node has this machine's few.
SLURM_SWEEP = [sys.executable, "-m", "posenc.train", "-m", "-cd", str(SWEEPS), "-cn", "smoke"]
ON_SLURM = ["launcher=submitit_slurm", "hydra.launcher.cpus_per_task=1"]
# One job long enough to be stopped while it trains; its checkpoint every 10 steps shows that it has started.
LONG_JOB = [
    "+encoding=alibi",
    "trainer.max_steps=100",
    "checkpoint_every_n_steps=10",
    "trainer.val_check_interval=50",
    "logger=csv",
    "trainer.log_every_n_steps=1",
]
SUBMITTED = re.compile(r"submitted \d+ job\(s\) as SLURM job (\d+)")


def environment(cluster: LocalCluster) -> dict[str, str]:
    return {**os.environ, **cluster.env, "WANDB_MODE": "disabled"}


def sweep(cwd: Path, cluster: LocalCluster, *overrides: str, timeout_s: int = 600) -> subprocess.CompletedProcess:
    command = [*SLURM_SWEEP, *ON_SLURM, *overrides]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, env=environment(cluster))


def wait_until(condition: Callable[[], object], timeout_s: float, what: str) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"waited {timeout_s:.0f} s for {what}")


def job_info(cluster: LocalCluster, job_id: str) -> dict[str, str]:
    """``scontrol show job``'s fields (JobState, Restarts, ...) for one job or array task."""
    shown = cluster.run("scontrol", "show", "job", job_id)
    return dict(item.split("=", 1) for item in shown.split() if "=" in item)


def all_job_ids(cluster: LocalCluster) -> set[str]:
    """Every job the cluster remembers, finished ones included (for MinJobAge, 300 s: compare with ``<=``)."""
    return set(cluster.run("squeue", "--noheader", "--array", "--states=all", "--format=%i").split())


def job_logs(sweep_dir: Path, job_id: str) -> tuple[str, str]:
    """(stdout, stderr) of a single job's first task, where submitit puts them: <sweep dir>/.submitit/<job id>/."""
    folder = sweep_dir / ".submitit" / job_id
    return tuple((folder / f"{job_id}_0_log.{kind}").read_text() for kind in ("out", "err"))  # type: ignore[return-value]


def curves(run_dir: Path) -> dict[str, dict[int, str]]:
    """train/loss and val/loss by step from metrics.csv, exactly as logged; every value logged once."""
    with (run_dir / "csv" / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    logged = Counter((row["step"], name) for row in rows for name in ("train/loss", "val/loss") if row.get(name))
    assert max(logged.values()) == 1, "a step's figure was logged twice"
    return {name: {int(row["step"]): row[name] for row in rows if row.get(name)} for name in ("train/loss", "val/loss")}


class Launch:
    """A sweep command running in the background, its output in files (no pipe to fill up)."""

    def __init__(self, cwd: Path, cluster: LocalCluster, overrides: tuple[str, ...]) -> None:
        self.stdout, self.stderr = cwd / "launch.out", cwd / "launch.err"
        with self.stdout.open("w") as out, self.stderr.open("w") as err:
            command = [*SLURM_SWEEP, *ON_SLURM, *overrides]
            self.process = subprocess.Popen(command, cwd=cwd, stdout=out, stderr=err, env=environment(cluster))

    def job_id(self) -> str:
        def submitted() -> re.Match | None:
            found = SUBMITTED.search(self.stdout.read_text())
            if not found and self.process.poll() is not None:
                raise AssertionError(f"the sweep ended without submitting: {self.stderr.read_text()[-3000:]}")
            return found

        return wait_until(submitted, 120, "the sweep's submission").group(1)  # type: ignore[union-attr]

    def wait(self, timeout_s: float) -> tuple[int, str, str]:
        code = self.process.wait(timeout=timeout_s)
        return code, self.stdout.read_text(), self.stderr.read_text()


@pytest.fixture
def cluster(slurm_cluster: LocalCluster) -> Iterator[LocalCluster]:
    """The session's cluster, left with an empty queue by each test."""
    yield slurm_cluster
    left = slurm_cluster.jobs()
    if left:
        slurm_cluster.run("scancel", *left)
    wait_until(lambda: not slurm_cluster.jobs(), 120, "the test's jobs to leave the queue")


@pytest.fixture
def background(cluster: LocalCluster) -> Iterator[Callable[..., Launch]]:
    """Start sweep commands in the background; any still running when the test ends is killed (by its pid)."""
    launches: list[Launch] = []

    def start(cwd: Path, *overrides: str) -> Launch:
        launches.append(Launch(cwd, cluster, overrides))
        return launches[-1]

    yield start
    for launch in launches:
        if launch.process.poll() is None:
            launch.process.kill()
            launch.process.wait()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """LONG_JOB run start to end on this machine, without SLURM: what a stopped and resumed job must equal."""
    cwd = tmp_path_factory.mktemp("uninterrupted")
    env = {**os.environ, "WANDB_MODE": "disabled"}
    done = subprocess.run([*SLURM_SWEEP, *LONG_JOB], cwd=cwd, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = cwd / "outputs" / "sweeps" / "smoke" / "alibi-L32-s0"
    return {"run": json.loads((run_dir / "run.json").read_text()), "curves": curves(run_dir)}


def test_a_sweep_runs_as_a_job_array_and_a_relaunch_submits_nothing(tmp_path: Path, cluster: LocalCluster) -> None:
    result = sweep(tmp_path, cluster)
    assert result.returncode == 0, result.stderr[-3000:]
    array = SUBMITTED.search(result.stdout).group(1)  # type: ignore[union-attr]
    sweep_dir = tmp_path / "outputs" / "sweeps" / "smoke"
    for task, job in enumerate(("alibi-L32-s0", "rope-L32-s0")):
        info = job_info(cluster, f"{array}_{task}")  # one array, one task per job
        assert (info["ArrayJobId"], info["ArrayTaskId"], info["JobState"]) == (array, str(task), "COMPLETED")
        run = json.loads((sweep_dir / job / "run.json").read_text())
        assert run["run_name"] == job and run["steps"] == 20 and run["eval"]["ppl@4x"] > 1
        assert (sweep_dir / job / DONE_FILE).exists() and (sweep_dir / job / "eval" / "results.json").exists()
        assert "global batch 8" in (sweep_dir / job / "train.log").read_text()  # the run's own log, in its directory
        scheduler_log = sweep_dir / ".submitit" / f"{array}_{task}" / f"{array}_{task}_0_log.out"
        assert "Job completed successfully" in scheduler_log.read_text()  # where the README says logs go
    assert (sweep_dir / "report.md").exists()
    assert "alibi-L32-s0: finished" in result.stdout and "(2/2 jobs ended)" in result.stdout

    known, done_before = all_job_ids(cluster), {p: p.stat().st_mtime_ns for p in sweep_dir.glob(f"*/{DONE_FILE}")}
    relaunch = sweep(tmp_path, cluster)
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]
    assert "2 jobs, 0 new, 0 to resume, 2 finished (skipped)" in relaunch.stdout
    assert "nothing to submit" in relaunch.stdout and not SUBMITTED.search(relaunch.stdout)
    assert all_job_ids(cluster) <= known  # no job reached the scheduler
    assert {p: p.stat().st_mtime_ns for p in sweep_dir.glob(f"*/{DONE_FILE}")} == done_before

    record = (sweep_dir / "sweep.json").read_text()
    changed = sweep(tmp_path, cluster, "trainer.max_steps=30")
    assert changed.returncode == 1
    assert "trainer.max_steps: 20 -> 30" in changed.stderr and len(changed.stderr.strip().splitlines()) == 1
    assert all_job_ids(cluster) <= known and (sweep_dir / "sweep.json").read_text() == record


@pytest.mark.parametrize(
    ("overrides", "hint"),
    [
        ((), "lower hydra.launcher.cpus_per_task"),  # the launcher's 8 CPUs per task: more than this node has
        (("hydra.launcher.cpus_per_task=1", "trainer.accelerator=auto"), "trainer.accelerator=cpu"),  # asks for a GPU
    ],
)
def test_an_sbatch_refusal_is_one_line_saying_what_to_set(
    tmp_path: Path, cluster: LocalCluster, overrides: tuple[str, ...], hint: str
) -> None:
    known = all_job_ids(cluster)
    command = [*SLURM_SWEEP, "launcher=submitit_slurm", *overrides]
    env = environment(cluster)
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 1
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("sbatch refused this sweep's jobs (") and hint in line
    assert all_job_ids(cluster) <= known
    assert list(tmp_path.iterdir()) == []  # nothing written: no sweep.json, no pickles


def test_two_slurm_tasks_train_as_one_ddp_world_and_log_once(tmp_path: Path, cluster: LocalCluster) -> None:
    ddp = ["+encoding=alibi", "trainer.devices=2", "trainer.accelerator=cpu", "trainer.max_steps=8"]
    result = sweep(tmp_path, cluster, *ddp, "logger=csv", "trainer.log_every_n_steps=1", "trainer.val_check_interval=4")
    assert result.returncode == 0, result.stderr[-3000:]
    job = SUBMITTED.search(result.stdout).group(1)  # type: ignore[union-attr]
    assert job_info(cluster, job)["NumTasks"] == "2"
    sweep_dir = tmp_path / "outputs" / "sweeps" / "smoke"
    run_dir = sweep_dir / "alibi-L32-s0"
    run = json.loads((run_dir / "run.json").read_text())
    # Batch 8 per task on 2 tasks: 16 windows of 32 tokens per step, one run.
    assert (run["world_size"], run["global_batch_size"], run["tokens_per_step"], run["steps"]) == (2, 16, 512, 8)
    with (run_dir / "csv" / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    losses = [int(row["step"]) for row in rows if row["train/loss"]]
    assert losses == list(range(8))  # every step once: only rank zero logs
    assert [float(row["train/tokens"]) for row in rows if row["train/tokens"]] == [512.0 * s for s in range(1, 9)]
    logs = [(sweep_dir / ".submitit" / job / f"{job}_{task}_log.out").read_text() for task in (0, 1)]
    assert "global_rank=0(2)" in logs[0] and "global_rank=1(2)" in logs[1]  # one world of two ranks
    assert "Perplexity of alibi" in logs[0] and "Perplexity of alibi" not in logs[1]  # rank zero alone evaluates
    assert (run_dir / DONE_FILE).exists() and (run_dir / "eval" / "results.json").exists()


def test_a_preempted_job_resumes_where_it_stopped_and_equals_an_uninterrupted_run(
    tmp_path: Path, cluster: LocalCluster, background: Callable[..., Launch], uninterrupted: dict
) -> None:
    launch = background(tmp_path, *LONG_JOB, "sweep_name=preempted")
    job = launch.job_id()
    run_dir = tmp_path / "outputs" / "sweeps" / "preempted" / "alibi-L32-s0"
    wait_until((run_dir / "checkpoints" / "last.ckpt").exists, 300, "the job to train its first 10 steps")
    cluster.run("scontrol", "requeue", job)  # what a preemption with PreemptMode=REQUEUE does
    code, _, err = launch.wait(900)
    assert code == 0, err[-3000:]
    _, job_err = job_logs(tmp_path / "outputs" / "sweeps" / "preempted", job)
    stopped = re.search(r"stopped by SIGTERM at step (\d+) and saved", job_err)
    assert stopped, job_err[-3000:]
    assert job_info(cluster, job)["Restarts"] == "1"
    run = json.loads((run_dir / "run.json").read_text())
    assert run["resumed_from"]["step"] == int(stopped.group(1)) >= 10 and run["steps"] == 100
    # The same figures, bit for bit: the loss at every step, the validation losses, the final perplexities.
    assert curves(run_dir) == uninterrupted["curves"]
    assert run["eval"] == uninterrupted["run"]["eval"]


def test_a_cancelled_job_resumes_when_the_sweep_is_relaunched(
    tmp_path: Path, cluster: LocalCluster, background: Callable[..., Launch], uninterrupted: dict
) -> None:
    launch = background(tmp_path, *LONG_JOB, "sweep_name=cancelled")
    job = launch.job_id()
    sweep_dir = tmp_path / "outputs" / "sweeps" / "cancelled"
    wait_until((sweep_dir / "alibi-L32-s0" / "checkpoints" / "last.ckpt").exists, 300, "the job's first 10 steps")
    cluster.run("scancel", job)
    code, _, err = launch.wait(120)  # the launch sees the job gone (squeue) and ends by itself
    assert code == 1 and "Traceback" not in err
    assert f"alibi-L32-s0 (SLURM job {job}) ended CANCELLED; relaunching the sweep resumes it" in err
    stopped = re.search(r"stopped by SIGTERM at step (\d+) and saved", job_logs(sweep_dir, job)[1])
    assert stopped

    relaunch = sweep(tmp_path, cluster, *LONG_JOB, "sweep_name=cancelled", timeout_s=900)
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]
    assert f"alibi-L32-s0: resume from step {stopped.group(1)}" in relaunch.stdout
    run = json.loads((sweep_dir / "alibi-L32-s0" / "run.json").read_text())
    assert run["resumed_from"]["step"] == int(stopped.group(1)) and run["eval"] == uninterrupted["run"]["eval"]


def test_a_relaunch_while_the_sweeps_jobs_are_queued_is_refused(
    tmp_path: Path, cluster: LocalCluster, background: Callable[..., Launch]
) -> None:
    held = "+hydra.launcher.additional_parameters.hold=true"  # sbatch --hold: the job waits in the queue
    launch = background(tmp_path, "+encoding=alibi", held)
    job = launch.job_id()
    assert job_info(cluster, job)["JobState"] == "PENDING"
    known, record = all_job_ids(cluster), (tmp_path / "outputs" / "sweeps" / "smoke" / "sweep.json").read_text()
    again = sweep(tmp_path, cluster, "+encoding=alibi")
    assert again.returncode == 1
    assert again.stderr.strip() == (
        f"jobs of an earlier launch of this sweep are still queued or running ({job}): wait for them to end "
        f"(squeue --jobs={job}) or cancel them (scancel {job}), then relaunch"
    )
    assert all_job_ids(cluster) <= known  # a second copy of the job would train in the same directory
    assert (tmp_path / "outputs" / "sweeps" / "smoke" / "sweep.json").read_text() == record
    cluster.run("scancel", job)
    code, _, err = launch.wait(120)
    assert code == 1 and f"alibi-L32-s0 (SLURM job {job}) ended CANCELLED" in err


def test_a_job_out_of_time_saves_is_requeued_and_resumes(
    tmp_path: Path, cluster: LocalCluster, background: Callable[..., Launch], uninterrupted: dict
) -> None:
    # SLURM's time limits are whole minutes, checked every 30 s: with a 1-minute limit and the signal asked for 25 s
    # before it, the signal comes 5-35 s into the job. The run is sized from this machine's pace to train for about
    # 75 s, so the signal finds it training; once it has saved, the limit is raised so that the rest fits.
    uninterrupted_run = uninterrupted["run"]
    steps_per_s = uninterrupted_run["steps"] / uninterrupted_run["train_loop_seconds"]
    steps = max(300, int(steps_per_s * 75))
    launch = background(
        tmp_path,
        "+encoding=alibi",
        f"trainer.max_steps={steps}",
        f"checkpoint_every_n_steps={steps}",  # no checkpoint but the one the signal asks for
        f"trainer.val_check_interval={steps}",
        "logger=csv",
        "trainer.log_every_n_steps=1",
        "sweep_name=timelimit",
        "hydra.launcher.timeout_min=1",
        "hydra.launcher.signal_delay_s=25",
        "hydra.launcher.max_num_timeout=5",
    )
    job = launch.job_id()
    sweep_dir = tmp_path / "outputs" / "sweeps" / "timelimit"

    def saved_step() -> int | None:
        log = sweep_dir / ".submitit" / job / f"{job}_0_log.out"
        found = re.findall(r"time-limit signal: saved \S+ at step (\d+)", log.read_text() if log.exists() else "")
        return int(found[-1]) if found else None

    saved = wait_until(saved_step, 300, "SLURM's time-limit signal to reach the training job")
    cluster.run("scontrol", "update", f"JobId={job}", "TimeLimit=10")
    code, _, err = launch.wait(900)
    assert code == 0, err[-3000:]
    out, _ = job_logs(sweep_dir, job)
    assert "this job is timed-out" in out and "Requeued job" in out  # submitit's timeout, counted
    assert int(job_info(cluster, job)["Restarts"]) >= 1
    run = json.loads((sweep_dir / "alibi-L32-s0" / "run.json").read_text())
    assert run["resumed_from"]["step"] == saved_step() >= saved and run["steps"] == steps  # type: ignore[operator]
    assert (sweep_dir / "alibi-L32-s0" / DONE_FILE).exists()
    assert sorted(curves(sweep_dir / "alibi-L32-s0")["train/loss"]) == list(range(steps))  # every step, once


def test_a_job_refusing_its_setting_fails_once_with_its_error_in_the_job_log(
    tmp_path: Path, cluster: LocalCluster
) -> None:
    missing = tmp_path / "missing.txt"  # the preflight cannot know: the job reads its data where it runs
    result = sweep(tmp_path, cluster, "+encoding=alibi", "data=text", f"data.corpus_options.paths=[{missing}]")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    job = SUBMITTED.search(result.stdout).group(1)  # type: ignore[union-attr]
    message = f"data=text found no files for ['{missing}']"
    assert f"alibi-L32-s0 (SLURM job {job}) failed: {message}" in result.stderr
    _, job_err = job_logs(tmp_path / "outputs" / "sweeps" / "smoke", job)
    own = [line for line in job_err.splitlines() if line.strip() and not line.startswith(("srun:", "slurmstepd"))]
    assert own[-1].startswith(message) and "Traceback" not in job_err  # the job's last word: its one-line error
    time.sleep(REQUEUE_DELAY_S + 5)  # long enough for a requeued job to have started again
    info = job_info(cluster, job)
    assert (info["JobState"], info["Restarts"]) == ("FAILED", "0")


def test_the_helper_starts_a_cluster_and_stops_everything_it_started(slurm_cluster: LocalCluster) -> None:
    root = Path(tempfile.mkdtemp(prefix="posenc-helper-"))  # a second cluster beside the session's
    helper = [sys.executable, "-m", "posenc.cluster.local"]

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*helper, *args, "--dir", str(root)], capture_output=True, text=True, timeout=120)

    try:
        up = run("up")
        assert up.returncode == 0, up.stderr
        assert f"export SLURM_CONF={root}/slurm.conf" in up.stdout
        cluster = LocalCluster(root)
        assert cluster.node_state() == "idle" and set(cluster.pids()) == {"munged", "slurmctld", "slurmd"}
        assert cluster.run("srun", "--ntasks=2", "hostname").count("\n") == 2  # two tasks, as a DDP job runs
        again = run("up")
        assert again.returncode == 1 and again.stderr.strip() == (
            f"a local cluster already runs from {root}: stop it first (down --dir {root})"
        )
        assert set(local.processes(cluster)) >= set(cluster.pids().values())  # the daemons carry its SLURM_CONF
        down = run("down")
        assert down.returncode == 0 and down.stdout.strip() == f"local SLURM cluster in {root} stopped"
        assert local.processes(cluster) == {}  # daemons and whatever they started: gone
    finally:
        local.stop(root)
        shutil.rmtree(root, ignore_errors=True)
