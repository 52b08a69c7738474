"""Effective length: how far past the training length each metric of a run holds up.

One number per metric answers "up to what length can this model be used?" without reading a whole curve:

- perplexity (``ppl``) holds at a length when its ratio to the in-length perplexity is ≤ ``ppl_ratio``
  (default 1.10: at most 10% worse than at the training length);
- a task accuracy (``passkey``, ``copy``, a retrieval task, and each of their ``*_accuracy`` fields as
  ``<task>_<field>``) holds when it is ≥ ``acc_fraction`` × its in-length accuracy (default 0.8) **and** above the
  floor its rows record (``FLOORS``: the keyless floor of a retrieval task, the best guess blind to which key holds
  which fact, else the uniform-guess chance rate, else 0). A task scored at several depths (passkey) is averaged
  over them at each length first.

The rule is contiguous: the effective length is the longest evaluated length L ≥ the training length such that
**every** evaluated length from the training length up to L holds. A metric that fails at 2× and recovers at 4×
has effective length 1× (the training length), never 4×: a model is usable up to a length only if it is usable at
every length on the way. A length that failed to evaluate (an error row) does not hold. Lengths shorter than the
training length are not considered. The value is ``None`` when there is no in-length figure to compare with (no
row at the training length, or it failed), or when the in-length accuracy does not clear its floor: a task never
learned has no length at which it holds up, and a model at a retrieval task's keyless floor (it guesses among the
window's values, or answers by elimination) has not learned the lookup, however far that guess stays level.

Pure functions over a ``results.json`` dict, so the report can compute it for results written before it existed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

DEFAULT_PPL_RATIO = 1.10
DEFAULT_ACC_FRACTION = 0.8
PERPLEXITY = "ppl"
SLACK = 1e-9  # a figure exactly at the threshold holds, whatever the float rounding of ratio × in-length
# Each accuracy field's floors, in the rows that record them: what a model scores without the skill measured.
FLOORS = {
    "accuracy": ("keyless_exact", "chance_exact"),
    "first_byte_accuracy": ("keyless_first_byte", "chance_first_byte"),
    "token_accuracy": ("keyless_first_byte", "chance_first_byte"),  # the first byte's: exact for one-byte answers
}


def check_thresholds(ppl_ratio: float, acc_fraction: float) -> None:
    """One clear error for thresholds that make no sense (a ratio below 1, a fraction outside (0, 1])."""
    if not ppl_ratio >= 1.0:
        raise ValueError(f"eval.effective_ppl_ratio must be ≥ 1 (perplexity relative to in-length), got {ppl_ratio}")
    if not 0.0 < acc_fraction <= 1.0:
        raise ValueError(f"eval.effective_acc_fraction must be in (0, 1] (of in-length accuracy), got {acc_fraction}")


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


def _accuracy_fields(rows: list[Mapping[str, Any]]) -> list[str]:
    fields = [key for key in rows[0] if key.endswith("accuracy")]
    return sorted(fields, key=lambda key: key != "accuracy")  # exact match first


def effective_lengths(
    results: Mapping[str, Any], ppl_ratio: float | None = None, acc_fraction: float | None = None
) -> dict[str, int | None]:
    """{metric: effective length in tokens, or ``None``} for every metric in ``results`` (see the module docstring).

    Thresholds left ``None`` come from the results' own ``eval`` settings (``effective_ppl_ratio``,
    ``effective_acc_fraction``), then the defaults, so older results are judged by today's rule.
    """
    settings = results.get("eval") or {}
    if ppl_ratio is None:
        ppl_ratio = float(settings.get("effective_ppl_ratio") or DEFAULT_PPL_RATIO)
    if acc_fraction is None:
        acc_fraction = float(settings.get("effective_acc_fraction") or DEFAULT_ACC_FRACTION)
    check_thresholds(ppl_ratio, acc_fraction)
    train_len = int(results["train_len"])
    out: dict[str, int | None] = {}
    rows = results.get("perplexity") or []
    if rows:
        ppl = {int(r["length"]): (None if r.get("error") else r["ppl"]) for r in rows}
        base = ppl.get(train_len)
        out[PERPLEXITY] = (
            None if base is None else contiguous_length(ppl, train_len, lambda p: p / base <= ppl_ratio + SLACK)
        )
    for name, task_rows in results.items():
        if name == "perplexity" or not _is_task(task_rows):
            continue
        for field in _accuracy_fields(task_rows):
            by_length: dict[int, list[float]] = {}
            for row in task_rows:
                by_length.setdefault(int(row["length"]), []).append(float(row[field]))
            accuracy = {length: float(np.mean(accs)) for length, accs in by_length.items()}
            base = accuracy.get(train_len)
            metric = name if field == "accuracy" else f"{name}_{field}"
            floor = task_floor(task_rows, field)
            if base is None or base <= floor + SLACK:
                out[metric] = None
                continue
            out[metric] = contiguous_length(
                accuracy,
                train_len,
                lambda a, base=base, floor=floor: a >= acc_fraction * base - SLACK and a > floor + SLACK,
            )
    return out


def task_floor(rows: list[Mapping[str, Any]], field: str) -> float:
    """The highest floor the rows record for ``field`` (0 where none is recorded: passkey, copy, older results)."""
    recorded = [float(row[key]) for row in rows for key in FLOORS.get(field, ()) if row.get(key) is not None]
    return max(recorded, default=0.0)


def _is_task(rows: Any) -> bool:
    """A task's rows: a list of dicts with a length and an exact-match ``accuracy`` (as every task scorer writes)."""
    return (
        isinstance(rows, list)
        and bool(rows)
        and isinstance(rows[0], Mapping)
        and "length" in rows[0]
        and "accuracy" in rows[0]
    )
