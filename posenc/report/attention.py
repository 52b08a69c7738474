"""The attention-statistics section: sink mass, mean attended distance and entropy by length, per scheme."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from posenc.evaluate.attention_stats import mean_by_length
from posenc.report.common import Appendix, Columns, interval_cells, order, table_head
from posenc.training.identity import columns

ATTENTION_STATS = {
    "sink": "Sink mass: attention probability on the window's first token",
    "explicit": "The model's own sink's mass (model.sink: its logit column or its sink tokens; 0 without one)",
    "distance": "Mean attended distance in tokens",
    "entropy": "Attention entropy in nats",
}


def has_sink(run: dict[str, Any]) -> bool:
    """Whether a run's model had a sink of its own: the explicit sink's table is shown only where one did."""
    return any(row.get("explicit") for row in run.get("attention_stats") or [])


def once_per_run(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run's statistics once: every protocol's evaluation of a run measures them on the same windows.

    The nonoverlapping evaluation's are kept where a run has several; a result whose run cannot be told is kept.
    """
    kept: dict[str, dict[str, Any]] = {}
    unknown = []
    for run in sorted(results, key=lambda r: (r.get("eval") or {}).get("mode") != "nonoverlap"):
        key = str(Path(str(run["_source"])).parent.parent) if run.get("_source") else run.get("run_name")
        if key is None:
            unknown.append(run)
        else:
            kept.setdefault(str(key), run)
    return [*kept.values(), *unknown]


def attention_groups(results: list[dict[str, Any]]) -> dict[tuple[int, str], Columns]:
    """{(train_len, data): {column: runs}} for runs with attention statistics; text and each task apart.

    Columns pool runs by identity (``posenc/training/identity.py``), as the perplexity tables do; a run evaluated
    under two protocols counts once (``once_per_run``).
    """
    by_group: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for run in once_per_run([run for run in results if run.get("attention_stats")]):
        if run.get("attention_stats") and not run.get("failed"):
            data = run.get("data") or {}
            by_group[(int(run["train_len"]), str(data.get("task") or data.get("corpus") or "?"))].append(run)
    return {group: columns(runs) for group, runs in by_group.items()}


def attention_means(run: dict[str, Any], stat: str) -> dict[int, float]:
    """{length: the statistic averaged over layers and heads} of one run."""
    lengths, means = mean_by_length(run["attention_stats"], stat)
    return dict(zip(lengths, means, strict=True))


def attention_tables(results: list[dict[str, Any]], appendix: Appendix | None = None) -> str:
    """Sink mass, mean attended distance and entropy by length (mean over layers and heads), one column per scheme.

    The model's own sink's mass too, where a run had one.
    """
    out = []
    for (train_len, data), by_label in sorted(attention_groups(results).items()):
        labels = order(by_label)
        lengths = sorted({n for runs in by_label.values() for run in runs for n in attention_means(run, "sink")})
        sinks = any(has_sink(run) for runs in by_label.values() for run in runs)
        for stat in [stat for stat in ATTENTION_STATS if stat != "explicit" or sinks]:
            what = ATTENTION_STATS[stat]
            out += [
                f"## Attention: {stat} by length, trained at L={train_len} on {data}",
                "",
                f"{what}, averaged over every layer, head and query (but each window's first); the mean over seeds ± "
                "the half-width of its 95% Student-t interval (no marks: no value of these is better in itself). "
                "Per layer × head: each run's eval/attention_stats.csv and attention_heatmaps.png. A scheme that "
                "supplies its own attention (PaTH, stick-breaking) is measured on its own weights, also a distribution "
                "over keys.",
                "",
                *table_head(
                    by_label, labels, title=f"Attention, trained at L={train_len} on {data}", appendix=appendix
                ),
            ]
            for length in lengths:
                row = interval_cells(
                    {label: [attention_means(run, stat).get(length) for run in by_label[label]] for label in labels},
                    digits=3,
                )
                out.append(f"| {length} | {length / train_len:g} | " + " | ".join(row[x] for x in labels) + " |")
            out.append("")
    return "\n".join(out)
