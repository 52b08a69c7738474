"""The reference backend: the textbook formula, dense and in fp32 (autocast off). Obviously correct, O(L²) memory.

``attention_weights`` is the same formula stopped at the probabilities: what attention maps and attention
statistics read, so they show exactly what the reference computes. For a scheme that supplies its own attention
(``supplies_attention``) they are the scheme's own dense weights (``PositionalEncoding.attention_weights``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posenc.attention import register_backend
from posenc.encodings.base import PositionalEncoding
from posenc.runtime import full_precision


@full_precision
def attention_weights(
    q: Tensor, k: Tensor, encoding: PositionalEncoding, q_pos: Tensor, k_pos: Tensor, features: Tensor | None = None
) -> Tensor:
    """fp32 causal attention probabilities (B, H, Lq, Lk) of rotated q (B, H, Lq, D) over rotated k (B, H, Lk, D).

    ``features`` (B, Lk, F) are the keys' features of a scheme that reads the layer's input. A scheme that supplies
    its own attention gives its own dense weights.
    """
    if encoding.supplies_attention:
        return encoding.attention_weights(q, k, q_pos, k_pos, features)
    scores = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float()) / math.sqrt(q.shape[-1])
    bias = encoding.bias(q_pos, k_pos)  # (H, Lq, Lk), added before the mask and before the softmax
    if bias is not None:
        scores = scores + bias
    if encoding.adds_content_bias:  # (B, H, Lq, Lk): reads q and k, so it is not a position table
        scores = scores + encoding.content_bias(q, k, q_pos, k_pos, features=features)
    causal = k_pos[None, :] <= q_pos[:, None]
    return scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)


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
) -> Tensor:
    weights = attention_weights(q, k, encoding, q_pos, k_pos, features)  # (B, H, Lq, Lk)
    if encoding.supplies_attention:  # the scheme says what its weights give (a remainder off the values, a norm)
        return encoding.weights_output(weights, v.float()).to(q.dtype)
    return torch.einsum("bhqk,bhkd->bhqd", weights, v.float()).to(q.dtype)
