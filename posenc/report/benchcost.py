"""Training cost measured side by side: ``python -m posenc.bench``'s train steps read beside the runs they price.

Why: a run's own throughput is measured under whatever else the machine did while it trained, so two runs'
throughputs compare only when both ran alone or both shared the cores alike. The benchmark times one train step of
every scheme in turn in one process, so a change of load falls on every scheme alike. When the report is given a
benchmark's ``bench.json`` (a file, or a directory holding one), its train steps stand in for the runs' own
throughput wherever it measured every column (``posenc.report.cost`` draws and tabulates them).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from posenc.report.common import Columns

BENCH_FILE = "bench.json"


def find_bench(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """Every readable ``bench.json`` with train steps among ``paths`` (files, or directories searched below)."""
    found = []
    for path in map(Path, paths):
        files = [path] if path.is_file() else sorted(path.rglob(BENCH_FILE)) if path.is_dir() else []
        for file in files:
            if file.name != BENCH_FILE:
                continue
            try:
                bench = json.loads(file.read_text())
            except (OSError, UnicodeDecodeError, ValueError):
                continue
            if isinstance(bench, dict) and bench.get("train_step"):
                found.append({**bench, "_source": str(file)})
    return found


def measured_steps(bench: list[dict[str, Any]], seq_len: int | None = None) -> dict[str, dict[str, Any]]:
    """{column label: its train-step row} over the benchmarks' timed steps at ``seq_len`` (later files win).

    Only steps at the columns' training length price them: a step's cost grows with its length, and at another
    length the schemes' order can change.
    """
    rows: dict[str, dict[str, Any]] = {}
    for record in bench:
        for row in record["train_step"]:
            if row.get("x_nope") is not None and (seq_len is None or row.get("seq_len") == seq_len):
                rows[row.get("label", row["scheme"])] = {**row, "environment": record.get("environment", {})}
    return rows


def train_len(by_label: Columns) -> int | None:
    """The training length the columns' runs share (a report group has one)."""
    return next((run.get("train_len") for runs in by_label.values() for run in runs), None)


def bench_speeds(by_label: Columns, bench: list[dict[str, Any]]) -> dict[str, float] | None:
    """Each column's throughput relative to NoPE from the benchmark, ``None`` unless it measured every column."""
    rows = measured_steps(bench, train_len(by_label))
    if not rows or not all(label in rows for label in by_label):
        return None
    return {label: rows[label]["x_nope"] for label in by_label}
