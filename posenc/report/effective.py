"""The effective-length section: per training length and rule, one row per metric and one column per scheme.

A run's effective length for a metric is the longest evaluated length up to which that metric holds up
(``posenc.evaluate.effective``), under two rules, each in a table that names it: the **absolute** rule (one threshold
for every column of the table: RULER's where it is an accuracy fixed by the runs' settings or the report's options,
posenc's own where it is the fraction × the best in-length figure among the table's columns, which moves with the
columns compared) and the **relative** rule (each run against its
own in-length figure). The absolute rule comes first: it is the default for tasks, and the one that does not reward a
model that starts badly and stays flat.

A column pools its seeds: the cell shows the median over the seeds that have a length, [min–max] when they differ,
and how many of the column's seeds that is, naming the seeds without one (they never held, even in-length), since an
effective length is one of a few evaluated lengths: a mean would name a length never run.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from posenc.evaluate.effective import (
    DEFAULT_ACC_FRACTION,
    DEFAULT_PPL_RATIO,
    comparison_thresholds,
    effective_lengths,
    recorded_lengths,
    settings,
)
from posenc.report.common import Appendix, order, table_head
from posenc.report.perplexity import protocol, stride_of
from posenc.training.identity import columns


def pooled_cell(lengths: list[int | None]) -> str:
    """``median [min–max] (k of n seeds; m without)``: every seed of the column counted, those without a length too."""
    known = sorted(length for length in lengths if length is not None)
    missing = len(lengths) - len(known)
    without = f"; {missing} without" if missing else ""
    if not known:
        return f"— (0 of {len(lengths)} seeds{without})"
    median = statistics.median(known)
    shown = f"{median:g}" + (f" [{known[0]}–{known[-1]}]" if known[0] != known[-1] else "")
    return f"{shown} ({len(known)} of {len(lengths)} seeds{without})"


def shared_settings(runs: list[dict[str, Any]], overrides: Mapping[str, float | None]) -> dict[str, Any]:
    """The thresholds of a comparison: the report's options, else the runs' settings where they all agree."""
    recorded = [settings(run) for run in runs]
    out: dict[str, Any] = {}
    for key, default in (
        ("ppl_ratio", DEFAULT_PPL_RATIO),
        ("acc_fraction", DEFAULT_ACC_FRACTION),
        ("ppl_threshold", None),
        ("acc_threshold", None),
    ):
        values = {repr(one[key]) for one in recorded}
        agreed = recorded[0][key] if len(values) == 1 else default
        out[key] = overrides[key] if overrides.get(key) is not None else agreed
    return out


def rule_text(rule: str, thresholds: Mapping[str, float], shared: Mapping[str, Any]) -> str:
    """The rule of a table in words, with its thresholds."""
    if rule == "relative":
        return (
            f"**Relative rule**: perplexity within {shared['ppl_ratio']:g}× the run's own in-length perplexity, an "
            f"accuracy at least {shared['acc_fraction']:g}× the run's own in-length accuracy and above its floor."
        )
    sources = []
    if shared["ppl_threshold"] is None and "ppl" in thresholds:
        sources.append(f"perplexity: {shared['ppl_ratio']:g}× the best in-length perplexity of the table's columns")
    if shared["acc_threshold"] is None and any(metric != "ppl" for metric in thresholds):
        sources.append(f"accuracy: {shared['acc_fraction']:g}× the best in-length accuracy of the table's columns")
    shown = ", ".join(f"{metric} {'≤' if metric == 'ppl' else '≥'} {value:.4g}" for metric, value in thresholds.items())
    whose = (
        "posenc's shared-threshold rule: it moves with the columns compared"
        if sources
        else "RULER's rule: a threshold fixed in advance"
        if shared["acc_threshold"] is not None and not any(m == "ppl" for m in thresholds)
        else "a threshold fixed in advance"
    )
    return (
        f"**Absolute rule** ({whose}): one threshold per metric for every column — {shown}"
        + (f" ({'; '.join(sources)})" if sources else " (fixed)")
        + "; an accuracy must also stay above its floor."
    )


def effective_tables(
    results: list[dict[str, Any]], appendix: Appendix | None = None, overrides: Mapping[str, float | None] | None = None
) -> str:
    """Per comparison: the absolute-rule table, then the relative-rule one (see the module docstring).

    A comparison is the runs of one training length on one task, or on text under one protocol: their in-length
    figures are what an absolute threshold is taken from.
    """
    comparisons: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for run in results:
        if not run.get("failed") and "train_len" in run:
            comparisons[(int(run["train_len"]), _kind(run))].append(run)
    out: list[str] = []
    for (train_len, kind), runs in sorted(comparisons.items()):
        by_label = columns(runs)
        shared = shared_settings(runs, overrides or {})
        thresholds = comparison_thresholds(
            runs,
            shared["ppl_ratio"],
            shared["acc_fraction"],
            shared["ppl_threshold"],
            shared["acc_threshold"],
            by_label,
        )
        for rule in ("absolute", "relative"):
            per_run = {
                label: [_lengths(run, rule, shared, thresholds) for run in by_label[label]] for label in by_label
            }
            metrics = sorted({metric for lengths in per_run.values() for one in lengths for metric in one})
            if not metrics:
                continue
            title = f"Effective length, trained at L={train_len} on {kind} — {rule} rule"
            labels = order(by_label)
            head = table_head(by_label, labels, first="| metric | ", title=title, appendix=appendix)
            out += [
                f"## {title}",
                "",
                "The longest evaluated length up to which a metric holds at every length on the way. "
                + rule_text(rule, thresholds, shared)
                + " Each cell: the median over the column's seeds that have a length, [min–max] when they differ, "
                "and how many of its seeds that is; a seed without one never held, even in-length.",
                "",
                *head,
            ]
            for metric in metrics:
                cells = [pooled_cell([one.get(metric) for one in per_run[label]]) for label in labels]
                out.append(f"| {metric} | " + " | ".join(cells) + " |")
            out.append("")
    return "\n".join(out).rstrip()


def _kind(run: dict[str, Any]) -> str:
    """What a run's figures measure: its task, or held-out text under its protocol."""
    rows = run.get("perplexity") or []
    if rows:
        return f"text, {protocol(rows[0]['mode'], stride_of(rows[0]))}"
    return str((run.get("data") or {}).get("task") or run.get("trained_task") or "tasks")


def _lengths(
    run: dict[str, Any], rule: str, shared: Mapping[str, Any], thresholds: Mapping[str, float]
) -> dict[str, int | None]:
    """A run's lengths under ``rule``, the absolute rule always with the table's shared thresholds.

    The relative rule as the run recorded it when the table uses the run's own settings, else recomputed.
    """
    if rule == "absolute":
        return effective_lengths(run, "absolute", shared["ppl_ratio"], shared["acc_fraction"], thresholds)
    own = settings(run)
    recorded = recorded_lengths(run, "relative")
    if recorded is not None and (own["ppl_ratio"], own["acc_fraction"]) == (
        shared["ppl_ratio"],
        shared["acc_fraction"],
    ):
        return recorded
    return effective_lengths(run, "relative", shared["ppl_ratio"], shared["acc_fraction"])
