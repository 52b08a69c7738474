"""MQAR scoring (``posenc/data/mqar.py``): accuracy by window length, by query–key distance and by query index.

Every answer is one byte (a value), scored by teacher-forced argmax at its query. Three breakdowns, each with the
Wilson interval of its counts:

- ``mqar``: by window length. The row at the training length is scored on windows of the training format (the one
  generator, a held-out seed stream), so it is the in-distribution accuracy; longer windows are the documented
  length-extrapolation departure, and each row states how its query–key distances are spread (median, 90th
  percentile, and the share at or beyond the training length);
- ``mqar_by_distance``: by query–key distance bin at each length (``mqar.distance_bins``), so recall at distances
  no training window had is read apart from the length of the window around it;
- ``mqar_by_query``: by the query's rank in its window (first query, second …), where answering later queries by
  elimination would show;
- ``mqar_windows``: each window's count of right answers, per length (the same windows for every model): what a
  report's cluster bootstrap over windows and seeds resamples;
- ``mqar_by_distance_position``: by query–key distance bin × the answer's position bin, pooled over every evaluated
  length (a causal model's answer at position t reads only the t tokens before it, whatever the window's length).
  Where the block sits at the window's start (``kv_offset: zoology``) distance and position are the same thing and
  only the diagonal fills; with ``kv_offset: random`` the table separates them.

Each length's row also records the accuracy over the answers at positions past the training length only
(``past_train_len_accuracy``; at the training length, over all of its answers): the figure effective length is read
from (``posenc/evaluate/effective.py``), since an answer inside the first L positions is an in-length prediction
whatever the window's length. And the correlation of distance with position over the row's answers.

Beside every row: the chance rate of a uniform guess over the values and both keyless floors (a guess among the
block's values, without and with striking out earlier answers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from posenc.data import mqar
from posenc.evaluate.effective import learned
from posenc.evaluate.stats import wilson


def _counts_row(right: list[bool]) -> dict[str, Any]:
    """Answers, correct, accuracy and its Wilson interval for one cell."""
    correct = int(sum(right))
    low, high = wilson(correct, len(right))
    return {"answers": len(right), "correct": correct, "accuracy": correct / len(right), "low": low, "high": high}


@torch.no_grad()
def score_windows(
    model: nn.Module,
    length: int,
    samples: int,
    rng: np.random.Generator,
    options: Mapping[str, Any],
    batch: int,
    per_window: list[int] | None = None,
) -> list[tuple[int, int, int, bool]]:
    """(position, query index, distance, right) for every answer of ``samples`` fresh windows of ``length``.

    ``per_window``, when given, receives each window's count of right answers in window order (the unit a cluster
    bootstrap resamples: a window's answers share their context).
    """
    device = next(model.parameters()).device
    out = []
    for start in range(0, samples, batch):
        windows = [mqar.mqar_sample(length, rng, **options) for _ in range(min(batch, samples - start))]
        inputs = torch.stack([w.inputs for w in windows])
        targets = torch.stack([w.targets for w in windows])
        right = (model(inputs.to(device)).argmax(dim=-1).cpu() == targets).tolist()
        for window, row in zip(windows, right, strict=True):
            if per_window is not None:
                per_window.append(sum(row[at] for at, _, _ in mqar.answer_geometry(window.inputs, window.targets)))
            out += [
                (at, index, distance, row[at])
                for at, index, distance in mqar.answer_geometry(window.inputs, window.targets)
            ]
    return out


@torch.no_grad()
def evaluate_mqar(
    model: nn.Module,
    lengths: Sequence[int],
    train_len: int,
    samples: int,
    seed: int,
    tokens_per_batch: int = 16384,
    options: Mapping[str, Any] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """{"mqar", "mqar_by_distance", "mqar_by_query": rows} over ``samples`` windows at every length.

    The same windows are drawn at a length for every model (generated from (seed, length) with the options the
    model was trained with).
    """
    options = dict(options or {})
    num_pairs = int(options.get("num_pairs", mqar.NUM_PAIRS))
    blind, eliminating = mqar.keyless_floors(num_pairs)
    floors = {
        "chance_exact": mqar.chance_rate(int(options.get("vocab", mqar.VOCAB))),
        "keyless_exact": blind,
        "keyless_exact_elimination": eliminating,
    }
    bins = mqar.distance_bins(train_len, max(lengths))
    was_training = model.training
    model.eval()
    by_length, by_distance, by_query, pooled, by_window = [], [], [], [], []
    try:
        for length in lengths:
            rng = np.random.default_rng([seed, length, 7])
            right_per_window: list[int] = []
            batch = max(1, tokens_per_batch // length)
            answers = score_windows(model, length, samples, rng, options, batch, right_per_window)
            by_window.append({"length": length, "answers_per_window": num_pairs, "right": right_per_window})
            pooled += answers
            positions = np.array([at for at, _, _, _ in answers])
            distances = np.array([distance for _, _, distance, _ in answers])
            past = [right for at, _, _, right in answers if at >= train_len or length == train_len]
            by_length.append(
                {
                    "task": "mqar",
                    "length": length,
                    "samples": samples,
                    **_counts_row([right for _, _, _, right in answers]),
                    "training_format": length == train_len,
                    "distance_median": float(np.median(distances)),
                    "distance_p90": float(np.percentile(distances, 90)),
                    "beyond_train_len": float(np.mean(distances >= train_len)),
                    "distance_position_correlation": correlation(positions, distances),
                    "past_train_len_answers": len(past),
                    "past_train_len_accuracy": float(np.mean(past)) if past else None,
                    **floors,
                }
            )
            for low, high in bins:
                right = [r for _, _, d, r in answers if low <= d < high]
                if right:
                    cell = {"length": length, "distance_low": low, "distance_high": high}
                    by_distance.append(cell | _counts_row(right))
            for index in range(num_pairs):
                right = [r for _, i, _, r in answers if i == index]
                by_query.append({"length": length, "query": index + 1, **_counts_row(right)})
    finally:
        model.train(was_training)
    return {
        "mqar": by_length,
        "mqar_by_distance": by_distance,
        "mqar_by_query": by_query,
        "mqar_by_distance_position": distance_position_table(pooled, bins),
        "mqar_windows": by_window,
    }


def correlation(positions: np.ndarray, distances: np.ndarray) -> float | None:
    """Pearson's correlation of the answers' positions with their distances; ``None`` where either is constant."""
    if len(positions) < 2 or positions.std() == 0 or distances.std() == 0:
        return None
    return float(np.corrcoef(positions, distances)[0, 1])


def distance_position_table(
    answers: Sequence[tuple[int, int, int, bool]], bins: Sequence[tuple[int, int]]
) -> list[dict[str, Any]]:
    """One row per (distance bin, position bin) that holds answers: counts, accuracy and its Wilson interval.

    ``answers`` are (position, query index, distance, right); position bins are the distance bins, so the two axes
    read alike (bins at and past the training length: what no training window had). A position below the first bin
    (0) falls in it.
    """
    cells: dict[tuple[int, int], list[bool]] = {}
    for at, _, distance, right in answers:
        d_bin = _bin(distance, bins)
        p_bin = _bin(at, bins)
        if d_bin is not None and p_bin is not None:
            cells.setdefault((d_bin, p_bin), []).append(bool(right))
    rows = []
    for (d_bin, p_bin), right in sorted(cells.items()):
        (d_low, d_high), (p_low, p_high) = bins[d_bin], bins[p_bin]
        bounds = {"distance_low": d_low, "distance_high": d_high, "position_low": p_low, "position_high": p_high}
        rows.append(bounds | _counts_row(right))
    return rows


def _bin(value: int, bins: Sequence[tuple[int, int]]) -> int | None:
    """The index of the bin [low, high) holding ``value``; values below the first bin count in it."""
    for index, (low, high) in enumerate(bins):
        if value < high and (value >= low or index == 0):
            return index
    return None


def console_lines(results: Mapping[str, Any]) -> list[str]:
    """The printout of an MQAR evaluation: by length with intervals and floors, then by distance and by query."""
    rows, train_len = results["mqar"], int(results["train_len"])
    first = rows[0]
    verdict = learned(rows, train_len)
    lines = [
        "mqar accuracy by length (95% Wilson interval; 1x = held-out windows of the training format): "
        + ", ".join(
            f"{r['length'] / train_len:g}x {r['accuracy']:.3f} [{r['low']:.3f}, {r['high']:.3f}]" for r in rows
        ),
        f"  floors: uniform guess {first['chance_exact']:.4f}; keyless {first['keyless_exact']:.3f} "
        f"({first['keyless_exact_elimination']:.3f} with elimination); learned (in-length interval above both): "
        + {True: "yes", False: "no", None: "n/a (no in-length row)"}[verdict],
        "  query–key distances: "
        + ", ".join(
            f"{r['length'] / train_len:g}x median {r['distance_median']:g}, {r['beyond_train_len']:.0%} ≥ L"
            + ("" if (rho := r.get("distance_position_correlation")) is None else f", r(position)={rho:.2f}")
            for r in rows
        ),
    ]
    if any(r.get("past_train_len_accuracy") is not None for r in rows[1:]):
        lines.append(
            "  answers at positions past L only (what effective length reads): "
            + ", ".join(
                f"{r['length'] / train_len:g}x "
                + ("—" if r.get("past_train_len_accuracy") is None else f"{r['past_train_len_accuracy']:.3f}")
                + f" ({r.get('past_train_len_answers', 0)})"
                for r in rows
            )
        )
    cells = {(r["length"], r["distance_low"]): r for r in results.get("mqar_by_distance", [])}
    bins = sorted({(r["distance_low"], r["distance_high"]) for r in results.get("mqar_by_distance", [])})
    if bins:
        lines.append("mqar accuracy by query–key distance (answers in brackets):")
        lines.append(f"  {'length':>7} " + " ".join(f"{f'[{low},{high})':>15}" for low, high in bins))
        for row in rows:
            shown = [cells.get((row["length"], low)) for low, _ in bins]
            text = [f"{c['accuracy']:.2f} ({c['answers']})" if c else "" for c in shown]
            lines.append(f"  {row['length']:>7} " + " ".join(f"{t:>15}" for t in text))
    queries = results.get("mqar_by_query", [])
    if queries:
        lines.append("mqar accuracy by query index in the window (1 = first query):")
        for row in rows:
            mine = [q for q in queries if q["length"] == row["length"]]
            lines.append(f"  {row['length']:>7} " + " ".join(f"q{q['query']} {q['accuracy']:.2f}" for q in mine))
    return lines
