"""HoPE (Chen et al., 2024, arXiv 2410.21216; ACL 2025): RoPE without the low frequencies.

"HoPE: A Novel Positional Encoding Without Long-Term Decay for Enhanced Context Awareness and Extrapolation".

RoPE keeping only its high frequencies: a channel pair whose wavelength 2π/θ_i exceeds the training length L never
completes a turn during training, and the paper finds those low-frequency ("activated") components are what form
the U-shaped attention and limit extrapolation, so HoPE replaces them by position-independent ones. The paper's
cut: pair i keeps its θ_i = base^(−2i/r) when θ_i ≥ 2π/L, i.e. its wavelength 2π/θ_i ≤ L (at least one full
period inside the training length), and has θ_i = 0 otherwise. With r = 32, base 10,000 and L = 64 that keeps
pairs 0..4 (wavelengths 6.3 .. 62.8) and stills the other 11.

``train_length`` is the model's training length (``conf/encoding/hope.yaml`` takes it from ``data.seq_len``); the
cut is fixed when the scheme is built, so an evaluation at other lengths, or with a context scaling, keeps the
trained pairs rotating and the still ones still. The rotation itself is RoPE's (``rope.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar

import torch

from posenc.encodings import register
from posenc.encodings.forms import LengthScaled
from posenc.encodings.p_rope import TruncatedRoPE
from posenc.encodings.rope import rotary_dims


def high_frequency_pairs(base: float, dims: int, train_length: int) -> int:
    """How many pairs complete a full period within ``train_length`` positions: 2π/θ_i ≤ L, θ_i = base^(−2i/r)."""
    if train_length < 1:
        raise ValueError(f"hope needs the training length (train_length ≥ 1), got {train_length}")
    theta = base ** (-torch.arange(0, dims, 2, dtype=torch.float64) / dims)
    return int((2 * math.pi / theta <= train_length).sum())


@register
class HoPE(TruncatedRoPE):
    """HoPE: RoPE's pairs with a wavelength beyond the training length carry no position."""

    name = "hope"
    length_settings: ClassVar[Mapping[str, LengthScaled]] = {
        "train_length": LengthScaled(1, "HoPE: the training length")
    }

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        train_length: int = 1024,
        base: float = 10000.0,
        rotary_fraction: float = 1.0,
    ) -> None:
        self.train_length = int(train_length)
        dims = rotary_dims(head_dim, rotary_fraction)
        self.rotating_pairs = high_frequency_pairs(float(base), dims, self.train_length)
        super().__init__(num_heads, head_dim, base=base, rotary_fraction=rotary_fraction)
