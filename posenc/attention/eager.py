"""The reference backend: the textbook formula, dense and in fp32 (autocast off). Obviously correct, O(L²) memory.

``attention_weights`` is the same formula stopped at the probabilities: what attention maps and attention
statistics read, so they show exactly what the reference computes. For a scheme that supplies its own attention
(``supplies_attention``) they are the scheme's own dense weights (``PositionalEncoding.attention_weights``).

With a sink (``posenc/attention/sink.py``) the softmax runs over the sink's columns in front of the keys: one logit
column, or the sink tokens as keys at their position, which every word of the scheme reads as it reads the others.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posenc.attention import register_backend
from posenc.attention.sink import SinkColumns
from posenc.attention.window import refuse_window, visible
from posenc.encodings.base import PositionalEncoding
from posenc.runtime import full_precision


@full_precision
def attention_weights(
    q: Tensor,
    k: Tensor,
    encoding: PositionalEncoding,
    q_pos: Tensor,
    k_pos: Tensor,
    features: Tensor | None = None,
    sink: SinkColumns | None = None,
    window: int | None = None,
) -> Tensor:
    """fp32 causal attention probabilities (B, H, Lq, Lk) of rotated q (B, H, Lq, D) over rotated k (B, H, Lk, D).

    ``features`` (B, Lk, F) are the keys' features of a scheme that reads the layer's input. A scheme that supplies
    its own attention gives its own dense weights. With a ``sink``, (B, H, Lq, C + Lk): its C columns first.
    A ``window`` (a local layer, ``posenc/attention/window.py``) masks the keys past it like future ones.
    """
    if encoding.supplies_attention:
        refuse_window("eager", window, f"a global layer for {encoding.label}, whose attention is its own")
        if sink is not None:
            raise ValueError(f"{encoding.label} supplies its own attention, with no softmax row for a sink to join")
        return encoding.attention_weights(q, k, q_pos, k_pos, features)
    pinned = 0
    if sink is not None and sink.keys is not None:
        k, _, k_pos, features = sink.prepend(k, None, k_pos, features)
        pinned = sink.width
    scores = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float()) / math.sqrt(q.shape[-1])
    bias = encoding.bias(q_pos, k_pos)  # (H, Lq, Lk), added before the mask and before the softmax
    if bias is not None:
        scores = scores + bias
    if encoding.adds_content_bias:  # (B, H, Lq, Lk): reads q and k, so it is not a position table
        scores = scores + encoding.content_bias(q, k, q_pos, k_pos, features=features)
    scores = scores.masked_fill(~visible(q_pos, k_pos, window, pinned), float("-inf"))
    if sink is not None and sink.logit is not None:
        scores = torch.cat((sink.scores(q, encoding, q_pos), scores), dim=-1)
    return scores.softmax(dim=-1)


@register_backend("eager", query_suffix=True)
@full_precision
def eager_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    encoding: PositionalEncoding,
    q_pos: Tensor,
    k_pos: Tensor,
    features: Tensor | None = None,
    sink: SinkColumns | None = None,
    window: int | None = None,
) -> Tensor:
    weights = attention_weights(q, k, encoding, q_pos, k_pos, features, sink, window)  # (B, H, Lq, [C +] Lk)
    if encoding.supplies_attention:  # the scheme says what its weights give (a remainder off the values, a norm)
        return encoding.weights_output(weights, v.float()).to(q.dtype)
    if sink is not None:  # a logit's column has no value; the tokens' values come first
        weights, v = (weights[..., 1:], v) if sink.values is None else (weights, torch.cat((sink.values, v), dim=-2))
    return torch.einsum("bhqk,bhkd->bhqd", weights, v.float()).to(q.dtype)
