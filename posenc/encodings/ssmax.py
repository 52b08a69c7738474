"""Scalable-Softmax (Nakanishi, 2025, arXiv 2501.19399, "Scalable-Softmax Is Superior for Attention").

Softmax over n scores gives the largest one a weight that falls towards 0 as n grows ("attention fading"). SSMax
replaces softmax(z) by n^(s z_i) / Σ_j n^(s z_j) = softmax((s · log n) · z) (the paper's definition of SSMax, §3),
n the number of scores in the row, s a learnable scalar per layer and head: the row is sharpened by log n, so a
score that stands out keeps its weight at any length.

Here it is a transform of the queries, q_i → s_h · log n_i · q_i, which scales every score of row i by s_h log n_i
and leaves every attention backend unchanged (flash kernels included). n_i is the number of keys query i sees: the
keys at positions ≤ its own among those the call passes, counted from the positions alone
(``searchsorted(k_pos, q_pos)``), so it is i + 1 in a window of positions 0 … L − 1, the whole cache for a decoded
token, and unchanged by a shift of every position (the scheme is shift invariant). A sliding-window evaluation feeds
each window from position 0, so n counts the window's keys, never the absolute offset in the document.

What is scaled is q · kᵀ: an additive position bias stacked with SSMax (``alibi+ssmax``) is not multiplied by
s log n, since the bias arrives in the backend after the transform. The paper's models add no bias (RoPE); its
SSMax scales the whole score, which for them is q · kᵀ.

s_h starts at 1 / log L_train, so that at the training length the row sees the standard softmax (s log n = 1) and
a model starts as its softmax counterpart at the length it trains at; ``train_length`` comes from ``data.seq_len``
(``conf/encoding/ssmax.yaml``, which stacks SSMax on RoPE as the paper's models do).

``LengthScaling`` is the same transform with no parameter, for models trained without it: q_i → max(1, log n_i /
log L_train) · q_i, i.e. 1 up to the training length and log_{L_train} n beyond (LogN-scaling: Chiang & Cholak,
2022, "Overcoming a Theoretical Limitation of Self-Attention", §5, which scales by log n; and Qwen's "logn"
attention, Bai et al., 2023, the Qwen technical report, normalised by the training length and floored at 1). A model
trained with plain softmax learned its temperatures for n ≤ L_train: a bare log n would sharpen the rows it
already handles (log 64 ≈ 4.2× at L = 64), while log n / log L_train leaves every in-length row exactly as trained
and only counters the fading past it. ``posenc.evaluate eval.attention_scale=log_n`` stacks it on every layer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import Tensor, nn

from posenc.encodings import register
from posenc.encodings.base import PositionalEncoding
from posenc.encodings.forms import LengthScaled


def visible_keys(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """n_i (Lq,) fp32: how many keys sit at positions ≤ ``q_pos[i]`` (``k_pos`` increasing), at least 1."""
    return torch.searchsorted(k_pos, q_pos, right=True).clamp(min=1).to(torch.float32)


def scale_queries(q: Tensor, factor: Tensor) -> Tensor:
    """The queries (B, H, Lq, D) times a per-row factor broadcast to (…, Lq, 1), computed in fp32."""
    return (q.float() * factor[..., None]).to(q.dtype)


@register
class SSMax(PositionalEncoding):
    """Scalable-Softmax as a query transform: every score of row i times s_h · log n_i."""

    name = "ssmax"
    rotates = True
    scales_with_length = True
    length_settings: ClassVar[Mapping[str, LengthScaled]] = {
        "train_length": LengthScaled(1, "SSMax: s starts at 1/log L", minimum=2)
    }

    def __init__(self, num_heads: int, head_dim: int, train_length: int = 1024) -> None:
        super().__init__(num_heads, head_dim)
        if train_length < 2:
            raise ValueError(f"ssmax starts s at 1/log(train_length), which needs train_length ≥ 2; got {train_length}")
        self.train_length = int(train_length)
        self.scale = nn.Parameter(torch.full((num_heads,), 1.0 / math.log(self.train_length)))  # s_h

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        log_n = visible_keys(q_pos, k_pos).log()  # (Lq,)
        return scale_queries(q, self.scale.float()[:, None] * log_n), k  # (H, Lq) per row

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, train_length={self.train_length}"


class LengthScaling(PositionalEncoding):
    """max(1, log n / log L_train) on q: log-n scaling for a model trained without it (evaluation only).

    Not registered: it is not a scheme to train, but what ``eval.attention_scale=log_n`` stacks on each layer.
    """

    name = "log_n"
    rotates = True
    scales_with_length = True

    def __init__(self, num_heads: int, head_dim: int, train_length: int) -> None:
        super().__init__(num_heads, head_dim)
        if train_length < 2:
            raise ValueError(f"log-n scaling divides by log(train_length), which needs ≥ 2; got {train_length}")
        self.train_length = int(train_length)

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        factor = (visible_keys(q_pos, k_pos).log() / math.log(self.train_length)).clamp(min=1.0)
        return scale_queries(q, factor), k

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, train_length={self.train_length}"


class TemperatureTuning(PositionalEncoding):
    """Llama 4's attention temperature on q: 1 + β · log(⌊(i + 1) / F⌋ + 1) at position i (evaluation only).

    Llama 4 scales the queries of its global (NoPE) layers so at position i, with β = 0.1 (``attn_scale``) and F its
    local chunk of 8,192 tokens (``floor_scale``): 1 within the first F positions, then growing with log of how many
    F-long stretches the query has behind it (the form of its reference code, ``attn_temperature_tuning``). Here F is
    the local layers' window, as Llama 4's floor equals its chunk. Not registered: what
    ``eval.attention_scale=llama4`` stacks on each global layer of a layout.
    """

    name = "llama4"
    rotates = True
    shift_invariant = False  # the factor reads the query's position, not a distance
    scales_with_length = True
    BETA = 0.1

    def __init__(self, num_heads: int, head_dim: int, floor: int) -> None:
        super().__init__(num_heads, head_dim)
        if floor < 1:
            raise ValueError(f"the temperature's floor counts positions and must be ≥ 1, got {floor}")
        self.floor = int(floor)

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        stretches = torch.floor((q_pos.to(torch.float32) + 1) / self.floor)
        return scale_queries(q, 1 + self.BETA * torch.log(stretches + 1)), k

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, floor={self.floor}"
