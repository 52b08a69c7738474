"""The perplexity section: one table per (training length, protocol), rows are lengths, columns schemes.

A protocol is how the held-out text is cut into windows: nonoverlapping windows, or sliding windows with a stride
in tokens or a fraction of each evaluation length (``f0.5``: N/2). Each table names its protocol. Under every table
of perplexities comes the data's share of the differences: a bootstrap over the scored documents.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import numpy as np

from posenc.evaluate.stats import RESAMPLES, resampled_losses
from posenc.report.common import (
    MARKS_LEGEND,
    PAIRED_LEGEND,
    Appendix,
    Columns,
    Key,
    interval_cells,
    order,
    paired_marks,
    seeded,
    table_head,
)
from posenc.training.identity import columns


def stride_of(row: dict[str, Any]) -> int | str | None:
    """A row's stride as a group key: tokens, ``f0.5`` for a fraction of each length, ``None`` when nonoverlapping."""
    if row.get("stride_fraction") is not None:
        return f"f{float(row['stride_fraction']):g}"
    return row.get("stride")


def protocol(mode: str, stride: int | str | None, short: bool = False) -> str:
    """The protocol in words, as every table names it (``short``: for a column header)."""
    if mode != "sliding":
        return "nonoverlapping" if short else "nonoverlapping windows"
    if isinstance(stride, str) and stride.startswith("f"):
        fraction = float(stride[1:])
        shown = f"N/{1 / fraction:g}" if (1 / fraction).is_integer() else f"{fraction:g}·N"
        return f"sliding {shown}" if short else f"sliding windows, stride {shown} (N the evaluation length)"
    return f"sliding {stride}" if short else f"sliding windows, stride {stride} tokens"


def group_order(key: Key) -> tuple[int, bool, float]:
    """Groups by training length, then nonoverlapping first, then sliding from the longest stride to the shortest."""
    train_len, mode, stride = key
    if mode != "sliding":
        return train_len, False, 0.0
    if isinstance(stride, str) and stride.startswith("f"):
        return train_len, True, -float(stride[1:]) * 1e9
    return train_len, True, -float(stride or 0)


def suffix(key: Key) -> str:
    """A group's name in file names: ``L64_nonoverlap``, ``L64_sliding_s32``, ``L64_sliding_sf0.5``."""
    train_len, mode, stride = key
    return f"L{train_len}_{mode}" + (f"_s{stride}" if stride else "")


def group_runs(results: list[dict[str, Any]]) -> dict[Key, Columns]:
    """{(train_len, mode, stride): {column: [run results…]}} for language-modelling results.

    A column pools runs of one identity (``posenc.training.identity``): same settings but the seed.
    """
    by_key: dict[Key, list[dict[str, Any]]] = defaultdict(list)
    for result in results:
        rows = result.get("perplexity") or []
        if not rows or result.get("failed"):
            continue
        by_key[(int(result["train_len"]), rows[0]["mode"], stride_of(rows[0]))].append(result)
    return {key: columns(runs) for key, runs in by_key.items()}


def value(run: dict[str, Any], length: int, field: str) -> float | None:
    """One run's ``field`` (ppl, ratio, loss) at ``length``, ``None`` where that length failed or is missing."""
    for row in run["perplexity"]:
        if row["length"] == length and row["error"] is None:
            return row[field]
    return None


def log_values(by_label: Columns, labels: list[str], length: int, field: str) -> dict[str, dict[Any, float | None]]:
    """{column: {seed: log of ``field`` at ``length``}}: what the paired marks test (log-perplexity, log-ratio)."""

    def log(run: dict[str, Any]) -> float | None:
        x = value(run, length, field)
        return None if x is None or not x > 0 or not math.isfinite(x) else math.log(x)

    return {label: seeded(by_label[label], log) for label in labels}


def perplexity_tables(key: Key, by_label: Columns, appendix: Appendix | None = None) -> str:
    """Perplexity and its ratio to in-length perplexity by length, one column per pooled identity, marks paired."""
    train_len, mode, stride = key
    labels = order(by_label)
    lengths = sorted({row["length"] for runs in by_label.values() for run in runs for row in run["perplexity"]})
    tokens = sorted({row["tokens"] for runs in by_label.values() for run in runs for row in run["perplexity"]})
    title = f"Trained at L={train_len} — {protocol(mode, stride)}"
    head = table_head(by_label, labels, title=title, appendix=appendix)
    out = [
        f"## {title}",
        "",
        f"Perplexity on held-out text, {protocol(mode, stride)}; {', '.join(map(str, tokens))} tokens scored at every "
        f"length (the same tokens: {_sample(by_label)}), so lengths are comparable. Each column pools runs whose "
        "settings differ only in their seed (n runs); runs that differ in anything else are separate columns named "
        "by the difference. " + MARKS_LEGEND,
        "",
        *head,
    ]
    ratio_rows = []
    for length in lengths:
        ppl = interval_cells({label: [value(run, length, "ppl") for run in by_label[label]] for label in labels})
        marks = paired_marks(log_values(by_label, labels, length, "ppl"))
        ratio = interval_cells({label: [value(run, length, "ratio") for run in by_label[label]] for label in labels}, 3)
        ratio_marks = paired_marks(log_values(by_label, labels, length, "ratio")) if length != train_len else {}
        cells = [f"{ppl[label]} {marks.get(label, '')}".rstrip() for label in labels]
        ratios = [f"{ratio[label]} {ratio_marks.get(label, '')}".rstrip() for label in labels]
        out.append(f"| {length} | {length / train_len:g} | " + " | ".join(cells) + " |")
        ratio_rows.append(f"| {length} | {length / train_len:g} | " + " | ".join(ratios) + " |")
    out += ["", PAIRED_LEGEND]
    out += [
        "",
        "Ratio to the in-length (1×) perplexity of the same run (1.0 = no degradation; marks on log-ratio):",
        "",
    ]
    out += [*head, *ratio_rows]
    out += data_variance(by_label, labels, lengths, train_len)
    return "\n".join(out)


def _sample(by_label: Columns) -> str:
    """How the scored tokens were chosen, as the runs recorded it."""
    records = [run.get("documents") or {} for runs in by_label.values() for run in runs]
    samples = sorted({record.get("sample", "head") for record in records})
    counts = sorted({len(record.get("documents", [])) for record in records if record.get("documents")})
    words = {
        "documents": "a contiguous piece of every document of the split",
        "split": "the whole split",
        "head": "the split's first tokens",
    }
    shown = "; ".join(words.get(sample, sample) for sample in samples)
    return shown + (f", {', '.join(map(str, counts))} documents" if counts else "")


def data_variance(by_label: Columns, labels: list[str], lengths: list[int], train_len: int) -> list[str]:
    """Each column's perplexity relative to the best column's, with a 95% bootstrap interval over the documents.

    Only where every run recorded its loss per document over the same documents; each column's seeds are averaged
    first (seeds held fixed), so the interval is the data's variation alone.
    """
    runs = [run for label in labels for run in by_label[label]]
    records = [run.get("documents") or {} for run in runs]
    if not records or any("tokens" not in record for record in records):
        return []
    if len({repr((record.get("documents"), record.get("tokens"))) for record in records}) != 1:
        return []
    tokens = np.asarray(records[0]["tokens"], dtype=float)
    rows = []
    for length in lengths:
        sums = {}
        for label in labels:
            per_run = [_document_loss(run, length) for run in by_label[label]]
            if all(loss is not None and len(loss) == tokens.size for loss in per_run):
                sums[label] = np.mean(per_run, axis=0)
        if len(sums) < 2:
            continue
        names = list(sums)
        matrix = np.stack([sums[name] for name in names])
        full = matrix.sum(axis=1) / tokens.sum()
        best = int(np.argmin(full))
        resampled = resampled_losses(matrix, tokens, seed=length)
        cells = []
        for label in labels:
            if label not in sums:
                cells.append("—")
                continue
            index = names.index(label)
            if index == best:
                cells.append("best")
                continue
            differences = np.expm1(resampled[:, index] - resampled[:, best]) * 100
            low, high = np.percentile(differences, [2.5, 97.5])
            cells.append(f"{np.expm1(full[index] - full[best]) * 100:+.1f}% [{low:+.1f}, {high:+.1f}]")
        rows.append(f"| {length} | {length / train_len:g} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    return [
        "",
        f"How much of each difference is the data: each column's perplexity relative to the best column's at that "
        f"length (seed means), with a 95% interval from resampling the {tokens.size} scored documents "
        f"({RESAMPLES} resamples, the same documents for every column, so the comparison stays paired). An interval "
        "that excludes 0 holds across resamples of the documents; the seed interval is in the table above.",
        "",
        "| length | ×L | " + " | ".join(labels) + " |",
        "|---:|---:|" + "---:|" * len(labels),
        *rows,
    ]


def _document_loss(run: dict[str, Any], length: int) -> list[float] | None:
    for row in run["perplexity"]:
        if row["length"] == length and row["error"] is None:
            return row.get("document_loss")
    return None
