"""xPos (Sun et al., 2023, "A Length-Extrapolatable Transformer"): RoPE with an exponential decay per channel.

Queries are rotated like RoPE and scaled by ζ_i^(n/γ), keys by ζ_i^(-m/γ), so q_n · k_m carries
ζ_i^((n-m)/γ): a per-channel decay with distance (the paper's Eq. 8–9), with
ζ_i = (2i/d + 0.4) / 1.4 ∈ [0.29, 1) and scale base γ = 512. As in the reference (torchscale's ``XPOS``),
positions are centred on the middle of the sequence before exponentiation, which leaves every product
unchanged but keeps the factors near 1 in both directions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import Tensor

from posenc.encodings import register
from posenc.encodings.base import PositionalEncoding
from posenc.encodings.forms import LengthScaled
from posenc.encodings.rope import fused_on_gpu, rotate_half


@fused_on_gpu
def xpos_rotate(
    x: Tensor, pos: Tensor, centre: Tensor, inv_freq: Tensor, zeta: Tensor, sign: float, scale_base: float
) -> Tensor:
    """RoPE on ``x`` (B, H, L, D) scaled by ζ^(sign · (pos − centre) / γ) per channel pair, fp32 inside."""
    theta = pos.to(torch.float32)[:, None] * inv_freq[None, :]  # (L, D/2)
    exponent = sign * (pos - centre).to(torch.float32)[:, None] / scale_base
    scale = zeta[None, :] ** exponent  # (L, D/2): the same factor for both channels of a rotated pair
    # Scaling the (L, D/2) tables instead of the rotated (B, H, L, D) tensor: one pass over q or k fewer.
    return rotate_half(x, theta.cos() * scale, theta.sin() * scale).to(x.dtype)


@register
class XPos(PositionalEncoding):
    """Rotary embedding with query up-scaling and key down-scaling."""

    name = "xpos"
    rotates = True
    # The decay ζ^(n / scale_base) was set for training at 1,024: at L = 64 a scale of 512 would barely decay.
    length_settings: ClassVar[Mapping[str, LengthScaled]] = {
        "scale_base": LengthScaled(1 / 2, "xPos: 512 at L = 1,024", integer=False)
    }

    def __init__(self, num_heads: int, head_dim: int, base: float = 10000.0, scale_base: float = 512.0) -> None:
        super().__init__(num_heads, head_dim)
        if head_dim % 2:
            raise ValueError(f"xpos needs an even head_dim, got {head_dim}")
        self.base = float(base)
        self.scale_base = float(scale_base)
        half = torch.arange(0, head_dim, 2, dtype=torch.float64)
        self.register_buffer("inv_freq", (self.base ** (-half / head_dim)).float(), persistent=False)
        self.register_buffer("zeta", ((half + 0.4 * head_dim) / (1.4 * head_dim)).float(), persistent=False)

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        centre = (k_pos[-1] + 2) // 2  # torchscale: positions run from -ceil(L/2)
        # Queries are scaled up (sign +1), keys down (sign -1).
        return (
            xpos_rotate(q, q_pos, centre, self.inv_freq, self.zeta, 1.0, self.scale_base),
            xpos_rotate(k, k_pos, centre, self.inv_freq, self.zeta, -1.0, self.scale_base),
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, base={self.base}, scale_base={self.scale_base}"
