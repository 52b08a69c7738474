"""What every report section shares: cells with their spread or interval, column order, the header, the appendix.

A section module (perplexity, tasks, attention) turns a list of results into markdown lines; the numbers in its
cells come from here, so every table formats them the same way. Every table's header comes from ``table_head``,
so no table puts unlike runs side by side unflagged: each column names its runs, steps and tokens trained, the
settings in which it differs from the other columns are listed above the table, and the ``Appendix`` names the
run directories behind every column.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from posenc.evaluate.stats import Interval, overlaps_best, t_interval
from posenc.identity import identity

Key = tuple[int, str, int | None]  # (train_len, mode, stride)
Columns = dict[str, list[dict[str, Any]]]  # {column label: the runs pooled in it}


def mean_halfwidth(values: Sequence[float | None]) -> tuple[float, float, int]:
    """(mean, half-width of its 95% Student-t interval, n) of the finite values, for the figures' bands.

    The half-width is 0 for one value (no interval) and the tuple ``(nan, nan, 0)`` when there is none: a band
    drawn from it is the same interval the tables print.
    """
    iv = interval(values)
    if iv is None:
        return math.nan, math.nan, 0
    return iv.mean, iv.half_width or 0.0, iv.n


BEST, NOT_SEPARATED = "◆", "≈"
MARKS_LEGEND = (
    f"Cells are the mean over seeds ± the half-width of its 95% Student-t interval (n seeds in the column header; "
    f"a column of one seed shows its mean alone: one seed gives no interval). {BEST} marks the best mean at a "
    f"length (every cell that ties it), {NOT_SEPARATED} a cell whose interval overlaps the best one's (the seeds "
    "cannot tell the two apart); "
    "cells without a mark are separated from the best, or have no interval to compare."
)


def interval(values: Sequence[float | None]) -> Interval | None:
    """The Student-t interval over the finite values (one per seed), ``None`` when there is none."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return t_interval(finite) if finite else None


def marked_cells(
    by_label: dict[str, Sequence[float | None]], digits: int = 2, higher_is_better: bool = False, marks: bool = True
) -> dict[str, str]:
    """{column: ``mean ± half-width`` and its mark} for one row, so the reader sees which cells the seeds separate.

    ``marks=False`` leaves them out where no cell can be best: every cell equal by construction (the ratio at the
    training length), or a quantity that is not better high or low (attention statistics).

    A cell's own n is shown only where it differs from its column's (a length that failed for some seeds).
    """
    intervals = {label: interval(values) for label, values in by_label.items()}
    present = {label: iv for label, iv in intervals.items() if iv is not None}
    overlapping = overlaps_best(present, higher_is_better) if marks else {}
    best = (max if higher_is_better else min)((iv.mean for iv in present.values()), default=None)
    out = {}
    for label, iv in intervals.items():
        if iv is None:
            out[label] = "—"
            continue
        text = f"{iv.mean:.{digits}f}" + ("" if iv.half_width is None else f" ± {iv.half_width:.{digits}f}")
        if iv.n != len(by_label[label]):
            text += f" (n={iv.n})"
        mark = "" if not marks else BEST if iv.mean == best else NOT_SEPARATED if overlapping.get(label) else ""
        out[label] = f"{text} {mark}".rstrip()
    return out


def order(labels: Iterable[str]) -> list[str]:
    """Schemes in registry order first, then hybrids, each alphabetically: stable columns across reports."""
    from posenc.encodings import available

    known = available()

    def key(label: str) -> tuple[bool, int, str]:
        scheme = label.split(" · ")[0]
        return scheme not in known, known.index(scheme) if scheme in known else 0, label

    return sorted(set(labels), key=key)


def run_dir(run: dict[str, Any]) -> str:
    """The run directory a result came from (``<run>/eval*/results.json``), or its W&B run."""
    source = run.get("_source")
    if not source:
        return f"W&B run {run.get('run_name') or run['label']}"
    folder = Path(source).parent
    return str(folder.parent if folder.name.startswith("eval") else folder)


def _count(value: float) -> str:
    for size, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:g}"


def trained(runs: Sequence[dict[str, Any]]) -> str:
    """``100 steps · 410k tokens``: what the runs of a column were trained for (``?`` where unrecorded)."""
    records = [run.get("training") or {} for run in runs]
    parts = []
    for field, unit in (("steps", "steps"), ("tokens", "tokens")):
        values = sorted({r[field] for r in records if r.get(field) is not None})
        missing = any(r.get(field) is None for r in records)
        if not values:
            parts.append(f"? {unit}")
            continue
        shown = _count(values[0]) if len(values) == 1 else f"{_count(values[0])}–{_count(values[-1])}"
        parts.append(f"{shown}{'/?' if missing else ''} {unit}")
    return " · ".join(parts)


# Identity keys a column's label already names (the scheme) or its header shows (steps trained).
_NAMED = ("encoding.", "run.label", "training.")


def differences(by_label: Columns) -> dict[str, list[str]]:
    """{column: ``key=value`` for every identity setting in which the columns differ}, beyond the scheme itself.

    Within one scheme the labels already name the difference (``alibi · max_steps=40``); across schemes only
    this says that ``t5`` was trained for 100 steps and ``rope`` for 30.
    """
    settings = {label: identity(runs[0]) for label, runs in by_label.items()}
    keys = sorted({key for one in settings.values() for key in one if not key.startswith(_NAMED)})
    differing = [key for key in keys if len({repr(one.get(key)) for one in settings.values()}) > 1]
    if {"data.corpus", "data.task"} & set(differing):  # the corpus says it; its fingerprint adds nothing
        differing = [key for key in differing if key != "data.fingerprint"]
    return {label: [f"{key}={settings[label].get(key, '(unset)')}" for key in differing] for label in by_label}


class Appendix:
    """The run directories in each column of each table, listed at the end of the report."""

    def __init__(self) -> None:
        self.tables: dict[str, dict[str, list[str]]] = {}

    def add(self, title: str, by_label: Columns) -> None:
        self.tables[title] = {label: sorted(run_dir(run) for run in runs) for label, runs in by_label.items()}

    def lines(self) -> list[str]:
        if not self.tables:
            return []
        out = ["", "## Appendix: the runs in each column", ""]
        for title, by_label in self.tables.items():
            out += [f"{title}:", ""]
            out += [f"- {label}: {', '.join(dirs)}" for label, dirs in sorted(by_label.items())]
            out.append("")
        return out


def table_head(
    by_label: Columns,
    labels: Sequence[str],
    first: str = "| length | ×L | ",
    title: str | None = None,
    appendix: Appendix | None = None,
) -> list[str]:
    """A table's header: one column per label with its runs (n), steps and tokens trained; the rule below it.

    When columns of different schemes differ in more than their scheme, a line above the table says in what. With an
    ``appendix``, the table's run directories are recorded under ``title``.
    """
    if appendix is not None and title is not None:
        appendix.add(title, by_label)
    header = first + " | ".join(f"{label} (n={len(by_label[label])} · {trained(by_label[label])})" for label in labels)
    out = [header + " |", "|---:" * first.count("|", 1) + "|" + "---:|" * len(labels)]
    differ = differences({label: by_label[label] for label in labels})
    schemes = {label.split(" · ")[0] for label in labels}  # within one scheme, the labels name the difference
    if len(schemes) > 1 and any(differ.values()):
        notes = "; ".join(f"{label}: {', '.join(differ[label])}" for label in labels)
        out = [f"**These columns differ in more than their scheme** — {notes}.", "", *out]
    return out
