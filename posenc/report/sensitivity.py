"""Which verdicts survive every setting: a scheme run at several values of its length settings, side by side.

Why: a scheme's settings follow the training length by a mapping someone chose (FIRE's threshold at L/4, T5's buckets
at L/16 up to L/4), and a verdict on the scheme may be a verdict on the mapping. Where a report holds one scheme at
several settings (columns that differ only in ``encoding.*``), this section puts, per protocol, each setting's
in-length perplexity, its longest-length ratio with the ratio's word against 1, and its ratio to ALiBi there with that
comparison's word (both from the crossed estimator, each a Holm family over the section's table), then says which
words hold at every setting and which move with it. Below, what the settings trained to (``learned_settings``: FIRE's
threshold per layer, with its multiplier's sign).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any

from posenc.report import claims
from posenc.report.common import Columns, order
from posenc.report.perplexity import group_order, group_runs, protocol
from posenc.training.identity import identity

REFERENCE = "alibi"


def settings_columns(by_label: Columns) -> dict[str, tuple[list[str], list[str]]]:
    """{scheme: (its columns, the settings they differ in)}: schemes with 2+ columns differing in encoding.* only."""
    by_scheme: dict[str, list[str]] = defaultdict(list)
    for label in order(by_label):
        by_scheme[label.split(" · ")[0]].append(label)
    found = {}
    for scheme, labels in by_scheme.items():
        if len(labels) < 2:
            continue
        settings = [identity(by_label[label][0]) for label in labels]
        keys = {key for one in settings for key in one}
        differing = {key for key in keys if len({repr(one.get(key)) for one in settings}) > 1}
        if differing and all(key.startswith("encoding.") for key in differing):
            found[scheme] = (labels, sorted(key.removeprefix("encoding.") for key in differing))
    return found


def _setting(runs: list[dict[str, Any]], keys: list[str]) -> str:
    """A column's values of ``keys`` as trained (the run's config holds a length-scaled null resolved at L)."""
    encoding = ((runs[0].get("config") or {}).get("encoding")) or {}
    values = {key: encoding.get(key) for key in keys}
    return ", ".join(
        f"{key} {value:g}" if isinstance(value, float) else f"{key} {value}" for key, value in values.items()
    )


def sensitivity_tables(results: list[dict[str, Any]], appendix: Any = None) -> str:
    """The section of the module docstring; empty when no scheme was run at several settings."""
    out: list[str] = []
    for key, by_label in sorted(group_runs(results).items(), key=lambda item: group_order(item[0])):
        schemes = settings_columns(by_label)
        if not schemes:
            continue
        train_len, mode, stride = key
        longest = max(row["length"] for runs in by_label.values() for run in runs for row in run["perplexity"])
        log_margin = math.log1p(claims.margin([run for runs in by_label.values() for run in runs])[0])
        reference = by_label.get(REFERENCE)
        labels = [label for found, _ in schemes.values() for label in found]
        ratios = {label: claims.log_ratio(by_label[label], longest, train_len) for label in labels}
        versus = {label: claims.log_ratio_between(by_label[label], reference, longest) for label in labels} if (
            reference) else {}  # fmt: skip
        flat, against = claims.words(ratios, log_margin), claims.words(versus, log_margin)
        times = f"{longest // train_len}×"
        out += [
            f"## Settings sensitivity, trained at L={train_len} — {protocol(mode, stride)}",
            "",
            f"Each setting's in-length perplexity, its {times}/1× ratio with the ratio's word against 1 (flat: "
            f"equivalent to 1 within ±{math.expm1(log_margin):.0%}), and its perplexity at {times} over "
            f"{REFERENCE}'s, with that comparison's word; each word from one Holm family over the table's cells.",
            "",
            f"| scheme | setting | n | 1× | {times}/1× | word | × {REFERENCE} at {times} | word |",
            "|---|---|---:|---:|---:|---|---:|---|",
        ]
        verdicts = []
        for scheme, (found, keys) in schemes.items():
            for label in found:
                runs = by_label[label]
                cells = [
                    scheme, _setting(runs, keys), str(len(runs)),
                    claims.shown(claims.log_perplexity(runs, train_len)), claims.shown(ratios[label], 3),
                    _word(flat.get(label), ratios[label], "1"), claims.shown(versus.get(label), 3),
                    _word(against.get(label), versus.get(label), REFERENCE),
                ]  # fmt: skip
                out.append("| " + " | ".join(cells) + " |")
            verdicts.append(_survives(scheme, found, flat, against, ratios, versus))
        out += ["", *verdicts, ""]
    out += learned_settings_table(results)
    return "\n".join(out).rstrip()


def _word(found: tuple[str, ...] | None, estimate: Any = None, against: str = "") -> str:
    """The words, with the side of a separated figure (``separated, above 1``); an equivalent ratio is "flat"."""
    if not found:
        return "—"
    if claims.EQUIVALENT in found:
        return "flat" if against == "1" else "equivalent"
    side = f", {_direction(estimate)} {against}" if claims.SEPARATED in found and estimate is not None else ""
    return ", ".join(found) + side


def _direction(estimate: Any) -> str:
    return "above" if estimate.estimate > 0 else "below"


def _survives(scheme: str, labels: list[str], flat: dict, against: dict, ratios: dict, versus: dict) -> str:
    """One line: which of the scheme's words hold at every setting, and which move with it."""
    parts = []
    ratio_words = {_word(flat.get(label), ratios[label], "1") for label in labels}
    if len(ratio_words) == 1:
        parts.append(f"its ratio is {ratio_words.pop()} at every setting")
    else:
        parts.append("its ratio's word moves with its setting (" + "; ".join(
            f"{label}: {_word(flat.get(label), ratios[label], '1')}" for label in labels) + ")")  # fmt: skip
    if versus:
        against_words = {_word(against.get(label), versus.get(label), REFERENCE) for label in labels}
        if len(against_words) == 1:
            parts.append(f"against {REFERENCE} it is {against_words.pop()} at every setting")
        else:
            moved = [f"{label}: {_word(against.get(label), versus.get(label), REFERENCE)}" for label in labels]
            parts.append(f"against {REFERENCE} its word moves with its setting (" + "; ".join(moved) + ")")
    return f"- **{scheme}**: " + "; ".join(parts) + "."


def learned_settings_table(results: list[dict[str, Any]]) -> list[str]:
    """What the runs' length settings trained to, per column and layer: mean over seeds [smallest, largest]."""
    by_column: dict[str, list[dict[str, Any]]] = defaultdict(list)
    seen: set[str] = set()
    for (_, _, _), by_label in group_runs(results).items():
        for label, runs in by_label.items():
            for run in runs:
                key = f"{label}/{run.get('seed')}"
                if run.get("learned_settings") and key not in seen:
                    seen.add(key)
                    by_column[label].append(run)
    if not by_column:
        return []
    out = [
        "### What the length settings trained to",
        "",
        "Per column and layer, each learned setting at the end of training: the mean over seeds [smallest, largest] "
        "(a multiplier's sign matters: FIRE's threshold is |multiplier| × its initial value).",
        "",
        "| column | layer | setting | mean [min, max] | seeds |",
        "|---|---:|---|---:|---:|",
    ]
    for label in order(by_column):
        runs = by_column[label]
        layers = max(len(run["learned_settings"]) for run in runs)
        for layer in range(layers):
            names = sorted({name for run in runs for name in (run["learned_settings"][layer] or {})})
            for name in names:
                values = [run["learned_settings"][layer][name] for run in runs
                          if name in (run["learned_settings"][layer] or {})]  # fmt: skip
                shown = f"{statistics.fmean(values):.3g} [{min(values):.3g}, {max(values):.3g}]"
                out.append(f"| {label} | {layer} | {name} | {shown} | {len(values)} |")
    return ["", *out]
