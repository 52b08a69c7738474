"""Sweeps: the smoke sweep end to end, relaunch (skip, resume, refuse changes), the shipped sweep configs, SLURM."""

from __future__ import annotations

import itertools
import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import submitit
from helpers import FAST, compose_train
from hydra import compose, initialize_config_dir
from hydra._internal.callbacks import Callbacks
from hydra.core.global_hydra import GlobalHydra
from hydra.types import HydraContext
from hydra.utils import instantiate
from omegaconf import OmegaConf

from posenc.config import CONF_DIR, encoding_choices
from posenc.encodings import available
from posenc.layout import encoding_label
from posenc.report.studies import STUDIES
from posenc.runs import read_checkpoint, write_done
from posenc.runs.loggers import build_loggers
from posenc.train import train
from posenc.training.sweep import (
    DONE_FILE,
    SWEEP_FILE,
    SweepError,
    job_state,
    setting_changes,
    wandb_run_id,
)

SWEEPS = CONF_DIR.parent / "sweeps"
SMOKE = [sys.executable, "-m", "posenc.train", "-m", "-cd", str(SWEEPS), "-cn", "smoke"]
# Kills the process at step 12 of the first job, after its step-10 checkpoint: a preempted or crashed sweep.
CRASH_AT_STEP_12 = """
import os, sys
import posenc.training.lit
step = posenc.training.lit.LitDecoder.training_step
def crash(self, batch, index):
    if self.global_step == 12:
        os._exit(3)
    return step(self, batch, index)
posenc.training.lit.LitDecoder.training_step = crash
from posenc.train import main
sys.argv = ["posenc.train", *sys.argv[1:]]
main()
"""

# Lists the jobs a sweep would run, as its preflight composes them, and stops before launching any.
LIST_JOBS = """
import os, sys
from posenc.training import sweep
def list_jobs(self, config, **kwargs):
    print(f"eval={config.eval.at_end}")
    for state in self._job_states(config):
        print("JOB", state.run_dir, state.action)
    os._exit(0)
sweep.SweepPreflight.on_multirun_start = list_jobs
from posenc.train import main
sys.argv = ["posenc.train", *sys.argv[1:]]
main()
"""


def launch(cwd: Path, *args: str, command: list[str] = SMOKE, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "WANDB_MODE": "disabled", **env}
    return subprocess.run([*command, *args], cwd=cwd, capture_output=True, text=True, timeout=600, env=environment)


def test_smoke_sweep_runs_end_to_end(tmp_path: Path) -> None:
    result = launch(tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    sweep_dir = tmp_path / "outputs" / "sweeps" / "smoke"
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == ["alibi-L32-s0", "rope-L32-s0"]
    for job in ("alibi-L32-s0", "rope-L32-s0"):
        run = json.loads((sweep_dir / job / "run.json").read_text())
        assert run["run_name"] == job and run["steps"] == 20 and run["eval"]["ppl@4x"] > 1
        assert json.loads((sweep_dir / job / DONE_FILE).read_text())["steps"] == 20
        assert (sweep_dir / job / "eval" / "results.json").exists()
    assert json.loads((sweep_dir / SWEEP_FILE).read_text())["group"].startswith("smoke-")
    assert "2 jobs, 2 new, 0 to resume, 0 finished" in result.stdout
    assert (sweep_dir / "report.md").exists()  # posenc.report's callback, at the end of the sweep


def test_relaunch_skips_finished_resumes_interrupted_and_refuses_changes(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "outputs" / "sweeps" / "smoke"
    alibi, rope = sweep_dir / "alibi-L32-s0", sweep_dir / "rope-L32-s0"

    crashing = [sys.executable, "-c", CRASH_AT_STEP_12, *SMOKE[3:]]
    crashed = launch(tmp_path, command=crashing)
    assert crashed.returncode == 3, crashed.stderr[-3000:]
    assert read_checkpoint(alibi / "checkpoints" / "last.ckpt")[0] == 10
    assert not (alibi / DONE_FILE).exists() and not rope.exists()

    resumed = launch(tmp_path, WANDB_MODE="offline")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "2 jobs, 1 new, 1 to resume, 0 finished" in resumed.stdout
    assert "alibi-L32-s0: resume from step 10" in resumed.stdout
    run = json.loads((alibi / "run.json").read_text())
    # 10 steps of 8 windows were trained on: the resumed run goes on from window 80, to step 20.
    assert run["resumed_from"]["step"] == 10 and run["resumed_from"]["start_sample"] == 80
    assert run["steps"] == 20 and (alibi / DONE_FILE).exists() and (rope / DONE_FILE).exists()
    group = json.loads((sweep_dir / SWEEP_FILE).read_text())["group"]
    for job in (alibi, rope):  # one W&B run per job, in the sweep's group, under the job's stable id
        (offline_run,) = (job / "wandb").glob("offline-run-*")
        assert offline_run.name.endswith(wandb_run_id(group, job.name))

    # Same windows, same restored state: the resumed job ends exactly where an uninterrupted one does.
    reference = launch(tmp_path, "+encoding=alibi", "sweep_name=uninterrupted")
    assert reference.returncode == 0, reference.stderr[-3000:]
    uninterrupted = json.loads((tmp_path / "outputs/sweeps/uninterrupted/alibi-L32-s0/run.json").read_text())
    assert run["eval"] == pytest.approx(uninterrupted["eval"], rel=1e-5)

    done_before = {job: (job / DONE_FILE).stat().st_mtime_ns for job in (alibi, rope)}
    skipped = launch(tmp_path)
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    assert "2 jobs, 0 new, 0 to resume, 2 finished (skipped)" in skipped.stdout
    assert "alibi-L32-s0: finished earlier" in skipped.stdout and "rope-L32-s0: finished earlier" in skipped.stdout
    assert {job: (job / DONE_FILE).stat().st_mtime_ns for job in (alibi, rope)} == done_before

    sweep_record = (sweep_dir / SWEEP_FILE).read_text()
    changed = launch(tmp_path, "trainer.max_steps=30")
    assert changed.returncode != 0
    assert "trainer.max_steps: 20 -> 30" in changed.stderr and "new sweep_name" in changed.stderr
    assert "Traceback" not in changed.stderr
    assert (sweep_dir / SWEEP_FILE).read_text() == sweep_record  # stopped before anything was written
    assert {job: (job / DONE_FILE).stat().st_mtime_ns for job in (alibi, rope)} == done_before


def test_job_state_skips_resumes_and_refuses(tmp_path: Path) -> None:
    config = {"run_name": "alibi-L16-s0", "seed": 0, "trainer": {"max_steps": 3, "enable_progress_bar": True}}
    assert job_state(tmp_path, config).action == "new"
    write_done(tmp_path, config, steps=3)
    relaunch = {**config, "trainer": {"max_steps": 3, "enable_progress_bar": False}, "logger": {"group": "x"}}
    assert job_state(tmp_path, relaunch).finished  # how a run shows progress or logs is not the experiment
    with pytest.raises(SweepError, match=r"seed: 0 -> 1"):
        job_state(tmp_path, {**config, "seed": 1})
    assert setting_changes({"eval": {"multiples": [1, 2]}}, {"eval": {"multiples": [1, 2, 4]}}) == [
        "eval.multiples: [1, 2] -> [1, 2, 4]"
    ]


def test_a_resumed_run_trains_on_fresh_windows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from posenc.data import datamodule

    train(compose_train("+encoding=alibi", *FAST), tmp_path)  # 3 steps of 4 windows: windows 0..11
    seen: list[int] = []
    get = datamodule.RandomWindows.__getitem__
    monkeypatch.setattr(
        datamodule.RandomWindows, "__getitem__", lambda self, index: seen.append(self.start + index) or get(self, index)
    )
    overrides = [o for o in FAST if not o.startswith("trainer.max_steps")]
    summary = train(compose_train("+encoding=alibi", *overrides, "trainer.max_steps=5", "resume=last"), tmp_path)
    assert summary["steps"] == 5 and summary["resumed_from"]["start_sample"] == 12
    assert seen[:8] == list(range(12, 20))


def config_labels(exclude: tuple[str, ...] = ()) -> set[str]:
    """The run label of every config in conf/encoding/ but ``exclude``: a scheme's own name, or the stack or schedule
    it configures (``ssmax`` trains as ``rope+ssmax``), or the name a layout gives itself; every registered scheme is
    among their members."""
    labels = set()
    for choice in set(encoding_choices()) - set(exclude):
        spec = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "encoding" / f"{choice}.yaml"), resolve=False)
        labels.add(encoding_label(spec))
    members = {part for label in labels for entry in label.split(",") for part in entry.split("×")[0].split("+")}
    assert len(labels) == len(set(encoding_choices()) - set(exclude)), "two configs share a label (a run directory)"
    assert set(available()) <= members, f"registered but in no config: {set(available()) - members}"
    return labels


def test_extrapolation_sweep_covers_every_scheme_seed_and_length(tmp_path: Path) -> None:
    listing = [sys.executable, "-c", LIST_JOBS, "-m", "-cd", str(SWEEPS), "-cn", "extrapolation"]
    result = launch(tmp_path, command=listing)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.split() for line in result.stdout.splitlines() if line.startswith("JOB ")]
    assert all(action == "new" for _, _, action in lines)
    jobs = [Path(path) for _, path, _ in lines]
    names = [job.name for job in jobs]
    labels = {name.rsplit("-", 2)[0] for name in names}
    assert labels == config_labels(exclude=("gemma3",)) and {"rope×3,nope", "rope+alibi", "irope"} <= labels
    assert len(names) == len(set(names)) == len(labels) * 3 * 2
    assert {name.rsplit("-", 2)[1] for name in names} == {"L64", "L128"}
    assert {name.rsplit("-", 2)[2] for name in names} == {"s0", "s1", "s2"}
    assert {job.parent for job in jobs} == {Path("outputs/sweeps/extrapolation")}
    assert "eval=True" in result.stdout
    assert not (tmp_path / "outputs").exists()


def test_gpu_reproduction_sweep_trains_every_config_at_512_with_the_small_model(tmp_path: Path) -> None:
    listing = [sys.executable, "-c", LIST_JOBS, "-m", "-cd", str(SWEEPS), "-cn", "repro_gpu"]
    result = launch(tmp_path, command=listing)
    assert result.returncode == 0, result.stderr[-3000:]
    names = [Path(line.split()[1]).name for line in result.stdout.splitlines() if line.startswith("JOB ")]
    assert {name.rsplit("-", 2)[0] for name in names} == config_labels()
    assert {name.rsplit("-", 2)[1] for name in names} == {"L512"} and len(names) == len(encoding_choices())
    config = compose_train("+encoding=alibi", "experiment=repro_gpu")
    assert (config.model.depth, config.model.dim, config.model.heads) == (12, 768, 12)
    assert config.trainer.precision == "bf16-mixed" and config.compile == "auto"
    assert list(config.eval.multiples) == [1, 2, 4, 8, 16, 32]


class _SubmittedError(Exception):
    """Stops the launcher where sbatch would run: nothing is submitted."""


def _sbatch_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *overrides: str) -> tuple[str, Any]:
    """The sbatch script the SLURM launcher would submit for a two-job sweep, and submitit's executor."""
    fake_srun = tmp_path / "bin" / "srun"  # submitit only checks that srun exists
    fake_srun.parent.mkdir(exist_ok=True)
    fake_srun.write_text("#!/bin/sh\nexit 1\n")
    fake_srun.chmod(fake_srun.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake_srun.parent}{os.pathsep}{os.environ['PATH']}")
    executors = []

    def submit(self: Any, *args: Any) -> None:
        executors.append(self)
        raise _SubmittedError

    monkeypatch.setattr(submitit.AutoExecutor, "map_array", submit)
    overrides = ("+encoding=alibi", "launcher=submitit_slurm", f"output_root={tmp_path}", *overrides)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        config = compose("train", overrides=list(overrides), return_hydra_config=True)
        launcher = instantiate(config.hydra.launcher)
        context = HydraContext(config_loader=GlobalHydra.instance().config_loader(), callbacks=Callbacks())
        launcher.setup(hydra_context=context, task_function=None, config=config)
        jobs = [[*config.hydra.overrides.task, f"seed={seed}"] for seed in (0, 1)]  # as the sweeper passes them
        with pytest.raises(_SubmittedError):
            launcher.launch(jobs, initial_job_idx=0)  # the plugins' own code, up to sbatch
    (executor,) = executors
    return executor._executor._make_submission_file_text("python -m posenc.train", "uid"), executor


def test_submitit_slurm_config_builds_the_expected_sbatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    overrides = ("trainer=ddp", "trainer.num_nodes=2", "hydra.launcher.partition=gpu", "hydra.launcher.account=lab")
    sbatch, executor = _sbatch_script(tmp_path, monkeypatch, *overrides)
    for line in (
        "--partition=gpu",
        "--account=lab",
        "--nodes=2",
        "--ntasks-per-node=4",  # one task per GPU: Lightning's SLURMEnvironment runs DDP from these
        "--gpus-per-node=4",
        "--cpus-per-task=8",
        "--time=240",
        "--job-name=multirun",
        "--signal=USR2@120",
    ):
        assert f"#SBATCH {line}\n" in sbatch, line
    assert executor._executor.max_num_timeout == 3  # a job out of time is requeued, and resumes
    assert str(tmp_path / "sweeps" / "multirun" / ".submitit") in str(executor._executor.folder)


def test_a_cpu_run_asks_slurm_for_no_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sbatch, _ = _sbatch_script(tmp_path, monkeypatch, "trainer.accelerator=cpu", "trainer.devices=2")
    assert "#SBATCH --ntasks-per-node=2\n" in sbatch and "gpus" not in sbatch  # a CPU partition refuses any GPU


def test_slurm_launcher_without_srun_is_refused_in_one_line_before_anything_is_written(tmp_path: Path) -> None:
    python_only = tmp_path / "bin"  # a PATH that has python but no srun
    python_only.mkdir()
    (python_only / "python").symlink_to(sys.executable)
    env = {**os.environ, "PATH": str(python_only), "PYTHONPATH": str(CONF_DIR.parent), "WANDB_MODE": "disabled"}
    command = [sys.executable, "-m", "posenc.train", "-m", "+encoding=alibi", "launcher=submitit_slurm"]
    done = subprocess.run([*command, f"output_root={tmp_path / 'out'}"], capture_output=True, text=True, env=env)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and "no `srun` on this machine" in done.stderr
    assert not (tmp_path / "out").exists()  # no sweep.json, no multirun.yaml


def test_sweep_jobs_log_into_the_sweep_group_under_a_stable_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_MODE")
    cfg = {"kind": "wandb", "mode": "offline", "group": "smoke-2026", "id": wandb_run_id("smoke-2026", "alibi-L32-s0")}
    (logger,) = build_loggers(cfg, tmp_path, "alibi-L32-s0", {}, ["alibi", "L32", "seed0"])
    init = logger._wandb_init
    assert (init["name"], init["group"], init["resume"]) == ("alibi-L32-s0", "smoke-2026", "allow")
    assert init["id"] == wandb_run_id("smoke-2026", "alibi-L32-s0") != wandb_run_id("smoke-2026", "rope-L32-s0")
    assert init["tags"] == ["L32", "alibi", "seed0"]


def test_retrieval_sweep_gives_each_scheme_rate_and_seed_its_own_job(tmp_path: Path) -> None:
    listing = [sys.executable, "-c", LIST_JOBS, "-m", "-cd", str(SWEEPS), "-cn", "retrieval"]
    result = launch(tmp_path, command=listing)
    assert result.returncode == 0, result.stderr[-3000:]
    names = [Path(line.split()[1]).name for line in result.stdout.splitlines() if line.startswith("JOB ")]
    schemes, rates, seeds = ("alibi", "rope", "xpos", "nope", "kerple_log", "t5"), ("0.001", "0.003", "0.01"), range(5)
    expected = {f"{scheme}-mqar-lr{lr}-L64-s{seed}" for scheme in schemes for lr in rates for seed in seeds}
    assert len(names) == len(expected) and set(names) == expected  # ≥ 5 seeds, a learning-rate sweep per scheme


def test_reproduction_runs_both_protocols_from_one_run(tmp_path: Path) -> None:
    config = compose_train("+encoding=alibi", "experiment=repro")
    assert list(config.eval.sliding_fractions) == [0.5, 0.125] and config.eval.mode == "nonoverlap"
    overrides = [o for o in FAST if not o.startswith("eval.multiples")]
    both = ("eval.multiples=[1,2]", "eval.sliding_fractions=[0.5]", "eval.attention_stats=true")
    train(compose_train("+encoding=alibi", *overrides, *both), tmp_path)
    plain = json.loads((tmp_path / "eval" / "results.json").read_text())
    sliding = json.loads((tmp_path / "eval_sliding_f0.5" / "results.json").read_text())
    # The attention statistics read the same windows under either protocol: measured once, in eval/.
    assert plain["attention_stats"] and not sliding.get("attention_stats")
    assert [r["stride"] for r in plain["perplexity"]] == [None, None]
    assert [r["stride"] for r in sliding["perplexity"]] == [8, 16]  # half of each length (16, 32)
    # Sliding leaves the stream's first 32 − 16 targets as context only, at every length, so that every token it
    # scores at 32 has at least 16 before it; nonoverlapping windows score them.
    for whole, slid in zip(plain["perplexity"], sliding["perplexity"], strict=True):
        assert slid["tokens"] == whole["tokens"] - 16


@pytest.mark.parametrize(
    ("name", "schemes", "extra"),
    [
        ("controlled", ("alibi", "rope", "nope", "t5", "kerple_log", "fire"), None),
        ("retrieval_offset", ("alibi", "rope", "nope", "t5", "kerple_log", "fire"), ("0.001", "0.003", "0.01")),
        ("controlled_passkey", ("alibi", "rope", "nope", "t5", "kerple_log", "fire"), ()),
    ],
)
def test_the_controlled_sweeps_cover_six_schemes_at_five_seeds(
    name: str, schemes: tuple[str, ...], extra: tuple[str, ...] | None, tmp_path: Path
) -> None:
    result = launch(tmp_path, command=[sys.executable, "-c", LIST_JOBS, "-m", "-cd", str(SWEEPS), "-cn", name])
    assert result.returncode == 0, result.stderr[-3000:]
    names = {Path(line.split()[1]).name for line in result.stdout.splitlines() if line.startswith("JOB ")}
    if extra == ():  # one seed
        expected = {f"{scheme}-passkey-L64-s0" for scheme in schemes}
    elif extra is None:
        expected = {f"{scheme}-L64-s{seed}" for scheme in schemes for seed in range(5)}
    else:
        expected = {f"{scheme}-mqar-lr{lr}-L64-s{seed}" for scheme in schemes for lr in extra for seed in range(5)}
    assert names == expected


def test_the_scheme_lr_sweep_gives_each_multiplier_its_own_run(tmp_path: Path) -> None:
    result = launch(tmp_path, command=[sys.executable, "-c", LIST_JOBS, "-m", "-cd", str(SWEEPS), "-cn", "scheme_lr"])
    assert result.returncode == 0, result.stderr[-3000:]
    names = {Path(line.split()[1]).name for line in result.stdout.splitlines() if line.startswith("JOB ")}
    multipliers = (1, 3, 10, 30, 100)
    assert names == {f"{s}-L64-s0-m{m}" for s in ("t5", "kerple_log", "fire") for m in multipliers}


def test_recall_is_tuned_over_one_grid_on_its_own_seed_then_run_at_five(tmp_path: Path) -> None:
    def jobs(name: str, *overrides: str) -> set[str]:
        command = [sys.executable, "-c", LIST_JOBS, "-m", "-cd", str(SWEEPS), "-cn", name, *overrides]
        result = launch(tmp_path, command=command)
        assert result.returncode == 0, result.stderr[-3000:]
        return {Path(line.split()[1]).name for line in result.stdout.splitlines() if line.startswith("JOB ")}

    rates = ("0.001", "0.003", "0.01")
    grid = itertools.product(("t5", "kerple_log", "fire"), rates, ("1", "10", "100"))
    assert jobs("retrieval_offset_tune") == {f"{scheme}-mqar-lr{lr}-x{m}-L64-s10" for scheme, lr, m in grid}
    without = jobs("retrieval_offset_tune", "+encoding=alibi,rope,nope", "optim.scheme_lr_multiplier=1")
    assert without == {f"{scheme}-mqar-lr{lr}-x1-L64-s10" for scheme in ("alibi", "rope", "nope") for lr in rates}
    schemes = ("alibi", "rope", "nope", "t5", "kerple_log", "fire")
    assert jobs("retrieval_offset_tuned") == {f"{scheme}-mqar-L64-s{seed}" for scheme in schemes for seed in range(5)}
    # The layouts' arm: the same grid at depth 4 for the entries with positional parameters.
    grid = itertools.product(("fope", "cable", "grape_a", "grape_m"), rates, ("1", "10", "100"))
    assert jobs("retrieval_offset_tune_layouts") == {f"{scheme}-mqar-lr{lr}-x{m}-L64-s10" for scheme, lr, m in grid}


def test_the_controlled_sweeps_ask_for_documents_as_long_as_the_windows_and_a_random_block() -> None:
    from omegaconf import OmegaConf

    def job(name: str) -> Any:
        command = [sys.executable, "-m", "posenc.train", "-cd", str(SWEEPS), "-cn", name, "+encoding=alibi"]
        printed = subprocess.run([*command, "--cfg", "job"], capture_output=True, text=True, timeout=120, check=True)
        return OmegaConf.create(printed.stdout)

    controlled, offset, passkey = job("controlled"), job("retrieval_offset"), job("controlled_passkey")
    # One initialisation for every task of the comparison.
    for composed in (controlled, offset, passkey):
        assert composed.model.init == "pytorch" and composed.model.tie_embeddings is False
    assert controlled.optim.scheme_lr_multiplier == passkey.optim.scheme_lr_multiplier == 30
    assert controlled.eval.sample == "long_documents" and list(controlled.eval.sliding_fractions) == [0.5]
    assert controlled.trainer.max_steps == 600 and list(controlled.eval.multiples) == [1, 2, 4, 8, 16, 32]
    assert offset.data.task == "mqar" and offset.data.task_options.kv_offset == "random"
    assert offset.trainer.max_steps == 4500  # the offset task's pilot: nothing learned in 1,500


def test_the_settings_sensitivity_arm_and_the_tuning_ties_run_on_their_recipes(tmp_path: Path) -> None:
    # FIRE's threshold at L and 512, T5's 32 buckets up to 64 and 128: five seeds each, one directory per setting,
    # every other setting the comparison's (its tuned rates, test split, both protocols).
    def jobs(name: str, *overrides: str) -> set[str]:
        command = [sys.executable, "-c", LIST_JOBS, "-m", "-cd", str(SWEEPS), "-cn", name, *overrides]
        result = launch(tmp_path, command=command)
        assert result.returncode == 0, result.stderr[-3000:]
        return {Path(line.split()[1]).name for line in result.stdout.splitlines() if line.startswith("JOB ")}

    assert jobs("sensitivity_fire") == {f"fire-th{t}-L64-s{s}" for t in (64, 512) for s in range(5)}
    # A tied tuning point at two more seeds, as the tuning ran it (its name, its rates), evaluated to 32×; a recall
    # grid's tied point as a recall run of its own sweep, at the depth it trained (the lines each study prints).
    tied = ["+encoding=t5", "optim.lr=0.004", "optim.scheme_lr_multiplier=100"]
    assert jobs(*STUDIES["tuning"].ties.split(), *tied) == {"t5-lr0.004-x100-L64-s11", "t5-lr0.004-x100-L64-s12"}
    tied = ["+encoding=gemma3", "optim.lr=0.001", "optim.scheme_lr_multiplier=1", "model.depth=6"]
    assert jobs(*STUDIES["recall-tuning-layouts"].ties.split(), *tied) == {
        f"gemma3-mqar-lr0.001-x1-L64-s{s}" for s in (11, 12)
    }
    assert jobs("sensitivity_t5") == {f"t5-b32-d{d}-L64-s{s}" for d in (64, 128) for s in range(5)}
    from omegaconf import OmegaConf

    command = [sys.executable, "-m", "posenc.train", "-cd", str(SWEEPS), "-cn", "sensitivity_fire", "+encoding=fire"]
    composed = OmegaConf.create(subprocess.run([*command, "--cfg", "job"], capture_output=True, text=True,
                                               timeout=120, check=True).stdout)  # fmt: skip
    assert composed.eval.split == "test" and list(composed.eval.sliding_fractions) == [0.5]
    assert composed.optim.tuned == "docs/results/tuning/selection.json" and composed.trainer.max_steps == 600
