"""The reference backend: the textbook formula, dense and in fp32. Obviously correct, O(L²) memory."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posenc.attention import register_backend
from posenc.encodings.base import PositionalEncoding


@register_backend("eager")
def eager_attention(
    q: Tensor, k: Tensor, v: Tensor, encoding: PositionalEncoding, q_pos: Tensor, k_pos: Tensor
) -> Tensor:
    scores = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float()) / math.sqrt(q.shape[-1])
    bias = encoding.bias(q_pos, k_pos)  # (H, Lq, Lk), added before the mask and before the softmax
    if bias is not None:
        scores = scores + bias
    if encoding.adds_content_bias:  # (B, H, Lq, Lk): reads q and k, so it is not a position table
        scores = scores + encoding.content_bias(q, k, q_pos, k_pos)
    causal = k_pos[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", scores.softmax(dim=-1), v.float()).to(q.dtype)
