"""What comes back from a GPU session: at most eight files, rewritten after every step.

A lent machine returns at most eight files from its output folder (plain names, 16 MiB each), and a command cut
short returns only what is already there. So the output folder holds exactly:

- ``summary.json`` and ``summary.md``: every step's status (passed, failed, timed out, stopped, never started),
  seconds, planned seconds and compiled graphs, with the device, torch and the deadline;
- ``outputs.tar.gz``: everything the steps wrote in the work folder (logs, results, tables, plots), without
  checkpoints, caches or installed wheels;
- the logs of the steps that ended badly, as many as fit in the eight (all logs are in the tarball too).

Each file is written beside its final name and renamed into place, so a session killed while writing leaves the
previous version whole.
"""

from __future__ import annotations

import io
import json
import platform
import tarfile
from dataclasses import asdict
from pathlib import Path

from posenc.gpu.runner import Step
from posenc.jsonio import write_bytes

MAX_FILES = 8
MAX_BYTES = 16 * 2**20
SUMMARY_FILES = ("summary.json", "summary.md", "outputs.tar.gz")
SKIP_DIRS = {"cache", "site", "checkpoints", "__pycache__", "gpu-image"}
SKIP_SUFFIXES = {".ckpt", ".pt", ".bin", ".safetensors", ".whl"}
MAX_MEMBER_BYTES = 4 * 2**20


def environment() -> dict[str, str]:
    """Device and versions, read without starting CUDA when torch is not yet imported by the caller."""
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({platform.processor() or 'cpu'})"
    return {"device": device, "torch": torch.__version__, "python": platform.python_version()}


def summary(steps: list[Step], meta: dict) -> dict:
    """The session as one record: what it was asked, every step, and the totals."""
    counts: dict[str, int] = {}
    for step in steps:
        counts[step.status] = counts.get(step.status, 0) + 1
    return {**meta, "counts": counts, "steps": [asdict(step) | {"argv": step.argv} for step in steps]}


def markdown(record: dict) -> str:
    """``summary.md``: the header facts, then one row per step."""
    head = [
        f"# GPU session: {record['stage']}" + (" (rehearsal on CPU)" if record.get("rehearse") else ""),
        "",
        f"- device: {record['device']}; torch {record['torch']}; python {record['python']}",
        f"- deadline {record['deadline_s']:.0f} s; ran {record.get('elapsed_s', 0):.0f} s; "
        f"planned {record['planned_s']:.0f} s, {record['graphs']} compiled graphs",
        "- " + ", ".join(f"{count} {status}" for status, count in sorted(record["counts"].items())),
        "",
        "| step | status | s | planned s | graphs | rc | note |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    rows = [
        f"| {s['name']} | {s['status']} | {_number(s['seconds'])} | {s['planned_s']:.0f} | {s['graphs']} | "
        f"{'' if s['returncode'] is None else s['returncode']} | {s['note'].replace('|', '/')} |"
        for s in record["steps"]
    ]
    extra = [f"\n{line}" for line in record.get("extra", [])]
    return "\n".join(head + rows) + "\n" + "".join(extra) + ("\n" if extra else "")


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.0f}"


def tarball(work: Path) -> bytes:
    """Everything under ``work`` worth returning (see the module docstring), as a gzipped tar in memory."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for path in sorted(work.rglob("*")) if work.exists() else []:
            relative = path.relative_to(work)
            if not path.is_file() or path.is_symlink() or path.name.startswith("."):
                continue
            if SKIP_DIRS & set(relative.parts[:-1]) or path.suffix in SKIP_SUFFIXES:
                continue
            if path.stat().st_size > MAX_MEMBER_BYTES:
                continue
            archive.add(path, arcname=str(relative))
    return buffer.getvalue()


def write(out: Path, work: Path, steps: list[Step], meta: dict) -> list[str]:
    """Write the files that come back into ``out`` (at most ``MAX_FILES``); the names written."""
    out.mkdir(parents=True, exist_ok=True)
    record = summary(steps, meta)
    packed = tarball(work)
    if len(packed) > MAX_BYTES:  # keep the logs and the records, drop the rest
        record.setdefault("extra", []).append("outputs.tar.gz held too much: only the logs came back in it")
        packed = tarball(work / "logs")
    write_bytes(out / "summary.json", (json.dumps(record, indent=2, default=str) + "\n").encode())
    write_bytes(out / "summary.md", markdown(record).encode())
    write_bytes(out / "outputs.tar.gz", packed)
    names = list(SUMMARY_FILES)
    for step in steps:
        log = work / "logs" / f"{step.name}.log"
        if step.ended_badly and log.exists() and len(names) < MAX_FILES:
            data = log.read_bytes()[-MAX_BYTES:]
            write_bytes(out / log.name, data)
            names.append(log.name)
    for stale in out.glob("*.log"):  # a log an earlier write put there for a step that has since passed
        if stale.name not in names:
            stale.unlink()
    return names
