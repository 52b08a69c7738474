"""Several processes on CPU (gloo): ddp_spawn trains and logs once, and ddp inside a multirun is refused."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from helpers import FAST

from posenc.runs import DONE_FILE
from posenc.training.sweep import reruns_command

TWO_CPU_PROCESSES = ["trainer.accelerator=cpu", "trainer.devices=2"]


def run_cli(cwd: Path, *args: str, wandb_mode: str = "disabled") -> subprocess.CompletedProcess:
    """Through the command line, with a time limit: a rank stuck on a collective fails the test, not the suite."""
    env = {**os.environ, "WANDB_MODE": wandb_mode}
    command = [sys.executable, "-m", "posenc.train", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def test_ddp_spawn_trains_on_two_processes_and_logs_once(tmp_path: Path) -> None:
    overrides = [o for o in FAST if not o.startswith(("logger", "trainer.max_steps"))]
    overrides += ["logger=csv", "trainer.max_steps=4", "trainer.log_every_n_steps=1", "trainer.strategy=ddp_spawn"]
    result = run_cli(tmp_path, "+encoding=alibi", *overrides, *TWO_CPU_PROCESSES)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (tmp_path / "outputs" / "runs" / "alibi-L16-s0").iterdir()

    run = json.loads((run_dir / "run.json").read_text())
    # Per-device batch 4 on 2 processes: 8 windows of 16 tokens per step.
    assert (run["world_size"], run["global_batch_size"], run["tokens_per_step"]) == (2, 8, 128)
    assert run["steps"] == 4 and run["tokens"] == 512
    assert run["eval"]["ppl@1x"] > 1 and (run_dir / DONE_FILE).exists()  # rank zero evaluated; nobody hung

    with (run_dir / "csv" / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    # Every metric once per step: only rank zero logs. (step and epoch ride along with each of Lightning's calls.)
    logged = Counter(
        (row["step"], name) for row in rows for name, value in row.items() if value and name not in ("step", "epoch")
    )
    assert logged[("3", "train/loss")] == 1 and max(logged.values()) == 1
    tokens = [float(row["train/tokens"]) for row in rows if row["train/tokens"]]
    assert tokens == [128.0, 256.0, 384.0, 512.0]  # global tokens, both ranks' batches counted
    assert all(float(row["train/tokens_per_sec"]) > 0 for row in rows if row["train/tokens_per_sec"])
    assert "global_batch_size: 8" in (run_dir / "csv" / "hparams.yaml").read_text()


def test_ddp_spawn_makes_one_wandb_run_in_the_run_dir(tmp_path: Path) -> None:
    overrides = [o for o in FAST if not o.startswith(("logger", "trainer.max_steps"))]
    overrides += ["logger=wandb", "trainer.max_steps=2", "trainer.strategy=ddp_spawn"]
    result = run_cli(tmp_path, "+encoding=alibi", *overrides, *TWO_CPU_PROCESSES, wandb_mode="offline")
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (tmp_path / "outputs" / "runs" / "alibi-L16-s0").iterdir()
    (offline_run,) = (run_dir / "wandb").glob("offline-run-*")  # one run: rank zero's
    assert any(offline_run.glob("run-*.wandb"))
    assert any((offline_run / "files" / "media").rglob("*.table.json"))  # the evaluation's tables, in the run
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]  # no stray ./wandb from the workers


def test_ddp_in_a_multirun_stops_with_one_message_before_writing(tmp_path: Path) -> None:
    result = run_cli(tmp_path, "-m", "+encoding=alibi,rope", "trainer.strategy=ddp", *TWO_CPU_PROCESSES)
    assert result.returncode != 0
    message = result.stderr.strip()
    assert "Lightning issue #11300" in message and "launcher=submitit_slurm" in message
    assert "trainer.strategy=ddp_spawn" in message and "without -m" in message
    assert "Traceback" not in message and len(message.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("trainer", "reruns"),
    [
        ({"strategy": "ddp", "devices": 2}, True),
        ({"strategy": "auto", "devices": 4, "accelerator": "gpu"}, True),  # auto picks ddp for several devices
        ({"strategy": "fsdp", "devices": [0, 1]}, True),
        ({"strategy": "ddp_find_unused_parameters_true", "devices": "0,1"}, True),
        ({"strategy": "ddp_spawn", "devices": 2}, False),
        ({"strategy": "ddp_fork", "devices": 2}, False),
        ({"strategy": "ddp", "devices": 1}, False),  # one process: nothing to start
        ({"strategy": "auto", "devices": "auto", "accelerator": "cpu"}, False),
    ],
)
def test_which_strategies_rerun_the_command(trainer: dict, reruns: bool) -> None:
    assert reruns_command(trainer) is reruns
