"""RoPE (Su et al., 2021, "RoFormer"): rotate query/key channel pairs by an angle proportional to position.

q_m · k_n then depends on m - n only (the paper's Eq. 16). Pairs are (x_i, x_{i + r/2}) over the first ``r``
channels (the GPT-NeoX / Llama "rotate half" layout); θ_i = base^(-2i/r). ``rotary_fraction`` < 1 rotates only
the first r = fraction · head_dim channels and leaves the rest position-free (as GPT-NeoX does with 0.25).
"""

from __future__ import annotations

import torch
from torch import Tensor

from posenc.encodings import register
from posenc.encodings.base import PositionalEncoding


def rotary_dims(head_dim: int, fraction: float) -> int:
    """Number of rotated channels: the largest even count within ``fraction`` of the head."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"rotary_fraction must be in (0, 1], got {fraction}")
    dims = int(head_dim * fraction) // 2 * 2
    if dims == 0:
        raise ValueError(f"rotary_fraction={fraction} of head_dim={head_dim} leaves no channel pair to rotate")
    return dims


def rotate_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x_i, x_{i+r/2}) of the last dim by angles given as cos/sin (L, r/2), in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


@register
class RoPE(PositionalEncoding):
    """Rotary position embedding on q and k; no bias."""

    name = "rope"
    rotates = True

    def __init__(self, num_heads: int, head_dim: int, base: float = 10000.0, rotary_fraction: float = 1.0) -> None:
        super().__init__(num_heads, head_dim)
        self.base = float(base)
        self.rotary_dims = rotary_dims(head_dim, rotary_fraction)
        inv_freq = self.base ** (-torch.arange(0, self.rotary_dims, 2, dtype=torch.float64) / self.rotary_dims)
        self.register_buffer("inv_freq", inv_freq.to(torch.float32), persistent=False)

    def angles(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """Cos and sin (L, r/2) of position × frequency, in fp32."""
        theta = pos.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return theta.cos(), theta.sin()

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        return self._rotate(q, q_pos), self._rotate(k, k_pos)

    def _rotate(self, x: Tensor, pos: Tensor) -> Tensor:
        cos, sin = self.angles(pos)
        r = self.rotary_dims
        rotated = rotate_half(x[..., :r], cos, sin).to(x.dtype)
        return rotated if r == x.shape[-1] else torch.cat((rotated, x[..., r:]), dim=-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, base={self.base}, rotary_dims={self.rotary_dims}"
