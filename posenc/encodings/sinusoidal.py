"""Sinusoidal absolute embeddings (Vaswani et al., 2017, Section 3.5), added once to the token embeddings.

PE(p, 2i) = sin(p / 10000^(2i/dim)), PE(p, 2i+1) = cos(p / 10000^(2i/dim)). Vaswani scales the token
embeddings by √dim, which makes them unit-variance next to the unit-amplitude sinusoids; our token embeddings
are initialised with std 0.02, so the sinusoids are scaled by ``scale`` = 0.02 to keep that same ratio.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posenc.encodings import register
from posenc.encodings.base import PositionalEncoding


def sinusoids(pos: Tensor, dim: int, base: float = 10000.0) -> Tensor:
    """(L, dim) fp32 sinusoidal table for positions ``pos``, sin and cos interleaved."""
    inv_freq = torch.exp(-math.log(base) * torch.arange(0, dim, 2, device=pos.device, dtype=torch.float32) / dim)
    angle = pos.to(torch.float32)[:, None] * inv_freq[None, :]
    return torch.stack((angle.sin(), angle.cos()), dim=-1).flatten(-2)[:, :dim]


@register
class Sinusoidal(PositionalEncoding):
    """Fixed absolute embedding; defined at every position, known not to extrapolate."""

    name = "sinusoidal"
    absolute = True

    def __init__(self, num_heads: int, head_dim: int, base: float = 10000.0, scale: float = 0.02) -> None:
        super().__init__(num_heads, head_dim)
        self.base = float(base)
        self.scale = float(scale)

    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        return x + (self.scale * sinusoids(pos, x.shape[-1], self.base)).to(x.dtype)
