"""What every report section shares: cells with their spread or interval, column order, the header, the appendix.

A section module (perplexity, tasks, attention) turns a list of results into markdown lines; the numbers in its
cells come from here, so every table formats them the same way. Every table's header comes from ``table_head``,
so no table puts unlike runs side by side unflagged: each column names its runs, steps and tokens trained, the
settings in which it differs from the other columns are listed above the table, and the ``Appendix`` names the
run directories behind every column.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from posenc.evaluate.stats import Interval, t_interval
from posenc.training.identity import filled_in, identity

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


def interval(values: Sequence[float | None]) -> Interval | None:
    """The Student-t interval over the finite values (one per seed), ``None`` when there is none."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return t_interval(finite) if finite else None


def interval_cells(by_label: Mapping[str, Sequence[float | None]], digits: int = 2) -> dict[str, str]:
    """{column: ``mean ± half-width``} over seeds for one row, without marks: figures that vary by seed alone.

    A cell's own n is shown only where it differs from its column's (a length that failed for some seeds).
    """
    out = {}
    for label, values in by_label.items():
        iv = interval(values)
        if iv is None:
            out[label] = "—"
            continue
        text = f"{iv.mean:.{digits}f}" + ("" if iv.half_width is None else f" ± {iv.half_width:.{digits}f}")
        out[label] = text + (f" (n={iv.n})" if iv.n != len(values) else "")
    return out


def order(labels: Iterable[str]) -> list[str]:
    """Schemes in registry order first, then hybrids, each alphabetically: stable columns across reports.

    Numbers in a label sort by value (``m=3`` before ``m=10`` before ``m=100``), so a swept setting reads in order.
    """
    from posenc.encodings import available

    known = available()

    def key(label: str) -> tuple[bool, int, tuple[str | float, ...]]:
        scheme = label.split(" · ")[0]
        parts = re.split(r"(\d+(?:\.\d+)?)", label)  # text at even places, numbers at odd ones: always comparable
        natural = tuple(float(part) if index % 2 else part for index, part in enumerate(parts))
        return scheme not in known, known.index(scheme) if scheme in known else 0, natural

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


def differences(by_label: Columns) -> dict[str, dict[str, Any]]:
    """{column: {key: value} for every identity setting in which the columns differ}, beyond the scheme itself.

    Within one scheme the labels already name the difference (``alibi · max_steps=40``); across schemes only
    this says that ``t5`` was trained for 100 steps and ``rope`` for 30.
    """
    recorded = {label: identity(runs[0]) for label, runs in by_label.items()}
    keys = sorted({key for one in recorded.values() for key in one if not key.startswith(_NAMED)})
    settings = {label: filled_in(one, keys) for label, one in recorded.items()}  # what older runs left unsaid
    differing = [key for key in keys if len({repr(one[key]) for one in settings.values()}) > 1]
    if {"data.corpus", "data.task"} & set(differing):  # the corpus says it; its fingerprint adds nothing
        differing = [key for key in differing if key != "data.fingerprint"]
    return {label: {key: settings[label][key] for key in differing} for label in by_label}


def by_setting(differ: Mapping[str, Mapping[str, Any]]) -> str:
    """``differences`` read by setting: each value with the columns that have it, the commonest as "the other N".

    Read by column, every column would repeat the one value most of them share (``model.depth=4``) and hide the
    one that differs (``gemma3: model.depth=6``).
    """
    values: dict[str, dict[str, list[str]]] = {}
    for label, found in differ.items():
        for key, value in found.items():
            values.setdefault(key, {}).setdefault(str(value), []).append(label)
    notes = []
    for key, labels_of in values.items():
        ranked = sorted(labels_of.items(), key=lambda item: -len(item[1]))
        common, rest = (ranked[0], ranked[1:]) if len(ranked[0][1]) > 1 else (None, ranked)
        notes += [f"{key}={value} in {', '.join(labels)}" for value, labels in rest]
        if common is not None:
            notes.append(f"{key}={common[0]} in the other {len(common[1])}")
    return "; ".join(notes)


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
    gaps = {label: coverage_gaps(by_label[label]) for label in labels}
    unsettled = {label: unsettled_seeds(by_label[label]) for label in labels}
    header = first + " | ".join(
        f"{label}{UNREACHED if gaps[label] else ''}{UNSETTLED if unsettled[label] else ''} "
        f"(n={len(by_label[label])} · {trained(by_label[label])})"
        for label in labels
    )
    out = [header + " |", "|---:" * first.count("|", 1) + "|" + "---:|" * len(labels)]
    differ = differences({label: by_label[label] for label in labels})
    tuned = tuned_settings({label: by_label[label] for label in labels})
    if tuned:  # learning rates each scheme was given by one tuning: said as such, not as a difference
        differ = {label: {k: v for k, v in found.items() if k not in TUNED_KEYS} for label, found in differ.items()}
        out = [tuned, "", *out]
    schemes = {label.split(" · ")[0] for label in labels}  # within one scheme, the labels name the difference
    if len(schemes) > 1 and any(differ.values()):
        out = [f"**These columns differ in more than their scheme** — {by_setting(differ)}.", "", *out]
    if any(gaps.values()):
        notes = "; ".join(f"{label}: {gaps[label]}" for label in labels if gaps[label])
        out = [
            f"{UNREACHED} reads positional parameters that training at its length never reached — {notes}.",
            "",
            *out,
        ]
    if any(unsettled.values()):
        out = [unsettled_line({label: unsettled[label] for label in labels if unsettled[label]}), "", *out]
    context = scored_on({label: by_label[label] for label in labels})
    return ([context, ""] if context else []) + out


UNREACHED = "†"
UNSETTLED = "‡"
TUNED_KEYS = frozenset({"optim.lr", "optim.scheme_lr_multiplier", "optim.tuned"})
GENERATED_WINDOWS = (
    "generated windows, not a text split (the same windows at a length for every run, from the evaluation's own seed, "
    "apart from every training and validation seed)"
)


def coverage_gaps(runs: Sequence[dict[str, Any]]) -> str:
    """What a column's runs left untrained (their ``coverage`` records), one phrase per parameter; "" when nothing."""
    notes = {
        f"{gap['scheme']} {gap['parameter']}: {gap['note']}"
        for run in runs
        for gap in (run.get("coverage") or {}).get("gaps", [])
    }
    return "; ".join(sorted(notes))


def drift_counts(runs: Sequence[dict[str, Any]]) -> tuple[int, int, int]:
    """(seeds still moving, seeds barely moved, seeds with a drift record) of a column's runs.

    Read from each run's own ``positional_drift`` record, whose rule is the one its run was measured by; every table
    and mark that says a column had not settled counts from here.
    """
    records = [record for run in runs if (record := run.get("positional_drift")) is not None]
    moving = sum(1 for record in records if record.get("still_moving"))
    barely = sum(1 for record in records if record.get("barely_moved"))
    return moving, barely, len(records)


def unsettled_seeds(runs: Sequence[dict[str, Any]]) -> str:
    """How many of a column's seeds ended with positional parameters still moving, or barely moved; "" when none."""
    moving, barely, _ = drift_counts(runs)
    parts = [f"still moving in {moving} of {len(runs)} seeds"] if moving else []
    parts += [f"barely moved in {barely} of {len(runs)}"] if barely else []
    return ", ".join(parts)


def unsettled_line(notes: dict[str, str]) -> str:
    """The one sentence, under a table or over the comparisons, naming the under-trained columns ({column: seeds})."""
    return (
        f"{UNSETTLED} under-trained at this budget: its positional parameters were still moving at the end of "
        "training, or had barely moved from their initialisation (positional parameters, below), so its cells and "
        "any difference from it say what this budget gave the scheme, not what the scheme learns — "
        + "; ".join(f"{label}: {note}" for label, note in notes.items())
        + "."
    )


def tuned_settings(by_label: Columns) -> str:
    """The line saying which learning rates each column was selected with, when every run took them from one tuning."""
    records = {label: [run.get("config", {}).get("tuning") for run in runs] for label, runs in by_label.items()}
    sources = {record.get("from") for found in records.values() for record in found if record}
    if len(sources) != 1 or not all(all(found) for found in records.values()):
        return ""
    first = next(iter(records.values()))[0]
    chosen = "; ".join(
        f"{label}: lr {found[0]['lr']:g}, ×{found[0]['scheme_lr_multiplier']:g}" for label, found in records.items()
    )
    rules: dict[str, list[str]] = {}
    for label, found in records.items():  # a column's seeds may have read two wordings (seeds added later)
        seeds: dict[str, list[Any]] = {}
        for run, record in zip(by_label[label], found, strict=True):
            seeds.setdefault(str(record.get("rule")), []).append(run.get("seed"))
        for wording, read in seeds.items():
            ordered = sorted(read, key=lambda seed: (not isinstance(seed, int), seed if isinstance(seed, int) else 0))
            which = f"seed{'s' if len(ordered) > 1 else ''} {_ranges(ordered)}"
            shown = label if len(seeds) == 1 else f"{label} {which}"
            rules.setdefault(wording, []).append(shown)
    if len(rules) == 1:
        rule = f"by one rule ({first.get('rule')})"
    else:  # the selection file was rewritten between runs: say which columns read which wording of the rule
        rule = "by the rule as each run read it (" + "; ".join(f"{', '.join(ls)}: {r}" for r, ls in rules.items()) + ")"
    return (
        f"Learning rates selected per scheme on the {first.get('split')} split {rule}, "
        f"from {next(iter(sources))}: {chosen}."
    )


def _ranges(seeds: Sequence[Any]) -> str:
    """Seeds as a reader counts them: ``0–4, 7`` for 0, 1, 2, 3, 4, 7 (runs of consecutive integers as ranges)."""
    parts: list[list[Any]] = []
    for seed in seeds:
        if parts and isinstance(seed, int) and isinstance(parts[-1][-1], int) and seed == parts[-1][-1] + 1:
            parts[-1].append(seed)
        else:
            parts.append([seed])
    return ", ".join(f"{run[0]}–{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in parts)


def _shown_budget(tokens_per_parameter: float) -> float:
    """One decimal, as every study's budget reads; two significant figures below it, so a demo's budget is not 0."""
    return round(tokens_per_parameter, 1) if tokens_per_parameter >= 0.05 else float(f"{tokens_per_parameter:.2g}")


def scored_on(by_label: Columns) -> str:
    """The split the cells were scored on and the budget the columns trained for, in tokens a parameter.

    A run trained on a task reads no text split: its evaluation windows are generated from the evaluation's own seed,
    the same windows for every run, so naming the text split its config still carries would misstate what was scored.
    """
    runs = [run for found in by_label.values() for run in found]
    text = [run for run in runs if not run.get("trained_task")]
    splits = sorted({str((run.get("eval") or {}).get("split") or "validation") for run in text})
    budgets = sorted({_shown_budget(run["budget"]["tokens_per_parameter"]) for run in runs if run.get("budget")})
    scored = [f"the {' and '.join(splits)} split"] if splits else []
    if len(text) < len(runs):
        scored.append(GENERATED_WINDOWS)
    parts = [f"Scored on {'; and on '.join(scored)}"]
    if budgets:
        shown = f"{budgets[0]:g}" if len(budgets) == 1 else f"{budgets[0]:g}–{budgets[-1]:g}"
        parts.append(f"trained for {shown} tokens a parameter")
    said = any(run.get("budget") for run in runs) or splits not in ([], ["validation"])
    return "; ".join(parts) + "." if said else ""
