"""The GPU session: one stage per command, one deadline, no process left behind, at most eight files back.

Its steps need CUDA; its engine does not. The engine is tested with small commands that print, fail, hang and
leave children behind, as a GPU step would; the session itself with ``--rehearse``, which runs the real plan on CPU
with tiny settings and without the packages the GPU machine lacks (wandb, submitit).
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from posenc.config import encoding_choices
from posenc.gpu import leases, pack, plan
from posenc.gpu.runner import RESERVE_S, ROOT, Runner, Step
from posenc.gpu.session import gpu_image, main, planned_s, step_env


def gpu_plan(stage: str, tmp_path: Path, **options: object) -> list[Step]:
    return plan.build(plan.Options(stage, tmp_path, **options))  # type: ignore[arg-type]


def test_proof_trains_every_config_once_beside_the_gpu_tests(tmp_path: Path) -> None:
    steps = gpu_plan("proof", tmp_path)
    assert [step.name for step in steps] == ["versions", "gpu-tests", "train-configs"]
    tests, train = steps[1], steps[2]
    assert tests.overlap and not train.overlap  # the tests run beside the trainings: both mostly compile
    assert plan.GPU_TESTS in tests.argv  # named by path: the suite's other files import what the GPU lacks
    configs = train.argv[train.argv.index("--configs") + 1].split(",")
    assert configs == encoding_choices()
    assert train.argv[train.argv.index("--multiples") + 1] == "1,32"
    assert "--triton" in train.argv and "trainer.precision=bf16-mixed" in train.argv
    assert train.graphs == (len(configs) + 1) * (2 + len(plan.PROOF_MULTIPLES))
    assert all(int(step.env.get("TORCHINDUCTOR_COMPILE_THREADS", "1")) >= 1 for step in steps)


@pytest.mark.parametrize(
    "stage, options",
    [
        ("proof", {}),
        ("speed", {}),
        ("speed", {"part": "train-step"}),
        ("speed", {"part": "bias"}),
        ("speed", {"part": "kernels"}),
        ("repro", {}),
        ("repro", {"scheme": "rope"}),
    ],
)
def test_every_stage_is_planned_inside_one_command(tmp_path: Path, stage: str, options: dict) -> None:
    steps = gpu_plan(stage, tmp_path, **options)
    assert planned_s(steps) <= 540 - RESERVE_S
    assert sum(step.graphs for step in steps) > 0
    names = [step.name for step in steps]
    assert len(set(names)) == len(names) and all(re.fullmatch(r"[A-Za-z0-9._-]+", name) for name in names)
    if stage == "speed":
        assert all(step.exclusive for step in steps[1:])  # timings run alone
    if stage == "repro":
        train = steps[-1].argv
        assert any(arg.startswith("+trainer.max_time=") for arg in train)
        assert "checkpoint_every_n_steps=1000000" in train  # one checkpoint, at the end


@pytest.mark.parametrize("lease", sorted(leases.LEASES))
def test_every_lease_is_one_command_that_fits_the_lease(tmp_path: Path, lease: int) -> None:
    # A lease: fifteen minutes, of which a start takes up to three; one command of at most ten. Every part has a
    # budget its plan fits in, and the budgets, the first step and the summary's reserve fit what the lease leaves.
    assert leases.COMMANDS_S + leases.MACHINE_START_S + leases.RETURN_S <= leases.LEASE_S
    assert leases.deadline_s(lease) <= min(leases.COMMANDS_S, 600)
    steps = leases.build(lease, tmp_path)
    assert [step.name for step in steps].count("versions") == 1
    for step in steps[1:]:
        assert step.budget_s is not None and step.planned_s <= step.budget_s, step.name
    assert planned_s(steps) <= leases.deadline_s(lease) - RESERVE_S
    names = [step.name for step in steps]
    assert len(set(names)) == len(names)


def test_lease_one_is_the_bias_decomposition_then_the_train_step(tmp_path: Path) -> None:
    steps = leases.build(1, tmp_path)
    assert [step.name for step in steps] == ["versions", "bench-bias", "bench-train-step"]
    assert all(step.exclusive for step in steps[1:])  # timings, alone on the machine
    with pytest.raises(ValueError, match="there is no lease 99"):
        leases.build(99, tmp_path)


def test_repro_trains_for_what_the_deadline_leaves() -> None:
    assert plan.repro_training_s(540) < plan.repro_training_s(600) <= 600
    assert plan.repro_training_s(60) == 30


def test_dry_run_needs_no_gpu_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "session"
    assert main(["--dry-run", "--stage", "proof", "--out", str(out), "--work", str(tmp_path / "w")]) == 0
    printed = capsys.readouterr().out
    assert "train-configs" in printed and "compiled graphs" in printed and "fits" in printed
    assert "'gpu and not slow'" in printed  # shell-quoted: the line can be pasted
    assert not out.exists() and not (tmp_path / "w").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_one_line_and_nothing_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "session"
    assert main(["--out", str(out), "--work", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: no CUDA device") and "--rehearse" in err
    assert not out.exists()


def test_out_inside_work_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--rehearse", "--out", str(tmp_path / "w" / "out"), "--work", str(tmp_path / "w")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def python_step(name: str, code: str, **fields: object) -> Step:
    return Step("proof", name, [sys.executable, "-c", code], planned_s=1, **fields)  # type: ignore[arg-type]


def alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split(")")[-1].split()[0] not in {"Z", "X"}
    except (FileNotFoundError, ProcessLookupError):
        return False


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (a test's own temporary path)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (FileNotFoundError, PermissionError, ProcessLookupError):
                continue
            if text in command and alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def hanging(pid_file: Path) -> str:
    """A step that starts a child (as a compile worker would) and both wait far past any deadline."""
    return (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "print('waiting', flush=True)\ntime.sleep(300)\n"
    )


def test_one_deadline_stops_a_step_with_its_group_and_leaves_the_rest_unstarted(tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    deep = work / "a" / "b=c"
    pid_file = tmp_path / "child.pid"
    steps = [
        python_step("dots", "import sys\nfor _ in range(3): sys.stdout.write('.'); sys.stdout.flush()"),
        python_step(
            "writes",
            f"import pathlib; p = pathlib.Path({str(deep)!r}); p.mkdir(parents=True); "
            "(p / 'results.json').write_text('{}'); (p / 'model.ckpt').write_text('x'); "
            "(p / 'checkpoints').mkdir(); (p / 'checkpoints' / 'last.txt').write_text('x')",
        ),
        python_step("fails", "import sys; print('boom'); sys.exit(3)"),
        python_step("hangs", hanging(pid_file)),
        python_step("after", "print('never')"),
    ]
    writes = []
    started = time.monotonic()
    runner = Runner(
        steps,
        work / "logs",
        deadline=started + 8,
        env=step_env(None, work),
        on_change=lambda: writes.append(pack.write(out, work, steps, meta(started))),
        echo=io.StringIO(),
    )
    runner.run()
    assert time.monotonic() - started < 8 + 6  # the deadline, then the group's grace period
    status = {step.name: step.status for step in steps}
    assert status == {
        "dots": "passed",
        "writes": "passed",
        "fails": "failed",
        "hangs": "timed out",
        "after": "never started",
    }
    assert not alive(int(pid_file.read_text()))  # the step's child went with it
    assert (work / "logs" / "dots.log").read_text() == "..."
    assert "stopped at the session's deadline" in (work / "logs" / "hangs.log").read_text()
    assert len(writes) >= len(steps) - 1  # written after every step that ended, and at the end
    names = sorted(path.name for path in out.iterdir())
    assert names == ["fails.log", "hangs.log", "outputs.tar.gz", "summary.json", "summary.md"]
    with tarfile.open(out / "outputs.tar.gz") as archive:
        members = archive.getnames()
    assert "a/b=c/results.json" in members and "logs/hangs.log" in members
    assert not any(name.endswith(".ckpt") or "checkpoints" in name for name in members)
    record = json.loads((out / "summary.json").read_text())
    assert record["counts"] == {"passed": 2, "failed": 1, "timed out": 1, "never started": 1}
    assert [row["returncode"] for row in record["steps"]][:3] == [0, 0, 3]
    assert "| hangs | timed out |" in (out / "summary.md").read_text()


def test_a_step_over_its_budget_is_stopped_and_the_next_one_runs(tmp_path: Path) -> None:
    # Two parts of one lease: the first overruns its budget and is stopped with its group, keeping what it wrote;
    # the second still gets its time, though the command's deadline is far off.
    pid_file = tmp_path / "child.pid"
    steps = [python_step("overruns", hanging(pid_file), budget_s=3), python_step("next", "print('ran')", budget_s=30)]
    started = time.monotonic()
    runner = Runner(steps, tmp_path / "logs", started + 120, step_env(None, tmp_path), echo=io.StringIO())
    runner.run()
    assert time.monotonic() - started < 3 + 10
    assert [step.status for step in steps] == ["timed out", "passed"]
    assert not alive(int(pid_file.read_text()))
    log = (tmp_path / "logs" / "overruns.log").read_text()
    assert "waiting" in log and "stopped at its budget of 3 s" in log
    assert (tmp_path / "logs" / "next.log").read_text() == "ran\n"


def meta(started: float) -> dict:
    return {
        "stage": "proof",
        "deadline_s": 8,
        "planned_s": 5,
        "graphs": 0,
        "device": "cpu",
        "torch": torch.__version__,
        "python": "3",
        "elapsed_s": time.monotonic() - started,
    }


def test_an_overlapping_step_runs_beside_the_next_and_an_exclusive_one_alone(tmp_path: Path) -> None:
    stamp = "import time, sys; print(time.monotonic(), flush=True); time.sleep({0}); print(time.monotonic())"
    steps = [
        python_step("beside", stamp.format(1.5), overlap=True),
        python_step("next", stamp.format(0.2)),
        python_step("alone", stamp.format(0.2), exclusive=True),
    ]
    runner = Runner(steps, tmp_path / "logs", time.monotonic() + 60, step_env(None, tmp_path), echo=io.StringIO())
    runner.run()
    times = {s.name: [float(x) for x in (tmp_path / "logs" / f"{s.name}.log").read_text().split()] for s in steps}
    assert times["next"][0] < times["beside"][1]  # started while "beside" still ran
    assert times["alone"][0] >= times["beside"][1]  # waited for everything before it


def test_at_most_eight_files_come_back(tmp_path: Path) -> None:
    steps = [python_step(f"s{i}", "") for i in range(12)]
    for step in steps:
        step.status = "failed"
        (tmp_path / "work" / "logs").mkdir(parents=True, exist_ok=True)
        (tmp_path / "work" / "logs" / f"{step.name}.log").write_text("x")
    names = pack.write(tmp_path / "out", tmp_path / "work", steps, meta(time.monotonic()))
    assert len(names) == pack.MAX_FILES == len(list((tmp_path / "out").iterdir()))
    assert names[:3] == ["summary.json", "summary.md", "outputs.tar.gz"]


def test_the_gpu_image_lacks_wandb_and_submitit(tmp_path: Path) -> None:
    env = step_env(None, tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(gpu_image(tmp_path)), env["PYTHONPATH"]])
    for name in ("wandb", "submitit"):
        done = subprocess.run([sys.executable, "-c", f"import {name}"], env=env, capture_output=True, text=True)
        assert done.returncode == 1 and "the GPU machine does not have it" in done.stderr


def session(tmp_path: Path, *args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "posenc.gpusession", "--rehearse", "--out", str(tmp_path / "out")]
    command += ["--work", str(tmp_path / "work"), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_line(process: subprocess.Popen, text: str, timeout: float = 120) -> list[str]:
    assert process.stdout is not None
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        lines.append(line)
        if text in line or not line:
            return lines
    raise AssertionError(f"no line with {text!r} in {timeout} s: {''.join(lines)[-2000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_session_leaves_no_process(tmp_path: Path, signum: int) -> None:
    process = session(tmp_path, "--stage", "repro")
    lines = wait_for_line(process, "== repro-alibi (repro")
    assert "== repro-alibi" in lines[-1]
    time.sleep(3)  # the training has started (and its data loading, its children)
    assert processes_mentioning(str(tmp_path / "work" / "repro"))
    process.send_signal(signum)
    process.wait(timeout=30)
    deadline = time.monotonic() + 15
    while processes_mentioning(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_mentioning(str(tmp_path)) == []
    if signum == signal.SIGTERM:
        assert process.returncode == 128 + signum
        record = json.loads((tmp_path / "out" / "summary.json").read_text())
        assert {s["name"]: s["status"] for s in record["steps"]}["repro-alibi"] == "stopped"
        assert (tmp_path / "out" / "repro-alibi.log").exists()


@pytest.mark.slow
def test_the_proof_rehearsed_on_cpu(tmp_path: Path) -> None:
    process = session(tmp_path, "--stage", "proof", "--configs", "alibi", "--jobs", "1", "--deadline", "300")
    output, _ = process.communicate(timeout=320)
    assert process.returncode == 0, output[-3000:]
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["outputs.tar.gz", "summary.json", "summary.md"]
    record = json.loads((out / "summary.json").read_text())
    assert record["rehearse"] and record["counts"] == {"passed": 4}
    # Every GPU command of the stage composes, and pytest collected the GPU tests without wandb or submitit.
    assert "commands of the proof stage parse" in output
    junit = (tmp_path / "work" / "gpu-tests" / "junit.xml").read_text()
    assert 'skipped="' in junit and 'errors="0"' in junit and 'tests="0"' not in junit
    with tarfile.open(out / "outputs.tar.gz") as archive:
        members = archive.getnames()
    assert {"gpucheck/table.md", "logs/train-configs.log", "gpu-tests/junit.xml"} <= set(members)
    assert "| alibi | yes | yes |" in (out / "summary.md").read_text()


@pytest.mark.slow
def test_lease_one_rehearsed_on_cpu(tmp_path: Path) -> None:
    # The first lease's one command on CPU: the fused kernel's value checks (under Triton's interpreter, as the
    # rehearsal runs the kernels), every bias item timed or its refusal recorded, then the train-step table; at most
    # eight files back.
    process = session(tmp_path, "--lease", "1")
    output, _ = process.communicate(timeout=500)
    assert process.returncode == 0, output[-3000:]
    assert output.count("commands of the speed stage parse") == 2  # each part's GPU command lines compose
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["outputs.tar.gz", "summary.json", "summary.md"]
    bias = json.loads((tmp_path / "work" / "bias" / "bias.json").read_text())
    items = bias["items"]
    assert items[0]["item"] == "sdpa flash" and items[0]["train_ms"] > 0
    assert len(items) >= 12 and {"band pass", "fused table kernel", "captured-buffer gradient"} <= {
        row["item"] for row in items
    }
    assert all(any(key.endswith(("_ms", "_error")) for key in row) for row in items)  # timed, or why not
    checks = bias["values"]
    cases = [(row["length"], row["deterministic"]) for row in checks]
    assert cases == [(32, False), (32, True), (31, False), (31, True)]
    assert all(row["ok"] and {"out", "dq", "dk", "dv"} < set(row["errors"]) for row in checks), checks
    step = json.loads((tmp_path / "work" / "train-step" / "bench.json").read_text())["train_step"]
    assert {row["scheme"] for row in step} >= {"nope", "alibi", "kerple_log", "t5"}
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# GPU session: lease 1 (rehearsal on CPU)")
    assert "Bias decomposition: B 1, H 2, L 32, D 16" in summary and "| band pass |" in summary
    assert "fused kernel's values against the fp32 reference" in summary
    assert "| bench-bias | passed |" in summary and "| bench-train-step | passed |" in summary
