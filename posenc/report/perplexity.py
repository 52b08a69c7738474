"""The perplexity section: one table per (training length, evaluation mode), rows are lengths, columns schemes."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from posenc.identity import columns
from posenc.report.common import MARKS_LEGEND, Appendix, Columns, Key, marked_cells, order, table_head


def group_runs(results: list[dict[str, Any]]) -> dict[Key, Columns]:
    """{(train_len, mode, stride): {column: [run results…]}} for language-modelling results.

    A column pools runs of one identity (``posenc.identity``): same settings but the seed.
    """
    by_key: dict[Key, list[dict[str, Any]]] = defaultdict(list)
    for result in results:
        rows = result.get("perplexity") or []
        if not rows or result.get("failed"):
            continue
        by_key[(int(result["train_len"]), rows[0]["mode"], rows[0]["stride"])].append(result)
    return {key: columns(runs) for key, runs in by_key.items()}


def value(run: dict[str, Any], length: int, field: str) -> float | None:
    """One run's ``field`` (ppl, ratio) at ``length``, ``None`` where that length failed or is missing."""
    for row in run["perplexity"]:
        if row["length"] == length and row["error"] is None:
            return row[field]
    return None


def perplexity_tables(key: Key, by_label: Columns, appendix: Appendix | None = None) -> str:
    """Perplexity and its ratio to in-length perplexity by length, one column per pooled identity."""
    train_len, mode, stride = key
    labels = order(by_label)
    lengths = sorted({row["length"] for runs in by_label.values() for run in runs for row in run["perplexity"]})
    tokens = sorted({row["tokens"] for runs in by_label.values() for run in runs for row in run["perplexity"]})
    how = mode + (f", stride {stride}" if stride else "")
    title = f"Trained at L={train_len} — {how}"
    head = table_head(by_label, labels, title=title, appendix=appendix)
    out = [
        f"## {title}",
        "",
        f"Perplexity on held-out text; {', '.join(map(str, tokens))} tokens scored at every "
        "length (the same tokens), so lengths are comparable. Each column pools runs whose settings differ only in "
        "their seed (n runs); runs that differ in anything else are separate columns named by the difference. "
        + MARKS_LEGEND,
        "",
        *head,
    ]
    ratio_rows = []
    for length in lengths:
        ppl = marked_cells({label: [value(run, length, "ppl") for run in by_label[label]] for label in labels})
        ratio = {label: [value(run, length, "ratio") for run in by_label[label]] for label in labels}
        cells, ratios = (
            [ppl[label] for label in labels],
            list(marked_cells(ratio, 3, marks=length != train_len).values()),
        )
        out.append(f"| {length} | {length / train_len:g} | " + " | ".join(cells) + " |")
        ratio_rows.append(f"| {length} | {length / train_len:g} | " + " | ".join(ratios) + " |")
    out += ["", "Ratio to the in-length (1×) perplexity of the same run (1.0 = no degradation):", "", *head]
    out += ratio_rows
    return "\n".join(out)
