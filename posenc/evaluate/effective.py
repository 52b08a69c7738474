"""Effective length: how far past the training length each metric of a run holds up, under two rules.

- **absolute** (a shared threshold): a length holds when its figure clears one threshold shared by every model of a
  comparison. It is RULER's rule (Hsieh et al. 2024) only where the threshold is fixed in advance: RULER fixes an
  accuracy, a reference model's score at its base length (``eval.effective_acc_threshold``, 0.856 in RULER). Where no
  threshold is fixed the rule is posenc's own: ``effective_acc_fraction`` × the best in-length accuracy of the
  comparison, or ``effective_ppl_ratio`` × its best in-length perplexity (a perplexity threshold RULER never had), so
  the threshold moves with whichever columns are compared. A model that starts badly has no length at which it
  holds, however flat it stays.
- **relative**: a length holds when the figure stays within ``effective_ppl_ratio`` of the run's *own* in-length
  perplexity (default 1.10), or at least ``effective_acc_fraction`` of its own in-length accuracy (default 0.8).
  It measures degradation only, so it rewards a model that starts badly and stays flat.

Under both rules a task accuracy must also stay above the floor its rows record (``FLOORS``: the keyless floors of a
retrieval task, the best guess blind to which key holds which fact, else the uniform-guess chance rate), a task
scored at several depths (passkey) is averaged over them at each length first, and the rule is contiguous: the
effective length is the longest evaluated length L ≥ the training length such that **every** evaluated length from
the training length up to L holds. A metric that fails at 2× and recovers at 4× has effective length 1× (the
training length); a length that failed to evaluate does not hold. The value is ``None`` when there is no in-length
figure, when the in-length figure itself does not hold (under the absolute rule), or when the in-length accuracy
does not clear its floor: a task never learned has no length at which it holds up.

A single run's ``results.json`` is its own comparison, so its absolute thresholds come from its own in-length
figures unless fixed thresholds are set; ``posenc.report`` recomputes the absolute rule with the thresholds shared
across the columns of each table (``comparison_thresholds``). Pure functions over ``results.json`` dicts, so the
report can judge results written before these rules existed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

DEFAULT_PPL_RATIO = 1.10
DEFAULT_ACC_FRACTION = 0.8
PERPLEXITY = "ppl"
RULES = ("absolute", "relative")
SLACK = 1e-9  # a figure exactly at the threshold holds, whatever the float rounding of ratio × in-length
# A task's exact match over the answers past the training length only (at the training length, all of them): where
# a task's rows record it, its effective length is read from it instead of ``accuracy``, since an answer within the
# first L positions of a long window is an in-length prediction (MQAR, ``posenc/evaluate/mqar.py``).
PAST_TRAIN_LEN = "past_train_len_accuracy"
# Each accuracy field's floors, in the rows that record them: what a model scores without the skill measured.
FLOORS = {
    "accuracy": ("keyless_exact", "keyless_exact_elimination", "chance_exact"),
    PAST_TRAIN_LEN: ("keyless_exact", "keyless_exact_elimination", "chance_exact"),
    "first_byte_accuracy": ("keyless_first_byte", "keyless_first_byte_elimination", "chance_first_byte"),
    # the first byte's: exact for one-byte answers
    "token_accuracy": ("keyless_first_byte", "keyless_first_byte_elimination", "chance_first_byte"),
}


def check_thresholds(
    ppl_ratio: float, acc_fraction: float, ppl_threshold: float | None = None, acc_threshold: float | None = None
) -> None:
    """One clear error for thresholds that make no sense (a ratio below 1, a fraction outside (0, 1], …)."""
    if not ppl_ratio >= 1.0:
        raise ValueError(f"eval.effective_ppl_ratio must be ≥ 1 (perplexity relative to in-length), got {ppl_ratio}")
    if not 0.0 < acc_fraction <= 1.0:
        raise ValueError(f"eval.effective_acc_fraction must be in (0, 1] (of in-length accuracy), got {acc_fraction}")
    if ppl_threshold is not None and not ppl_threshold >= 1.0:
        raise ValueError(f"eval.effective_ppl_threshold must be a perplexity ≥ 1 or null, got {ppl_threshold}")
    if acc_threshold is not None and not 0.0 < acc_threshold <= 1.0:
        raise ValueError(f"eval.effective_acc_threshold must be an accuracy in (0, 1] or null, got {acc_threshold}")


def contiguous_length(values: Mapping[int, float | None], train_len: int, holds: Callable[[float], bool]) -> int | None:
    """Longest length ≥ ``train_len`` with ``holds(value)`` true there and at every evaluated length before it.

    ``values`` maps each evaluated length to its figure (``None`` for a length that failed). ``None`` when the
    training length itself is missing.
    """
    if values.get(train_len) is None:
        return None
    effective = train_len
    for length in sorted(n for n in values if n > train_len):
        value = values[length]
        if value is None or not holds(value):
            break
        effective = length
    return effective


def settings(results: Mapping[str, Any]) -> dict[str, float | None]:
    """The thresholds a result was evaluated with (its ``eval`` settings), the defaults where it recorded none."""
    recorded = results.get("eval") or {}
    return {
        "ppl_ratio": float(recorded.get("effective_ppl_ratio") or DEFAULT_PPL_RATIO),
        "acc_fraction": float(recorded.get("effective_acc_fraction") or DEFAULT_ACC_FRACTION),
        "ppl_threshold": recorded.get("effective_ppl_threshold"),
        "acc_threshold": recorded.get("effective_acc_threshold"),
    }


def metric_series(results: Mapping[str, Any]) -> dict[str, tuple[dict[int, float | None], float, bool]]:
    """{metric: (figure by length, floor, higher is better)} for perplexity and every task accuracy field."""
    out: dict[str, tuple[dict[int, float | None], float, bool]] = {}
    rows = results.get("perplexity") or []
    if rows:
        out[PERPLEXITY] = ({int(r["length"]): (None if r.get("error") else r["ppl"]) for r in rows}, 0.0, False)
    for name, task_rows in results.items():
        if name == "perplexity" or not _is_task(task_rows):
            continue
        fields = _accuracy_fields(task_rows)
        if PAST_TRAIN_LEN in fields:  # the exact match over past-L answers replaces the one over every answer
            fields.remove("accuracy")
        for field in fields:
            by_length: dict[int, list[float | None]] = {}
            for row in task_rows:
                value = row.get(field)
                by_length.setdefault(int(row["length"]), []).append(None if value is None else float(value))
            accuracy = {
                length: None if None in accs else float(np.mean(accs))  # a length without past-L answers fails
                for length, accs in by_length.items()
            }
            metric = name if field == "accuracy" else f"{name}_{field}"
            out[metric] = (accuracy, task_floor(task_rows, field), True)
    return out


def comparison_thresholds(
    runs: Sequence[Mapping[str, Any]],
    ppl_ratio: float = DEFAULT_PPL_RATIO,
    acc_fraction: float = DEFAULT_ACC_FRACTION,
    ppl_threshold: float | None = None,
    acc_threshold: float | None = None,
    columns: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
) -> dict[str, float]:
    """{metric: the absolute threshold every run of a comparison is held to}.

    A fixed threshold wins; otherwise the fraction (ratio) × the best in-length figure of the comparison: the best
    column's mean over its seeds when ``columns`` groups the runs, else the best single run.
    """
    groups = list(columns.values()) if columns else [[run] for run in runs]
    best: dict[str, float] = {}
    higher: dict[str, bool] = {}
    for group in groups:
        figures: dict[str, list[float]] = {}
        for run in group:
            for metric, (values, _, is_higher) in metric_series(run).items():
                higher[metric] = is_higher
                value = values.get(int(run["train_len"]))
                if value is not None and np.isfinite(value):
                    figures.setdefault(metric, []).append(float(value))
        for metric, values in figures.items():
            mean = float(np.mean(values))
            if metric not in best or (mean > best[metric] if higher[metric] else mean < best[metric]):
                best[metric] = mean
    out = {}
    for metric, value in best.items():
        if higher[metric]:
            out[metric] = acc_threshold if acc_threshold is not None else acc_fraction * value
        else:
            out[metric] = ppl_threshold if ppl_threshold is not None else ppl_ratio * value
    return out


def effective_lengths(
    results: Mapping[str, Any],
    rule: str = "relative",
    ppl_ratio: float | None = None,
    acc_fraction: float | None = None,
    thresholds: Mapping[str, float] | None = None,
) -> dict[str, int | None]:
    """{metric: effective length in tokens, or ``None``} for every metric in ``results`` (see the module docstring).

    ``rule`` is ``relative`` or ``absolute``. Thresholds left ``None`` come from the results' own ``eval`` settings,
    then the defaults, so older results are judged by today's rule; ``thresholds`` ({metric: value}) gives the
    absolute rule a comparison's shared thresholds, else the run is its own comparison.
    """
    if rule not in RULES:
        raise ValueError(f"effective-length rule must be one of {RULES}, got {rule!r}")
    recorded = settings(results)
    ppl_ratio = recorded["ppl_ratio"] if ppl_ratio is None else ppl_ratio
    acc_fraction = recorded["acc_fraction"] if acc_fraction is None else acc_fraction
    check_thresholds(ppl_ratio, acc_fraction, recorded["ppl_threshold"], recorded["acc_threshold"])
    if rule == "absolute" and thresholds is None:
        thresholds = comparison_thresholds(
            [results], ppl_ratio, acc_fraction, recorded["ppl_threshold"], recorded["acc_threshold"]
        )
    train_len = int(results["train_len"])
    out: dict[str, int | None] = {}
    for metric, (values, floor, higher) in metric_series(results).items():
        base = values.get(train_len)
        if base is None or (higher and base <= floor + SLACK):
            out[metric] = None
            continue
        if rule == "relative":
            limit = (acc_fraction if higher else ppl_ratio) * base
        elif thresholds is None or metric not in thresholds:
            out[metric] = None
            continue
        else:
            limit = thresholds[metric]

        def holds(value: float, limit: float = limit, floor: float = floor, higher: bool = higher) -> bool:
            if higher:
                return value >= limit - SLACK and value > floor + SLACK
            return value <= limit + SLACK

        out[metric] = contiguous_length(values, train_len, holds) if holds(base) else None
    return out


def both_rules(results: Mapping[str, Any]) -> dict[str, Any]:
    """What ``results.json`` records: each rule's lengths, and the absolute thresholds (the run its own comparison)."""
    recorded = settings(results)
    thresholds = comparison_thresholds(
        [results],
        float(recorded["ppl_ratio"]),
        float(recorded["acc_fraction"]),
        recorded["ppl_threshold"],
        recorded["acc_threshold"],
    )
    return {
        "absolute": effective_lengths(results, "absolute", thresholds=thresholds),
        "relative": effective_lengths(results, "relative"),
        "absolute_thresholds": thresholds,
    }


def recorded_lengths(results: Mapping[str, Any], rule: str) -> dict[str, int | None] | None:
    """A result's recorded effective lengths under ``rule`` (older results recorded the relative rule, flat)."""
    recorded = results.get("effective_length")
    if not isinstance(recorded, Mapping):
        return None
    if rule in recorded and isinstance(recorded[rule], Mapping):
        return dict(recorded[rule])
    nested = any(isinstance(value, Mapping) for value in recorded.values())
    return dict(recorded) if rule == "relative" and not nested else None


def learned(rows: Sequence[Mapping[str, Any]], train_len: int) -> bool | None:
    """Whether a run learned a task: its in-length accuracy clears every floor its rows record.

    Where the rows carry the Wilson interval of their counts (``low``), its lower end must clear the highest floor
    (for MQAR the keyless floor with elimination: a model above it answers better than any guess blind to keys, even
    one granted the earlier answers); otherwise the accuracy itself. ``None`` without an in-length row.
    """
    mine = [row for row in rows if int(row["length"]) == train_len]
    if not mine:
        return None
    floor = task_floor(list(mine), "accuracy")
    return all(float(row["low"] if row.get("low") is not None else row["accuracy"]) > floor + SLACK for row in mine)


def task_floor(rows: list[Mapping[str, Any]], field: str) -> float:
    """The highest floor the rows record for ``field`` (0 where none is recorded: passkey, copy, older results)."""
    recorded = [float(row[key]) for row in rows for key in FLOORS.get(field, ()) if row.get(key) is not None]
    return max(recorded, default=0.0)


def _accuracy_fields(rows: list[Mapping[str, Any]]) -> list[str]:
    fields = [key for key in rows[0] if key.endswith("accuracy")]
    return sorted(fields, key=lambda key: key != "accuracy")  # exact match first


def _is_task(rows: Any) -> bool:
    """A task's rows: a list of dicts with a length and an exact-match ``accuracy`` (as every task scorer writes)."""
    return (
        isinstance(rows, list)
        and bool(rows)
        and isinstance(rows[0], Mapping)
        and "length" in rows[0]
        and "accuracy" in rows[0]
        and "distance_low" not in rows[0]
        and "query" not in rows[0]
    )
