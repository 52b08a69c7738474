"""Nothing lost when the disk fills or a process dies mid-write: atomic records and checkpoints, faults injected.

The full-disk cases run on a 3 MB tmpfs mounted for the test (root only: skipped with the reason elsewhere), as a
user's disk would fill: at a checkpoint, at the evaluation, at the report. A process killed in the middle of a
checkpoint write is held there by ``posenc.jsonio``'s test hook (``POSENC_PAUSE_WRITE``) and killed with SIGKILL.
"""

from __future__ import annotations

import csv
import errno
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import FAST, compose_train
from omegaconf import OmegaConf

import posenc.jsonio
from posenc.config import to_container
from posenc.jsonio import PAUSE_ENV, DiskFullError, write_bytes, write_text
from posenc.report import ReportOnSweepEnd
from posenc.report.__main__ import main as report_main
from posenc.runs import DONE_FILE, RUN_FILE, RunError, load_checkpoint, read_checkpoint
from posenc.runs.checkpoint_io import AtomicCheckpointIO
from posenc.train import train
from posenc.training.sweep import job_state

ROOT = Path(__file__).resolve().parent.parent
RUN = [
    *(o for o in FAST if not o.startswith("logger=")),
    "logger=csv",
    "trainer.log_every_n_steps=1",
    "checkpoint_every_n_steps=2",
    "trainer.max_steps=6",
]
# A checkpoint of about 1.9 MB: the first fits on the 3 MB disk, a second beside it does not.
MODEL = ["model.dim=64", "model.depth=3", "model.heads=4"]


def _partials(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.partial"))


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def _losses(run_dir: Path) -> dict[int, float]:
    with (run_dir / "csv" / "metrics.csv").open() as handle:
        return {int(row["step"]): float(row["train/loss"]) for row in csv.DictReader(handle) if row.get("train/loss")}


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 3 MB tmpfs of its own, unmounted however the test ends."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command here: the full-disk tests mount a 3 MB tmpfs")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True)
    if mounted.returncode != 0:
        reason = mounted.stderr.decode(errors="replace").strip() or "mount refused"
        pytest.skip(f"cannot mount a 3 MB tmpfs here ({reason}): the full-disk tests need root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def _grow(mount: Path) -> None:
    """Free space: the same tmpfs, made larger in place."""
    subprocess.run(["mount", "-o", "remount,size=64m", str(mount)], check=True)


def _fill(folder: Path) -> Path:
    """Take every free byte of ``folder``'s file system; returns the filler file."""
    filler = folder / "filler"
    descriptor = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(descriptor, bytes(1 << 16))
    except OSError as err:
        assert err.errno == errno.ENOSPC
    finally:
        os.close(descriptor)
    return filler


# ---------------------------------------------------------------------------------------------------------------
# The one writer


def test_a_record_is_replaced_whole_with_the_usual_permissions(tmp_path: Path) -> None:
    path = tmp_path / "records" / "run.json"
    write_text(path, "old")
    write_text(path, "new")
    plain = tmp_path / "plain"
    plain.write_text("x")
    assert path.read_text() == "new" and not _partials(tmp_path)
    assert path.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777  # as an ordinary file, not mkstemp's 0600


def test_a_write_cut_short_keeps_the_old_file_and_removes_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Where space cannot be reserved up front (some network file systems), the write itself finds the disk full.
    path = tmp_path / "results.json"
    write_text(path, '{"old": true}')
    monkeypatch.setattr(posenc.jsonio, "_reserve", lambda descriptor, length: None)

    def half(descriptor: int, data: memoryview) -> int:
        os.ftruncate(descriptor, len(data) // 2)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(posenc.jsonio.os, "write", half)
    with pytest.raises(DiskFullError, match=r"the disk is full: could not write .*results\.json \(it needs 2 MB, "):
        write_bytes(path, bytes(2_000_000))
    assert path.read_text() == '{"old": true}' and not _partials(tmp_path)


def test_checkpoints_keep_the_one_before_and_never_promote_a_damaged_one(tmp_path: Path) -> None:
    saver, path = AtomicCheckpointIO(), tmp_path / "checkpoints" / "last.ckpt"
    previous = path.with_name("last-previous.ckpt")
    for step in (1, 2):
        saver.save_checkpoint({"global_step": step, "weights": torch.full((4,), float(step))}, path)
    saver.wait()
    assert read_checkpoint(path)[0] == 2 and read_checkpoint(previous)[0] == 1
    path.write_bytes(path.read_bytes()[:100])  # damaged after it was written (a copy cut short, a disk error)
    saver.save_checkpoint({"global_step": 3}, path)
    saver.wait()
    assert read_checkpoint(path)[0] == 3 and read_checkpoint(previous)[0] == 1
    previous.unlink()
    os.link(path, previous)  # both names one file, as after a resume from a write killed before its rename
    saver.save_checkpoint({"global_step": 4}, path)
    saver.teardown()
    assert read_checkpoint(path)[0] == 4 and read_checkpoint(previous)[0] == 3
    assert not _partials(tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# Resuming past a damaged checkpoint


@pytest.mark.slow
def test_a_resume_past_a_damaged_last_checkpoint_starts_from_the_one_before(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    overrides = [*RUN, "trainer.max_steps=4", "eval.at_end=false"]
    train(compose_train("+encoding=alibi", *overrides), tmp_path)
    (tmp_path / DONE_FILE).unlink()
    last = tmp_path / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    config = to_container(compose_train("+encoding=alibi", *overrides))
    assert "(last.ckpt is unreadable: from last-previous.ckpt" in job_state(tmp_path, config).action
    capsys.readouterr()
    summary = train(compose_train("+encoding=alibi", *overrides, "trainer.max_steps=6", "resume=last"), tmp_path)
    said = [line for line in capsys.readouterr().out.splitlines() if "the checkpoint before it" in line]
    assert said == [
        f"{last} cannot be read as a checkpoint (RuntimeError): resuming from the checkpoint before it, "
        f"{last.with_name('last-previous.ckpt')} (step 2)"
    ]
    assert summary["resumed_from"]["step"] == 2 and summary["steps"] == 6
    last.write_bytes(b"damaged")
    last.with_name("last-previous.ckpt").write_bytes(b"damaged")
    (tmp_path / DONE_FILE).unlink()
    with pytest.raises(RunError, match=r"and so is .*last-previous\.ckpt, the one before it: delete both"):
        train(compose_train("+encoding=alibi", *overrides, "resume=last"), tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# A full disk


@pytest.mark.slow
def test_a_full_disk_at_a_checkpoint_is_one_line_keeps_the_previous_and_resumes(small_disk: Path) -> None:
    run_dir = small_disk / "run"
    args = ["+encoding=alibi", *RUN, *MODEL, "eval.at_end=false", f"hydra.run.dir={run_dir}"]
    stopped = _cli("-m", "posenc.train", *args)
    assert stopped.returncode == 1 and "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    line = stopped.stderr.strip().splitlines()[-1]
    last = run_dir / "checkpoints" / "last.ckpt"
    assert line.startswith(f"alibi-L16-s0: the disk is full: could not write {last} (it needs "), line
    assert f"; kept {last} (step 2). Free space, then resume with: python -m posenc.train" in line
    assert read_checkpoint(last)[0] == 2 and not _partials(small_disk)
    _grow(small_disk)
    command = shlex.split(line.split("resume with: ")[1])
    assert command[:3] == ["python", "-m", "posenc.train"] and "resume=last" in command
    resumed = _cli(*command[1:])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run = json.loads((run_dir / RUN_FILE).read_text())
    assert run["resumed_from"]["step"] == 2 and run["steps"] == 6 and (run_dir / DONE_FILE).exists()


# Fills the disk just before the end-of-training evaluation writes its files, then trains as the CLI does.
FULL_AT_EVALUATION = """
import sys
import posenc.evaluate.outputs as outputs
from test_atomic_writes import _fill
write = outputs.write_outputs
def full(results, out_dir, plots=True):
    _fill(out_dir.parent.parent)
    return write(results, out_dir, plots)
outputs.write_outputs = full
from posenc.train import main
sys.argv = ["posenc.train", *sys.argv[1:]]
main()
"""


@pytest.mark.slow
def test_a_full_disk_at_the_evaluation_is_one_line_and_the_run_resumes(small_disk: Path) -> None:
    run_dir = small_disk / "run"
    args = ["+encoding=alibi", *RUN, "model.dim=32", "model.depth=1", f"hydra.run.dir={run_dir}"]
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    stopped = _cli("-c", FULL_AT_EVALUATION, *args, env=env)
    assert stopped.returncode == 1 and "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    line = stopped.stderr.strip().splitlines()[-1]
    assert line.startswith(f"alibi-L16-s0: the disk is full: could not write {run_dir / 'eval' / 'results.json'}")
    assert f"; kept {run_dir / 'checkpoints' / 'last.ckpt'} (step 6). Free space, then resume with: " in line
    assert not _partials(small_disk) and not list(run_dir.glob(".eval*")) and not (run_dir / DONE_FILE).exists()
    (small_disk / "filler").unlink()
    resumed = _cli(*shlex.split(line.split("resume with: ")[1])[1:])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((run_dir / "eval" / "results.json").read_text())["training"]["steps"] == 6
    assert (run_dir / DONE_FILE).exists() and not _partials(small_disk)


@pytest.mark.slow
def test_a_full_disk_in_posenc_evaluate_is_one_line_and_keeps_the_evaluation(small_disk: Path) -> None:
    run_dir = small_disk / "run"
    train(compose_train("+encoding=alibi", *RUN, "model.dim=32", "model.depth=1"), run_dir)
    before = (run_dir / "eval" / "results.json").read_text()
    _fill(small_disk)
    stopped = _cli("-m", "posenc.evaluate", str(run_dir), "eval.max_tokens=256", "eval.multiples=[1,2,4]")
    assert stopped.returncode == 1 and "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    assert stopped.stderr.strip().splitlines()[-1] == (
        f"the disk is full: could not write {run_dir / 'eval' / 'results.json'} (it needs "
        + stopped.stderr.split("(it needs ")[-1].split(")")[0]
        + f"); {run_dir / 'eval'} is as it was. Free space, then run the same command again"
    )
    assert (run_dir / "eval" / "results.json").read_text() == before and not _partials(small_disk)
    assert not list(run_dir.glob(".eval*"))


def _results(folder: Path, label: str) -> Path:
    rows = [
        {"length": 16 * m, "mode": "nonoverlap", "stride": None, "tokens": 256, "loss": 1.0, "ppl": 2.7 * m}
        | {"bpb": 1.0, "error": None, "multiple": m, "ratio": float(m), "loss_by_position": None}
        for m in (1, 2)
    ]
    result = {
        "label": label,
        "train_len": 16,
        "seed": 0,
        "data": {"corpus": "stdlib", "fingerprint": "fp"},
        "eval": {"mode": "nonoverlap", "stride": None, "multiples": [1, 2], "plots": False},
        "perplexity": rows,
        "loss_by_position": {},
    }
    path = folder / f"{label}-L16-s0" / "eval" / "results.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(result))
    return path


def test_a_full_disk_at_the_report_is_one_line_and_keeps_the_old_report(small_disk: Path) -> None:
    _results(small_disk, "alibi")
    (small_disk / "report.md").write_text("the earlier report\n")
    _fill(small_disk)
    with pytest.raises(SystemExit) as stopped:
        report_main([str(small_disk)])
    message = str(stopped.value)
    assert "\n" not in message and message.startswith("posenc.report: the disk is full: could not write ")
    assert message.endswith(f"Free space, then: python -m posenc.report {small_disk}")
    assert (small_disk / "report.md").read_text() == "the earlier report\n" and not _partials(small_disk)


def test_a_report_names_the_records_it_left_out_and_why_in_report_md(tmp_path: Path) -> None:
    _results(tmp_path, "alibi")
    cut = _results(tmp_path, "rope")
    cut.write_text(cut.read_text()[:200])  # half-written, as by an older posenc on a full disk
    (tmp_path / "nope-L16-s0").mkdir()
    (tmp_path / "nope-L16-s0" / "failed.json").write_text("{}")  # readable, but not a failure record
    staging = tmp_path / "alibi-L16-s0" / ".eval.x1y2" / "results.json"  # an evaluation being written: never read
    staging.parent.mkdir()
    staging.write_text("{")
    report_main([str(tmp_path), "--no-plots"])
    report = (tmp_path / "report.md").read_text()
    assert "## Left out: 2 record(s) that could not be read" in report
    assert f"- {cut}: cut short or damaged JSON (" in report
    assert f"- {tmp_path / 'nope-L16-s0' / 'failed.json'}: no 'reason' in it" in report
    assert ".eval.x1y2" not in report and "1 evaluated run(s)" in report
    sweep = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    (tmp_path / "report.md").unlink()
    ReportOnSweepEnd().on_multirun_end(sweep)  # the report a sweep writes at its end says the same
    assert f"- {cut}: cut short or damaged JSON (" in (tmp_path / "report.md").read_text()


# ---------------------------------------------------------------------------------------------------------------
# A process killed in the middle of a checkpoint write


@pytest.mark.slow
def test_a_process_killed_mid_checkpoint_keeps_the_previous_and_resumes_to_the_same_curve(tmp_path: Path) -> None:
    run_dir, marker = tmp_path / "killed", tmp_path / "paused"
    overrides = [*RUN, "eval.at_end=false"]
    env = {**os.environ, PAUSE_ENV: f"last.ckpt:{marker}"}  # the write over step 2's checkpoint stops halfway
    process = subprocess.Popen(
        [sys.executable, "-m", "posenc.train", "+encoding=alibi", *overrides, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 240
        while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), f"the checkpoint write never paused (exit status {process.poll()})"
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.wait()
    last = run_dir / "checkpoints" / "last.ckpt"
    (partial,) = _partials(run_dir)  # the write it died in, under its hidden name only
    assert read_checkpoint(last)[0] == 2
    with pytest.raises(RunError, match="cannot be read as a checkpoint"):
        load_checkpoint(partial)
    resumed = train(compose_train("+encoding=alibi", *overrides, "resume=last"), run_dir)
    reference = train(compose_train("+encoding=alibi", *overrides), tmp_path / "uninterrupted")
    assert resumed["resumed_from"]["step"] == 2 and resumed["steps"] == 6 and not _partials(run_dir)
    losses, uninterrupted = _losses(run_dir), _losses(tmp_path / "uninterrupted")
    assert set(losses) >= {2, 3, 4, 5}
    assert [losses[step] for step in (2, 3, 4, 5)] == pytest.approx([uninterrupted[s] for s in (2, 3, 4, 5)], rel=1e-5)
    assert resumed["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5)
