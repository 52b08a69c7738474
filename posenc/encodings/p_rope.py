"""p-RoPE (Barbero et al., ICLR 2025, "Round and Round We Go! What makes Rotary Positional Encodings useful?").

RoPE whose lowest frequencies are removed: of RoPE's r/2 channel pairs only the highest-frequency fraction p
rotates, θ_i = base^(−2i/r) for i < ⌊p · r/2⌋ and θ_i = 0 after (the paper's p-RoPE, arXiv 2410.06205; p = 1 is
RoPE, p = 0 is NoPE). The still pairs carry no position at all: the paper finds that Gemma uses the lowest
frequencies as semantic channels, which rotation makes unreliable over long distances, and the highest ones for
positional attention patterns. Default p = 0.75.

Everything else is RoPE's (``rope.py``): the rotation, its fp32 arithmetic and the evaluation-time scalings, which
scale the rotating pairs and leave the still ones still. q_m · k_n depends on m − n only, as in RoPE.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posenc.encodings import register
from posenc.encodings.rope import RoPE, rotary_dims


def kept_pairs(fraction: float, pairs: int) -> int:
    """⌊p · r/2⌋: how many of the highest-frequency pairs rotate."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"p-RoPE's fraction p must be in [0, 1] (0 = NoPE, 1 = RoPE), got {fraction}")
    return math.floor(fraction * pairs)


class TruncatedRoPE(RoPE):
    """RoPE in which only the first ``rotating_pairs`` pairs (the highest frequencies) rotate; θ_i = 0 after.

    Subclasses set ``rotating_pairs`` before RoPE's constructor runs, since it builds θ through
    ``adjust_frequencies``.
    """

    rotating_pairs: int

    def adjust_frequencies(self, theta: Tensor) -> Tensor:
        return torch.cat((theta[: self.rotating_pairs], theta.new_zeros(theta.shape[0] - self.rotating_pairs)))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rotating_pairs={self.rotating_pairs}"


@register
class PRoPE(TruncatedRoPE):
    """p-RoPE: RoPE's highest-frequency fraction ``p`` of channel pairs rotate, the rest carry no position."""

    name = "p_rope"

    def __init__(
        self, num_heads: int, head_dim: int, p: float = 0.75, base: float = 10000.0, rotary_fraction: float = 1.0
    ) -> None:
        self.p = float(p)
        self.rotating_pairs = kept_pairs(self.p, rotary_dims(head_dim, rotary_fraction) // 2)
        super().__init__(num_heads, head_dim, base=base, rotary_fraction=rotary_fraction)
