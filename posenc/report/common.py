"""What every report section shares: mean ± std cells, a stable column order, the table header.

A section module (perplexity, tasks, attention) turns a list of results into markdown lines; the numbers in its
cells come from here, so every table formats them the same way.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

Key = tuple[int, str, int | None]  # (train_len, mode, stride)
Columns = dict[str, list[dict[str, Any]]]  # {column label: the runs pooled in it}


def mean_std(values: Sequence[float | None]) -> tuple[float, float, int]:
    """(mean, sample std, n) of the finite values; (nan, nan, 0) when there is none."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return math.nan, math.nan, 0
    return statistics.fmean(finite), (statistics.stdev(finite) if len(finite) > 1 else 0.0), len(finite)


def cell(values: Sequence[float | None], digits: int = 2) -> str:
    """``mean ± std`` over seeds, the mean alone for one run, ``—`` for none."""
    mean, std, n = mean_std(values)
    if n == 0:
        return "—"
    return f"{mean:.{digits}f}" if n == 1 else f"{mean:.{digits}f} ± {std:.{digits}f}"


def order(labels: Iterable[str]) -> list[str]:
    """Schemes in registry order first, then hybrids, each alphabetically: stable columns across reports."""
    from posenc.encodings import available

    known = available()

    def key(label: str) -> tuple[bool, int, str]:
        scheme = label.split(" · ")[0]
        return scheme not in known, known.index(scheme) if scheme in known else 0, label

    return sorted(set(labels), key=key)


def table_head(by_label: Columns, labels: Sequence[str], first: str = "| length | ×L | ") -> list[str]:
    """The header and alignment rule of a table with one column per label (``n`` = runs pooled)."""
    header = first + " | ".join(f"{label} (n={len(by_label[label])})" for label in labels) + " |"
    return [header, "|---:" * first.count("|", 1) + "|" + "---:|" * len(labels)]
