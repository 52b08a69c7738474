"""The effective-length section: per training length, one row per column and one column per metric.

A run's effective length for a metric is the longest evaluated length up to which that metric holds up
(``posenc.evaluate.effective``). Results written before it was recorded have it computed here by the same rule,
so every run of a report is judged alike. A column pools its seeds, and the cell shows their median with the
range and n, since an effective length is one of a few evaluated lengths: a mean would name a length never run.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from posenc.evaluate.effective import effective_lengths
from posenc.identity import columns
from posenc.report.common import Appendix, order, table_head


def run_effective_lengths(run: dict[str, Any]) -> dict[str, int | None]:
    """{metric: effective length} as recorded in the run's results, else computed from its figures."""
    recorded = run.get("effective_length")
    return dict(recorded) if isinstance(recorded, dict) else effective_lengths(run)


def pooled_cell(lengths: list[int | None]) -> str:
    """``median [min–max] (n)`` over the seeds that have a length; ``—`` when none has (no in-length figure)."""
    known = sorted(length for length in lengths if length is not None)
    if not known:
        return "—"
    median = statistics.median(known)
    shown = f"{median:g}" + (f" [{known[0]}–{known[-1]}]" if known[0] != known[-1] else "")
    return f"{shown} (n={len(known)})"


def effective_tables(results: list[dict[str, Any]], appendix: Appendix | None = None) -> str:
    """One table per training length: the pooled effective length of every metric of every column."""
    by_train_len: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for run in results:
        if not run.get("failed") and "train_len" in run:
            by_train_len[int(run["train_len"])].append(run)
    out: list[str] = []
    for train_len, runs in sorted(by_train_len.items()):
        by_label = columns(runs)
        per_run = {label: [run_effective_lengths(run) for run in by_label[label]] for label in by_label}
        metrics = sorted({metric for lengths in per_run.values() for one in lengths for metric in one})
        if not metrics:
            continue
        title = f"Effective length, trained at L={train_len}"
        labels = order(by_label)
        head = table_head(by_label, labels, first="| metric | ", title=title, appendix=appendix)
        out += [
            f"## {title}",
            "",
            "The longest evaluated length up to which a metric holds up at every length on the way: perplexity "
            "within the ratio tolerance of in-length (default ≤ 1.10), a task's accuracy at least the fraction of its "
            "in-length accuracy (default 0.8). Each cell is the median over the column's seeds, [min–max] when they "
            "differ, and n, the seeds with a length (— where no seed has an in-length figure to compare with).",
            "",
            *head,
        ]
        for metric in metrics:
            cells = [pooled_cell([one.get(metric) for one in per_run[label]]) for label in labels]
            out.append(f"| {metric} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out).rstrip()
