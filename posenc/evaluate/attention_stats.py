"""Attention statistics by length: where each head attends, and how that changes past the training length.

Per layer and head, at each evaluated length, over every query of some windows of that length:

- **distance**: mean attended distance Σ_j p_ij · (i − j), in tokens (how far back the head looks);
- **entropy**: attention entropy −Σ_j p_ij log p_ij, in nats (log of how many keys it spreads over);
- **sink**: sink mass p_i0, the probability on the window's first token (attention collapsing onto it);
- **explicit**: the probability on the model's own sink (``model.sink``: its logit column or its sink tokens), 0
  without one. With a sink, distance and the first token's mass read the window's keys, and entropy the whole row.

The first query of a window is left out: it can only attend to itself, so its values say nothing. Probabilities
come from the scheme's dense reference (``posenc.probe``: rotate and bias through the contract), one chunk of
queries at a time, so no more than ``max_scores`` scores exist at once whatever the length. For a scheme that
supplies its own attention they are its own dense weights (``supplies_attention``: PaTH's softmax over its products,
stick-breaking's A_ij with the stick no key took on the query's own token), a distribution over the same keys.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from posenc.attention.eager import attention_weights
from posenc.attention.sink import SinkColumns
from posenc.data.retrieval import RETRIEVAL_TASKS, evaluation_options, task_dataset
from posenc.encodings.base import PositionalEncoding
from posenc.evaluate.plots import plot_heatmap_grid, plot_lines
from posenc.probe import visit_layers

STATS = ("distance", "entropy", "sink", "explicit")
# What a record written before a statistic existed held: no model had a sink of its own then.
ABSENT = {"explicit": 0.0}
MAX_SCORES = 1 << 22  # scores held at once (B × H × rows × keys): 16 MiB of fp32


def layer_sums(
    q: Tensor,
    k: Tensor,
    encoding: PositionalEncoding,
    pos: Tensor,
    max_scores: int,
    features: Tensor | None = None,
    sink: SinkColumns | None = None,
    window: int | None = None,
) -> dict[str, Tensor]:
    """Per head (H,): the statistics summed over queries 1..L-1 of every window, and ``queries`` counted.

    ``features`` (B, L, F) are the keys' features of a scheme that reads the layer's input; ``sink`` the layer's sink;
    ``window`` a local layer's, whose rows hold only its keys (a distance never reaches W, the first token's mass is 0
    past it).
    """
    batch, heads, length, _ = q.shape
    rows = max(1, max_scores // (batch * heads * length))
    sums = {name: torch.zeros(heads, dtype=torch.float64, device=q.device) for name in STATS}
    for start in range(1, length, rows):
        end = min(start + rows, length)
        keys = slice(0, end)  # keys after the chunk's last query are masked for all of its queries: leave them out
        seen = None if features is None else features[:, keys]  # the features of the keys it sees
        row = attention_weights(
            q[:, :, start:end], k[:, :, keys], encoding, pos[start:end], pos[keys], seen, sink, window
        )
        width = 0 if sink is None else sink.width
        probs = row[..., width:]  # the window's keys
        distance = (pos[start:end, None] - pos[None, keys]).clamp(min=0).float()  # (r, K)
        sums["distance"] += (probs * distance).sum(dim=(0, 2, 3)).double()
        sums["entropy"] += torch.special.entr(row).sum(dim=(0, 2, 3)).double()
        sums["sink"] += probs[..., 0].sum(dim=(0, 2)).double()
        sums["explicit"] += row[..., :width].sum(dim=(0, 2, 3)).double()
    sums["queries"] = torch.full((heads,), batch * (length - 1), dtype=torch.float64)
    return sums


@torch.no_grad()
def attention_statistics(
    model: nn.Module, windows: Tensor, tokens_per_batch: int = 16384, max_scores: int = MAX_SCORES
) -> list[dict[str, Any]]:
    """Rows ``{layer, head, distance, entropy, sink, queries}`` of a ``Decoder`` over ``windows`` (N, L)."""
    length = windows.shape[1]
    if length < 2:
        raise ValueError(f"attention statistics need windows of at least 2 tokens, got {length}")
    device = next(model.parameters()).device
    totals: dict[int, dict[str, Tensor]] = {}

    def accumulate(
        layer: int,
        q: Tensor,
        k: Tensor,
        encoding: PositionalEncoding,
        pos: Tensor,
        features: Tensor | None,
        sink: SinkColumns | None,
        window: int | None,
    ) -> None:
        sums = layer_sums(q, k, encoding, pos, max_scores, features, sink, window)
        sums = {name: value.cpu() for name, value in sums.items()}
        totals[layer] = {name: totals[layer][name] + sums[name] for name in sums} if layer in totals else sums

    was_training = model.training
    model.eval()
    try:
        per_batch = max(1, tokens_per_batch // length)
        for start in range(0, windows.shape[0], per_batch):
            visit_layers(model, windows[start : start + per_batch].to(device), accumulate)
    finally:
        model.train(was_training)
    rows = []
    for layer, sums in sorted(totals.items()):
        for head in range(len(sums["queries"])):
            count = float(sums["queries"][head])
            stats = {name: float(sums[name][head]) / count for name in STATS}
            rows.append({"layer": layer, "head": head, **stats, "queries": int(count)})
    return rows


def attention_stats_by_length(
    model: nn.Module,
    lengths: Sequence[int],
    windows_for: Callable[[int], Tensor],
    train_len: int,
    tokens_per_batch: int = 16384,
) -> list[dict[str, Any]]:
    """Statistics at every length (``windows_for(length)`` gives the (N, length) inputs), one row per layer × head."""
    rows = []
    for length in lengths:
        for row in attention_statistics(model, windows_for(length), tokens_per_batch):
            rows.append({"length": length, "multiple": length / train_len, **row})
    return rows


def mean_by_length(rows: list[dict[str, Any]], stat: str, layer: int | None = None) -> tuple[list[int], list[float]]:
    """(lengths, the statistic averaged over heads, and over layers unless ``layer`` is given)."""
    lengths = sorted({row["length"] for row in rows})
    means = []
    for length in lengths:
        values = [
            r[stat] if stat not in ABSENT else r.get(stat, ABSENT[stat])
            for r in rows
            if r["length"] == length and (layer is None or r["layer"] == layer)
        ]
        means.append(sum(values) / len(values))
    return lengths, means


def stats_windows(
    stream: np.ndarray | None,
    task: str | None,
    tokens: int,
    seed: int,
    task_options: Mapping[str, Any] | None = None,
) -> Callable[[int], Tensor]:
    """Inputs for the statistics at a length: about ``tokens`` tokens of held-out text, or of the trained task.

    Task windows are generated with the training options, as the task's evaluation generates them.
    """

    def windows(length: int) -> Tensor:
        count = max(1, tokens // length)
        if stream is not None:
            count = max(1, min(count, (len(stream) - 1) // length))
            return torch.from_numpy(np.asarray(stream[: count * length]).astype(np.int64)).view(count, length)
        if task is None:
            raise ValueError("attention statistics need held-out text or a synthetic task to read windows from")
        options = evaluation_options(task_options) if task in RETRIEVAL_TASKS else None
        dataset = task_dataset(task, length, count, seed, options=options)
        return torch.stack([dataset[index][0] for index in range(count)])

    return windows


def attention_summary(rows: list[dict[str, Any]]) -> dict[tuple[str, int], float]:
    """{(statistic, length): mean over layers and heads}: the flat numbers summaries and W&B compare."""
    out = {}
    for stat in STATS:
        for length, value in zip(*mean_by_length(rows, stat), strict=True):
            out[(stat, length)] = value
    return out


def attention_plots(rows: list[dict[str, Any]], label: str, train_len: int, out_dir: Path) -> list[Path]:
    """Heatmaps layer × head per length (one row of panels per statistic); sink mass and distance vs length."""
    lengths = sorted({row["length"] for row in rows})
    layers = sorted({row["layer"] for row in rows})
    heads = sorted({row["head"] for row in rows})
    panels = []
    for stat in STATS:
        stat_panels = []
        for length in lengths:
            grid = np.zeros((len(layers), len(heads)))
            for row in rows:
                if row["length"] == length:
                    grid[layers.index(row["layer"]), heads.index(row["head"])] = row[stat]
            stat_panels.append(grid)
        panels.append(stat_panels)
    images = [
        plot_heatmap_grid(
            panels,
            list(STATS),
            [f"L={length}" for length in lengths],
            out_dir / "attention_heatmaps.png",
            f"{label}: attention statistics per layer × head (trained at L={train_len})",
            "head",
            "layer",
        )
    ]
    for stat, ylabel in (("sink", "sink mass (first token)"), ("distance", "mean attended distance (tokens)")):
        series = {f"layer {layer}": (*mean_by_length(rows, stat, layer), None) for layer in layers}
        series["mean"] = (*mean_by_length(rows, stat), None)
        images.append(
            plot_lines(
                series,
                out_dir / f"attention_{stat}_vs_length.png",
                f"{label}: {ylabel} vs length (mean over heads)",
                "evaluation length (tokens)",
                ylabel,
                train_len=train_len,
                logy=stat == "distance",
            )
        )
    return images
