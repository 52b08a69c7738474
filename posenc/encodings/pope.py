"""PoPE (Gopalakrishnan, Csordás, Schmidhuber & Mozer, 2025, arXiv 2509.10534): polar coordinate positions.

"Decoupling the 'What' and 'Where' With Polar Coordinate Positional Embeddings".

RoPE rotates a query's 2-D pairs, whose angle already carries content, so content and position mix in the score.
PoPE makes each of the D channels one complex number whose magnitude is the content, μ = softplus(x_c) ≥ 0, and whose
phase is the position alone, so the score of query i and key j is (the paper's §3)

    a_ij = Σ_c softplus(q_ic) · softplus(k_jc) · cos((i − j) θ_c − δ_c),    θ_c = base^(−c/D), c = 0 … D − 1,

D frequencies (one per channel, not D/2 pairs), and δ_c ∈ [−2π, 0] a learnable phase per head and channel, added to
the keys' phase. In real arithmetic this is a q/k transform to twice the head width: q_i → μ_q (cos iθ, sin iθ),
k_j → μ_k (cos(jθ + δ), sin(jθ + δ)), whose dot product is a_ij. It depends on i − j only (shift invariant), and a
cached decoder rotates new queries and cached keys at their absolute positions like any other rotation.

Scale: the paper keeps attention's 1/√D of the head dimension D (the temperature of the a_ij above, as the
x-transformers implementation computes it before widening q). Backends scale by 1/√(width of q) = 1/√(2D), so q
carries √2 here: the temperature is set by the scheme, not by the width its transform happens to have. v keeps
width D; backends whose kernel needs one width for q, k and v refuse the scheme (it declares ``qk_width = 2``).

δ starts at 0 (x-transformers' default) and ``constrain_`` keeps it in [−2π, 0] after each optimiser step, so its
gradient is never cut by a clamp inside the forward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posenc.encodings import register
from posenc.encodings.base import PositionalEncoding

# The backends' 1/√(2D) times √2 is the paper's 1/√D.
TEMPERATURE = math.sqrt(2.0)


def polar(x: Tensor, angles: Tensor, scale: float = 1.0) -> Tensor:
    """softplus(x) (B, H, L, D) as magnitudes at ``angles`` (…, L, D), in Cartesian form (B, H, L, 2D), fp32 inside."""
    magnitude = F.softplus(x.float()) * scale
    return torch.cat((magnitude * angles.cos(), magnitude * angles.sin()), dim=-1).to(x.dtype)


@register
class PoPE(PositionalEncoding):
    """Polar coordinate position embeddings: content in the magnitudes, position in the phases."""

    name = "pope"
    rotates = True
    qk_width = 2

    def __init__(self, num_heads: int, head_dim: int, base: float = 10000.0) -> None:
        super().__init__(num_heads, head_dim)
        self.base = float(base)
        theta = self.base ** (-torch.arange(head_dim, dtype=torch.float64) / head_dim)
        self.register_buffer("theta", theta.to(torch.float32), persistent=False)
        self.phase_bias = nn.Parameter(torch.zeros(num_heads, head_dim))  # δ (H, D)

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        if q.shape[-1] != self.head_dim or k.shape[-1] != self.head_dim:
            raise ValueError(
                f"pope takes heads of {self.head_dim} channels and widens them to {2 * self.head_dim}, but got "
                f"{q.shape[-1]}: another widening scheme came before it in the stack"
            )
        q_angles = q_pos.to(torch.float32)[:, None] * self.theta  # (Lq, D)
        k_angles = k_pos.to(torch.float32)[:, None] * self.theta + self.phase_bias.float()[:, None, :]  # (H, Lk, D)
        return polar(q, q_angles, TEMPERATURE), polar(k, k_angles)

    def constrain_(self) -> None:
        with torch.no_grad():
            self.phase_bias.clamp_(-2 * math.pi, 0.0)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, base={self.base}, qk_width={self.qk_width}"
