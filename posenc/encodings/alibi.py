"""ALiBi (Press et al., 2022, "Train Short, Test Long"): a fixed, per-head linear distance penalty.

score_ij += -m_h · (i - j) for j ≤ i. Slopes follow the paper's rule (its Section 3 and the reference code):
for n heads, n a power of two, m_h = 2^(-8h/n) for h = 1..n; otherwise, with c the largest power of two below
n, the first c slopes come from the c-head rule and every other slope of the 2c-head rule fills the rest.

``biased_heads`` < n applies ALiBi to a subset of heads (the first ones, with the slopes of the rule for that many
heads, so they still span 2^(-8/k) .. 2^(-8)) and leaves the others position-free (slope 0, NoPE heads), the
partial-ALiBi hybrid some long-context models use to keep a few heads free to attend far.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posenc.encodings import register
from posenc.encodings.base import PositionalEncoding, distances
from posenc.encodings.forms import ScoreMod


def alibi_slopes(num_heads: int) -> list[float]:
    """The paper's head slopes: geometric from 2^(-8/n), interpolated for head counts not a power of two."""

    def power_of_two_rule(n: int) -> list[float]:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    if math.log2(num_heads).is_integer():
        return power_of_two_rule(num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    return power_of_two_rule(closest) + power_of_two_rule(2 * closest)[0::2][: num_heads - closest]


@register
class ALiBi(PositionalEncoding):
    """Attention with Linear Biases: no parameters, extrapolates by construction."""

    name = "alibi"
    adds_bias = True

    def __init__(self, num_heads: int, head_dim: int, biased_heads: int | None = None) -> None:
        super().__init__(num_heads, head_dim)
        biased = num_heads if biased_heads is None else biased_heads
        if not 1 <= biased <= num_heads:
            raise ValueError(f"alibi biased_heads must be in 1..{num_heads} (the heads), got {biased_heads}")
        self.biased_heads = biased
        slopes = alibi_slopes(biased) + [0.0] * (num_heads - biased)
        self.register_buffer("slopes", torch.tensor(slopes, dtype=torch.float32), persistent=False)

    def bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        # (H, 1, 1) * (Lq, Lk) -> (H, Lq, Lk); fp32 so that distances past 256 stay exact under bf16.
        return -self.slopes[:, None, None] * distances(q_pos, k_pos)

    def distance_bias(self, num_distances: int) -> Tensor:
        d = torch.arange(num_distances, device=self.slopes.device, dtype=torch.float32)
        return -self.slopes[:, None] * d

    def score_mod(self, detached: bool = False, num_distances: int | None = None) -> ScoreMod:
        slopes = self.slopes  # a buffer: constant either way

        def alibi(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return score - slopes[h] * (q_idx - kv_idx).to(torch.float32)

        return alibi

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, biased_heads={self.biased_heads}"
