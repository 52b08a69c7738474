"""What a scheme's bias became: the first layer's bias by query–key distance, per head, asked through the contract.

A learned bias (T5's table, KERPLE's r1/r2, FIRE's function, data-dependent ALiBi's gates) is read beside the
fixed ones (ALiBi's slopes, Sandwich) the same way, never by the scheme's name:

- a distance-only bias gives its table, ``distance_bias(num_distances)``;
- any other bias gives the row of one query over keys behind it, ``bias(q_pos, k_pos)``: the query sits at the
  last position of the longest evaluated window, so FIRE's normalisation by the query's position is that of the
  longest window;
- a content bias is read at zero content (q = k = 0, and a zero layer input for a scheme that reads it),
  ``content_bias``: for data-dependent ALiBi and FoX that is the gates' learned constant decay, without their
  dependence on the key or the token.

Schemes with no bias (RoPE, NoPE, absolute schemes) have no curve. The distances are every one below 16, then
log-spaced up to the longest window, which keeps ``results.json`` small at any length.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from posenc.encodings.base import PositionalEncoding

EXACT_DISTANCES, LOG_POINTS = 16, 96


def sampled_distances(max_distance: int) -> list[int]:
    """Every distance below ``EXACT_DISTANCES``, then ``LOG_POINTS`` log-spaced ones up to ``max_distance``."""
    exact = list(range(min(EXACT_DISTANCES, max_distance + 1)))
    if max_distance < EXACT_DISTANCES:
        return exact
    spaced = np.geomspace(EXACT_DISTANCES, max_distance, LOG_POINTS).round().astype(int).tolist()
    return sorted(set(exact) | set(spaced) | {max_distance})


@torch.no_grad()
def bias_by_distance(scheme: PositionalEncoding, max_distance: int) -> dict[str, Any] | None:
    """{distances, query_position, source, by_head: [[bias per distance] per head]} in fp32; ``None`` without a bias."""
    if not (scheme.adds_bias or scheme.adds_content_bias):
        return None
    device = next((t.device for t in [*scheme.parameters(), *scheme.buffers()]), torch.device("cpu"))
    distances = torch.tensor(sampled_distances(max_distance), device=device)
    query = max_distance
    bias = torch.zeros(scheme.num_heads, len(distances), device=device)
    sources = []
    if scheme.adds_bias and scheme.distance_only:
        bias += scheme.distance_bias(max_distance + 1).float()[:, distances]
        sources.append("distance_bias")
    elif scheme.adds_bias:
        k_pos = query - distances
        bias += scheme.bias(torch.tensor([query], device=device), k_pos).float()[:, 0]
        sources.append("bias")
    if scheme.adds_content_bias:
        positions = torch.arange(query + 1, device=device)
        q = torch.zeros(1, scheme.num_heads, 1, scheme.head_dim, device=device)
        k = torch.zeros(1, scheme.num_heads, query + 1, scheme.head_dim, device=device)
        features = None
        if scheme.reads_layer_input:  # FoX's gates at a zero layer input: their learned constant decay
            width = scheme.num_heads * scheme.head_dim  # the layer's input: the model's width
            features = scheme.token_features(torch.zeros(1, query + 1, width, device=device))
        row = scheme.content_bias(q, k, positions[-1:], positions, features=features)  # (1, H, 1, query + 1)
        bias += row.float()[0, :, 0, query - distances]
        sources.append("content_bias at q = k = 0")
    return {
        "distances": distances.tolist(),
        "query_position": query,
        "source": " + ".join(sources),
        "by_head": bias.cpu().tolist(),
    }


def query_rows(length: int) -> list[int]:
    """The query positions a bias function is read at: the last of a window of ``length``, a half and a quarter in.

    A bias that depends on the query's position (FIRE's, past its threshold) differs between them.
    """
    return sorted({length - 1, (length - 1) // 2, (length - 1) // 4})


@torch.no_grad()
def bias_function(scheme: PositionalEncoding, length: int) -> Tensor | None:
    """The positional bias (H, rows, length) a window of ``length`` gives, each row's constant removed; or ``None``.

    Rows are the queries of ``query_rows``, each over every key (the keys behind it: 0 beyond). Softmax ignores a
    constant added to a whole row, so each row is centred over the keys it sees: a parameter that only moves such a
    constant (FIRE's output bias) moves nothing attention sees, and the function does not move either. A content bias
    is read at zero content, as ``bias_by_distance`` reads it. ``None`` for a scheme without a bias.
    """
    if not (scheme.adds_bias or scheme.adds_content_bias):
        return None
    device = next((t.device for t in [*scheme.parameters(), *scheme.buffers()]), torch.device("cpu"))
    rows = torch.tensor(query_rows(length), device=device)
    keys = torch.arange(length, device=device)
    bias = torch.zeros(scheme.num_heads, len(rows), length, device=device)
    if scheme.adds_bias:
        bias += scheme.bias(rows, keys).float()
    if scheme.adds_content_bias:
        q = torch.zeros(1, scheme.num_heads, len(rows), scheme.head_dim, device=device)
        k = torch.zeros(1, scheme.num_heads, length, scheme.head_dim, device=device)
        features = None
        if scheme.reads_layer_input:
            features = scheme.token_features(torch.zeros(1, length, scheme.num_heads * scheme.head_dim, device=device))
        bias += scheme.content_bias(q, k, rows, keys, features=features).float()[0]
    seen = (keys[None, :] <= rows[:, None]).float()  # (rows, length)
    mean = (bias * seen).sum(-1, keepdim=True) / seen.sum(-1, keepdim=True)
    return (bias - mean) * seen  # on the scheme's device: a caller that keeps it moves it


def first_layer_bias(model: nn.Module, max_length: int) -> dict[str, Any] | None:
    """The bias by distance of ``model``'s first attention layer up to ``max_length − 1`` (a ``Decoder``)."""
    return bias_by_distance(model.layer_encodings[0], max_length - 1)
