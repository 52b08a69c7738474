"""The GPU session runner: its plan covers the registry, and every step is bounded, logged and summarised.

The runner's steps need CUDA; its engine does not, so the engine is tested here with small commands that print,
fail, hang and write files, as a GPU step would.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from posenc import gpusession
from posenc.config import encoding_choices
from posenc.gpusession import Step, main, plain_name, plan, run_session, step_env


def test_plan_trains_every_config_once_and_orders_proof_first(tmp_path: Path) -> None:
    steps = plan(["proof", "speed", "repro"], tmp_path)
    assert [step.stage for step in steps] == sorted((s.stage for s in steps), key=gpusession.STAGES.index)
    trained: list[str] = []
    for step in steps:
        if "posenc.gpucheck" in step.argv:
            trained += step.argv[step.argv.index("--configs") + 1].split(",")
    assert sorted(trained) == encoding_choices()
    assert set(gpusession.PAPER_SCHEMES) <= set(encoding_choices())
    assert all(step.limit_s <= gpusession.STEP_LIMIT_S for step in steps)
    names = [step.name for step in steps]
    assert len(set(names)) == len(names) and all(plain_name(name) == name for name in names)


def test_dry_run_needs_no_gpu_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "session"
    assert main(["--dry-run", "--stages", "proof,repro", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "gpucheck-first" in printed and "repro-sinusoidal" in printed and "bench-2048" not in printed
    assert "'gpu and not slow'" in printed  # shell-quoted: the line can be pasted
    assert not out.exists() and not (tmp_path / "session-work").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_one_line_and_nothing_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "session"
    assert main(["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: no CUDA device") and "--dry-run" in err
    assert not out.exists()


def test_unknown_stage_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--dry-run", "--stages", "proof,sped", "--out", str(tmp_path / "s")]) == 2
    assert capsys.readouterr().err.strip() == "error: unknown stage sped: choose from proof, speed, repro"


def python_step(name: str, code: str, limit_s: float = 30) -> Step:
    return Step("proof", name, [sys.executable, "-c", code], limit_s=limit_s)


def process_alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] not in {"Z", "X"}


def test_session_bounds_logs_copies_and_summarises(tmp_path: Path) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    deep = work / "a" / "b=c" / "d"
    pid_file = tmp_path / "grandchild.pid"
    hang = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "print('waiting', flush=True)\ntime.sleep(120)\n"
    )
    steps = [
        python_step("dots", "import sys, time\nfor _ in range(3): sys.stdout.write('.'); sys.stdout.flush()"),
        python_step(
            "writes",
            f"import pathlib; p = pathlib.Path({str(deep)!r}); p.mkdir(parents=True); "
            "(p / 'results.json').write_text('{}'); (p / 'model.ckpt').write_text('x')",
        ),
        python_step("fails", "import sys; print('boom'); sys.exit(3)"),
        python_step("hangs", hang, limit_s=4),
        python_step("too-long", "print('never')", limit_s=3600),
    ]
    started = time.monotonic()
    assert run_session(steps, out, work, budget_s=120, env=step_env(None)) == 1
    assert time.monotonic() - started < 60
    status = {step.name: step.status for step in steps}
    assert status["dots"] == "passed" and status["writes"] == "passed"
    assert status["fails"] == "failed" and status["hangs"] == "timed out"
    assert status["too-long"].startswith("skipped")
    assert (out / "dots.log").read_text() == "..."
    assert (out / "fails.log").read_text() == "boom\n"
    assert "stopped at its limit of 4 s" in (out / "hangs.log").read_text()
    assert not process_alive(int(pid_file.read_text()))  # the step's whole process group was stopped
    # What a step wrote deep down comes back flat, with plain names; a checkpoint does not.
    assert [p.name for p in (out / "writes").iterdir()] == ["a-b_c-d-results.json"]
    summary = json.loads((out / "summary.json").read_text())
    assert [row["status"][:7] for row in summary] == ["passed", "passed", "failed", "timed o", "skipped"]
    assert [row["returncode"] for row in summary][:3] == [0, 0, 3]
    assert "| proof | hangs | timed out |" in (out / "summary.md").read_text()


def test_step_env_puts_the_wheels_first_and_output_unbuffered(tmp_path: Path) -> None:
    env = step_env(tmp_path / "site")
    paths = env["PYTHONPATH"].split(":")
    assert paths[0] == str(tmp_path / "site") and str(gpusession.ROOT) in paths
    assert env["PYTHONUNBUFFERED"] == "1" and env["WANDB_MODE"] == "disabled"


def test_wheels_are_not_installed_where_hydra_is_present(tmp_path: Path) -> None:
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "x-1.0-py3-none-any.whl").write_bytes(b"")
    assert gpusession.install_wheels(tmp_path / "w", tmp_path) is None
    assert not (tmp_path / "site").exists()
