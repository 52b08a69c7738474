"""Every perplexity figure a table prints, and every comparison of two, from the crossed estimator; and its words.

Why one module: a cell, its interval and the verdict beside it must come from one estimator, or a table's marks and
its intervals can disagree. Each run records its summed loss on every scored document at every length
(``document_loss``, ``document_tokens``); the runs of a column share the documents, so seeds and documents are
crossed (``posenc/evaluate/crossed.py``). A figure is estimated on the log scale (log perplexity, log ratio of two
lengths, the log ratio of two columns) and shown back as a perplexity or a ratio. Where the runs did not record
their documents (older records, W&B summaries), only the seeds vary and the cell says so (ᵗ).

The words: **separated** (the Holm-adjusted p of "no difference" below 0.05), **equivalent** (two one-sided tests
that the ratio lies within ± the margin, Holm-adjusted), **inconclusive** (neither). The margin is the runs' own
(``eval.equivalence_margin``, fixed in the config before they ran); records that predate the setting take its
default, and the table says so. A ratio of two lengths equivalent to 1 is **flat**.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from posenc.evaluate.crossed import (
    ALPHA,
    EQUIVALENT,
    INCONCLUSIVE,
    SEEDS_ONLY,
    SEPARATED,
    Estimate,
    crossed,
    seeds_only,
    verdict,
)
from posenc.evaluate.stats import holm

# A ratio within 1% of the other (or of 1), or accuracies within 2 points, are equivalent unless the runs set theirs.
DEFAULT_MARGINS = {"equivalence_margin": 0.01, "equivalence_accuracy": 0.02}
MARKS = {SEPARATED: "✓", EQUIVALENT: "=", INCONCLUSIVE: "?"}
BEST = "◆"
SEEDS_ONLY_MARK = "ᵗ"
Runs = Sequence[dict[str, Any]]


def _row(run: dict[str, Any], length: int) -> dict[str, Any] | None:
    return next((r for r in run.get("perplexity") or [] if r["length"] == length and r["error"] is None), None)


def _tokens(run: dict[str, Any], row: dict[str, Any]) -> list[float] | None:
    """The targets scored in each document at this row's length: the row's own count, else the documents record's."""
    if row.get("document_tokens") is not None:
        return [float(n) for n in row["document_tokens"]]
    tokens = (run.get("documents") or {}).get("tokens")
    return [float(n) for n in tokens] if tokens else None


def _per_token(runs: Runs, length: int) -> dict[Any, np.ndarray] | None:
    """{seed: each document's share of the pooled loss per token, linearised}, or None where a run lacks it.

    The value of document d for seed s is D (y_sd − θ t_d) / T + θ, with y its summed loss, t its tokens, T their
    total and θ the pooled loss per token of all the runs: the mean over documents is the seed's loss per token, and
    the spread over documents is the ratio estimator's. Every run must have scored the same documents.
    """
    rows = [(run, _row(run, length)) for run in runs]
    if not rows or any(row is None or row.get("document_loss") is None for _, row in rows):
        return None
    documents = {repr((run.get("documents") or {}).get("documents")) for run, _ in rows}
    tokens = [_tokens(run, row) for run, row in rows]
    if len(documents) != 1 or tokens[0] is None or any(t != tokens[0] for t in tokens):
        return None
    weights = np.asarray(tokens[0], dtype=float)
    sums = np.asarray([row["document_loss"] for _, row in rows], dtype=float)
    if sums.shape[1] != weights.size or not (weights > 0).all():
        return None
    theta = sums.sum() / (len(rows) * weights.sum())
    values = weights.size * (sums - theta * weights) / weights.sum() + theta
    return {run.get("seed"): value for (run, _), value in zip(rows, values, strict=True)}


def _log_ppl(runs: Runs, length: int) -> dict[Any, float]:
    found = {}
    for run in runs:
        row = _row(run, length)
        if row is not None and row.get("ppl") is not None and math.isfinite(row["ppl"]) and row["ppl"] > 0:
            found[run.get("seed")] = math.log(row["ppl"])
    return found


def _estimate(parts: Sequence[tuple[float, Runs, int]]) -> Estimate | None:
    """Σ sign · (log perplexity of ``runs`` at ``length``) over ``parts``, on the seeds every part has."""
    crossed_parts = [_per_token(runs, length) for _, runs, length in parts]
    if all(part is not None for part in crossed_parts):
        seeds = set.intersection(*(set(part) for part in crossed_parts))  # type: ignore[union-attr]
        shapes = {part[next(iter(part))].shape for part in crossed_parts}  # type: ignore[index]
        if seeds and len(shapes) == 1:
            order = sorted(seeds, key=str)
            values = sum(
                sign * np.stack([part[s] for s in order])
                for (sign, _, _), part in zip(parts, crossed_parts, strict=True)
            )
            return crossed(values)
    logs = [_log_ppl(runs, length) for _, runs, length in parts]
    seeds = set.intersection(*(set(found) for found in logs))
    if not seeds:
        return None
    order = sorted(seeds, key=str)
    return seeds_only([sum(sign * found[s] for (sign, _, _), found in zip(parts, logs, strict=True)) for s in order])


def log_perplexity(runs: Runs, length: int) -> Estimate | None:
    """A column's log perplexity at ``length``."""
    return _estimate([(1.0, runs, length)])


def log_ratio(runs: Runs, length: int, base: int) -> Estimate | None:
    """A column's log of perplexity at ``length`` over its own at ``base``, seed by seed, document by document."""
    return _estimate([(1.0, runs, length), (-1.0, runs, base)])


def log_ratio_between(runs: Runs, others: Runs, length: int, base: int | None = None) -> Estimate | None:
    """log(ppl of ``runs`` / ppl of ``others``) at ``length`` (of their ratios to ``base``, if given), by seed."""
    if base is None:
        return _estimate([(1.0, runs, length), (-1.0, others, length)])
    return _estimate([(1.0, runs, length), (-1.0, runs, base), (-1.0, others, length), (1.0, others, base)])


def margin(runs: Runs, key: str = "equivalence_margin") -> tuple[float, bool]:
    """(the equivalence margin the runs were set to, whether they recorded one); the default where none did.

    ``key``: ``equivalence_margin`` (a ratio of perplexities, relative) or ``equivalence_accuracy`` (a difference of
    accuracies, absolute). Runs that recorded different margins are refused in one line: a comparison has one margin,
    fixed before the runs.
    """
    found = {(run.get("eval") or {}).get(key) for run in runs}
    recorded = {value for value in found if value is not None}
    if len(recorded) > 1:
        raise SystemExit(
            f"these runs were set to different equivalence margins ({', '.join(map(str, sorted(recorded)))}): "
            f"report them apart, or run them again with one eval.{key}"
        )
    return (float(recorded.pop()), True) if recorded else (DEFAULT_MARGINS[key], False)


def shown(estimate: Estimate | None, digits: int = 2) -> str:
    """``5.90 [5.85, 5.96]``: exp of the estimate and of its 95% interval; ᵗ where only the seeds vary."""
    if estimate is None or not math.isfinite(estimate.estimate):
        return "—"
    text = f"{math.exp(estimate.estimate):.{digits}f}"
    if math.isfinite(estimate.se):
        low, high = estimate.interval()
        text += f" [{math.exp(low):.{digits}f}, {math.exp(high):.{digits}f}]"
    return text + (SEEDS_ONLY_MARK if estimate.source == SEEDS_ONLY else "")


def words(estimates: Mapping[str, Estimate | None], log_margin: float) -> dict[str, tuple[str, ...]]:
    """{name: the words its comparison earns}: one Holm family for "no difference", one for the equivalence tests.

    An estimate without a standard error (one seed and no documents) is left out: it earns no word.
    """
    tested = {name: e for name, e in estimates.items() if e is not None and math.isfinite(e.se)}
    differs = holm({name: e.p_value for name, e in tested.items()})
    same = holm({name: e.equivalence_p(log_margin) for name, e in tested.items()})
    return {name: verdict(differs[name], same[name], ALPHA) for name in tested}


def mark(found: tuple[str, ...] | None) -> str:
    """The cell mark of a comparison's words (``✓`` separated, ``=`` equivalent, both, or ``?``)."""
    return "" if not found else "".join(MARKS[word] for word in found)


def detectable_percent(estimates: Sequence[Estimate | None]) -> str:
    """The range of the smallest differences these comparisons detect (80% power, 5% level), as percent of the ratio."""
    found = [e.detectable() for e in estimates if e is not None and math.isfinite(e.se)]
    if not found:
        return "—"
    low, high = (math.expm1(x) * 100 for x in (min(found), max(found)))
    return f"{low:.1f}%" if abs(high - low) < 0.05 else f"{low:.1f}–{high:.1f}%"


def flat_legend(log_margin: float, over: str = "the table") -> str:
    """What a ratio's marks say, under a table of ratios tested against 1 (Holm-adjusted ``over`` that family)."""
    return (
        f"Ratio marks, each ratio tested against 1 and Holm-adjusted over {over}: {MARKS[SEPARATED]} separated from "
        f"1, {MARKS[EQUIVALENT]} flat (equivalent to 1 within ±{math.expm1(log_margin):.0%}), {MARKS[INCONCLUSIVE]} "
        f"inconclusive; {SEEDS_ONLY_MARK}: over seeds only."
    )
