"""GRAPE-M (Zhang et al., ICLR 2026, "Group Representational Position Encoding"), its multiplicative form.

A position n acts on q and k as G(n) = exp(n ω L), a rotation with a skew generator L: relative by construction
(G(m)ᵀ G(n) = G(n − m)) and norm-preserving. RoPE is the case of fixed coordinate planes and a fixed log-uniform
spectrum. This is the authors' non-contextual commuting variant (their ``MSGRAPECommuting``): RoPE's coordinate
planes (pairs (x_i, x_{i+D/2})), each plane's frequency learned, ω_i = exp(ℓ_i / s) with ℓ initialised at
s · log(base^(−2i/D)), so training starts exactly at RoPE. s = 16 is their learning-rate scaling: the frequencies
move 16× slower than a raw log-frequency would. One spectrum for all heads by default (``share_across_heads``), as
in their configs; per head otherwise.

The authors rotate by −nω (y₁ = x₁ cos + x₂ sin); this file rotates by +nω as RoPE does here. Since q and k turn
alike, q_m · k_n only sees the sign of m − n flipped, the same family of models. Their learned non-commuting
planes and the contextual variant are not carried over.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from posenc.encodings import register
from posenc.encodings.base import PositionalEncoding
from posenc.encodings.rope import rotate_half


@register
class GrapeM(PositionalEncoding):
    """Multiplicative GRAPE: RoPE's planes, each plane's frequency learned from RoPE's spectrum."""

    name = "grape_m"
    rotates = True

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        base: float = 10000.0,
        share_across_heads: bool = True,
        log_freq_scale: float = 16.0,
    ) -> None:
        super().__init__(num_heads, head_dim)
        if head_dim % 2:
            raise ValueError(f"grape_m rotates channel pairs but head_dim={head_dim} is odd: choose an even head_dim")
        if log_freq_scale <= 0:
            raise ValueError(
                f"grape_m log_freq_scale divides the log-frequencies and must be > 0, got {log_freq_scale}"
            )
        self.base, self.log_freq_scale = float(base), float(log_freq_scale)
        theta = self.base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        start = (theta.log() * self.log_freq_scale).float()
        self.share_across_heads = share_across_heads
        self.log_freq = nn.Parameter(start if share_across_heads else start.repeat(num_heads, 1))

    def frequencies(self) -> Tensor:
        """ω (H or 1, D/2) fp32: exp(ℓ / s), positive whatever ℓ becomes."""
        omega = torch.exp(self.log_freq.float() / self.log_freq_scale)
        return omega[None, :] if self.share_across_heads else omega

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        omega = self.frequencies()
        return self._turn(q, q_pos, omega), self._turn(k, k_pos, omega)

    def _turn(self, x: Tensor, pos: Tensor, omega: Tensor) -> Tensor:
        if x.shape[-1] != self.head_dim:
            raise ValueError(
                f"grape_m rotates heads of {self.head_dim} channels but got {x.shape[-1]}: a scheme before it in the "
                "stack changed the head width (pope); put that scheme last"
            )
        angle = pos.to(torch.float32)[None, :, None] * omega[:, None, :]  # (H or 1, L, D/2)
        return rotate_half(x, angle.cos(), angle.sin()).to(x.dtype)

    def learned_settings(self) -> dict[str, float]:
        """The slowest wavelength the spectrum trained to, in positions: where RoPE's was 2π · base^((D−2)/D)."""
        return {"longest_wavelength": float(2 * math.pi / self.frequencies().min())}

    def extra_repr(self) -> str:
        share = "shared" if self.share_across_heads else "per head"
        return f"{super().extra_repr()}, base={self.base}, {share} spectrum, log_freq_scale={self.log_freq_scale:g}"
