"""``posenc.gpucheck`` on CPU: the table, and a non-zero exit code when a config fails (here: forced)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from posenc.gpu.check import gpu_tests_verdict, parse_args, plan


def test_plan_covers_every_config_and_one_ddp_run(tmp_path: Path) -> None:
    args = parse_args(["--set", "model.dim=64", "--set", "t5:attention=eager"])
    checks = plan(args, tmp_path)
    names = [check.name for check in checks]
    assert names[:-2] == args.configs and names[-2:] == ["triton", "ddp"] and len(args.configs) >= 11
    overrides = {check.name: check.overrides for check in checks}
    assert all("logger=csv" in o and "model.dim=64" in o for o in overrides.values())
    assert "attention=eager" in overrides["t5"] and "attention=eager" not in overrides["alibi"]
    assert {"trainer=ddp", "trainer.devices=1", "model=small"} <= set(overrides["ddp"])
    assert {"+encoding=kerple_log", "attention=triton"} <= set(overrides["triton"])
    cpu = [check.name for check in plan(parse_args(["--device", "cpu"]), tmp_path)]
    assert "triton" not in cpu and cpu[-1] == "ddp"  # the kernels run on CUDA only
    assert "eval.multiples=[1,2,4,8,16,32]" in overrides["alibi"]  # the evaluation goes to 32×
    with pytest.raises(SystemExit):
        parse_args(["--configs", "alibi,no_such_scheme"])


def test_gpu_tests_that_all_skipped_are_reported_as_skipped_not_passed() -> None:
    assert gpu_tests_verdict(True, "23 skipped in 1.20s") == "skipped"
    assert gpu_tests_verdict(True, "21 passed, 2 skipped in 80.1s") == "passed"
    assert gpu_tests_verdict(False, "1 failed, 22 passed in 90.0s") == "FAILED"
    assert gpu_tests_verdict(True, "not run (--no-tests)") == "not run"


@pytest.mark.slow
def test_cpu_check_prints_the_table_and_fails_on_a_failed_config(tmp_path: Path) -> None:
    # nope is forced through attention=flex, which cannot train on CPU: its row fails, alibi's passes.
    command = [sys.executable, "-m", "posenc.gpucheck", "--device", "cpu", "--configs", "alibi,nope", "--no-ddp"]
    command += ["--jobs", "2", "--multiples", "1,2", "--set", "nope:attention=flex", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:-1] for line in done.stdout.splitlines() if line.startswith("| ")
    }
    assert rows["config"][:5] == [" trained ", " evaluated ", " steps/s (2 runs at once) ", " ppl@1× ", " ppl@2× "]
    assert "a smoke figure, not a speed" in done.stdout
    trained, evaluated, steps_per_s, ppl_1, ppl_2, error = (cell.strip() for cell in rows["alibi"])
    assert (trained, evaluated, error) == ("yes", "yes", "") and float(steps_per_s) > 0
    assert float(ppl_1) > 1 and float(ppl_2) > 1
    trained, evaluated, *_, error = (cell.strip() for cell in rows["nope"])
    assert (trained, evaluated) == ("NO", "NO") and "trains only on a CUDA GPU" in error
    assert "GPU tests: skipped: " in done.stdout and "FAILED: nope" in done.stdout  # no CUDA: skipped, not passed
    assert (tmp_path / "alibi" / "train.log").exists()
