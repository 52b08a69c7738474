"""FoPE (Hua et al., 2025, arXiv 2412.17739): RoPE's waves above a floor frequency, mixed per channel pair.

"Fourier Position Embedding: Enhancing Attention's Periodic Extension for Length Generalization".

The paper reads RoPE as a set of single-frequency waves and finds two things that break their periodic extension
past the training length L: the layers mix frequencies (spectral leakage), and a frequency whose wavelength exceeds
L never completes a turn in training, so its phases past L were never seen. FoPE answers both at once:

- **The floor**: every frequency θ_i = base^(−2i/r) below 2π/L (a wavelength longer than the training length) is
  clipped to zero and dropped; the M frequencies at or above it remain (at r = 32, base 10,000, L = 64: M = 5, the
  same cut as HoPE's).
- **A Fourier series per channel pair**: pair j of head h takes, instead of one wave, a mix of all M waves,
  ``c_hj(t) = Σ_i cos(t θ_i) C_hij / Σ_i C_hij`` and ``s_hj(t) = Σ_i sin(t θ_i) S_hij / Σ_i S_hij``, and rotates
  (x_j, x_{j+D/2}) by them as RoPE rotates by (cos, sin): ``(x_j c − x_{j+D/2} s, x_{j+D/2} c + x_j s)``.
  C and S are (H, M, P) with P = min(M, D/4) position-carrying pairs; the other D/2 − P pairs take c = s = 1, a fixed
  map of q and k alike that carries no position (it doubles those channels' share of q · k).

This follows the authors' code (the OLMo-based ``FourierEmbedding``: frequencies below the floor removed,
coefficients per head, each column divided by its sum, the padded pairs set to 1, initialised as a step identity,
spread so that every pair starts with a wave (``step_identity``), plus Xavier-normal noise of gain σ = 0.3). Their
code has a switch for training the coefficients; here they train by default (``learnable: false`` fixes them at
their initialisation). q_m · k_n is no longer a function of m − n alone once the coefficients mix frequencies, so
FoPE is a transform of q and k at their own positions, applied before any backend's kernel (cached decoding keeps
keys untransformed and transforms them at their own positions with each step's queries, as for RoPE).

``train_length`` sets the floor; it follows the run's training length (the floor is defined by it).
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
from posenc.encodings.rope import rotate_half


def floored_frequencies(base: float, head_dim: int, train_length: int) -> Tensor:
    """The frequencies θ_i = base^(−2i/D) at or above the floor 2π/L, float64, highest first."""
    if head_dim < 4 or head_dim % 2:
        raise ValueError(
            f"fope mixes channel pairs over a quarter of the head: head_dim must be even and ≥ 4, got {head_dim}"
        )
    if train_length < 1:
        raise ValueError(f"fope needs the training length (train_length ≥ 1), got {train_length}")
    theta = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    kept = theta[theta >= 2 * math.pi / train_length]
    if kept.numel() == 0:
        raise ValueError(
            f"fope keeps the frequencies that turn at least once in the training length, and at train_length="
            f"{train_length} none does (the highest, 1 radian a position, needs 7 positions): train longer windows"
        )
    return kept


def step_identity(heads: int, inputs: int, outputs: int) -> Tensor:
    """(H, M, P) zeros with a 1 at (⌊i·M/P⌋, i) for each output i: output i starts as that one wave alone.

    The authors' code puts output i at wave i·⌈M/P⌉ and skips it when that is past M: with M = 9 waves and P = 8
    outputs (D = 32 at L = 1,024) outputs 5–7 start as noise alone, and dividing by their columns' sums, near zero,
    blows their waves up. ⌊i·M/P⌋ is the same wherever P divides M and gives every output a wave everywhere.
    """
    eye = torch.zeros(heads, inputs, outputs)
    for i in range(outputs):
        eye[:, i * inputs // outputs, i] = 1.0
    return eye


@register
class FoPE(PositionalEncoding):
    """Fourier position embedding: each channel pair rotated by a learned mix of the waves that turn within L."""

    name = "fope"
    rotates = True
    shift_invariant = False  # the mixed waves are not a rotation: q_m · k_n depends on m and n, not only m − n
    length_settings: ClassVar[Mapping[str, LengthScaled]] = {
        "train_length": LengthScaled(1, "FoPE: the floor frequency 2π/L of the training length")
    }

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        train_length: int = 1024,
        base: float = 10000.0,
        init_gain: float = 0.3,
        learnable: bool = True,
    ) -> None:
        super().__init__(num_heads, head_dim)
        if init_gain < 0:
            raise ValueError(
                f"fope init_gain is the spread of the coefficients' noise and must be ≥ 0, got {init_gain}"
            )
        self.train_length = int(train_length)
        self.base = float(base)
        theta = floored_frequencies(self.base, head_dim, self.train_length)
        self.register_buffer("theta", theta.to(torch.float32), persistent=False)
        inputs = theta.numel()
        outputs = min(inputs, head_dim // 4)
        # Xavier-normal over the (H, M, P) tensor as torch counts its fans: fan_in M·P, fan_out H·P.
        std = init_gain * math.sqrt(2.0 / (outputs * (inputs + num_heads)))
        eye = step_identity(num_heads, inputs, outputs)
        self.cos_coef = nn.Parameter(eye + std * torch.randn(num_heads, inputs, outputs), requires_grad=learnable)
        self.sin_coef = nn.Parameter(eye + std * torch.randn(num_heads, inputs, outputs), requires_grad=learnable)

    def waves(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """(c, s), each (H, L, D/2) fp32: every pair's mixed cosine and sine at ``pos``; the unmixed pairs at 1."""
        phase = pos.to(torch.float32)[:, None] * self.theta.float()[None, :]
        cos_coef, sin_coef = self.cos_coef.float(), self.sin_coef.float()
        c = torch.einsum("lm,hmp->hlp", phase.cos(), cos_coef / cos_coef.sum(dim=1, keepdim=True))
        s = torch.einsum("lm,hmp->hlp", phase.sin(), sin_coef / sin_coef.sum(dim=1, keepdim=True))
        pad = self.head_dim // 2 - c.shape[-1]
        return nn.functional.pad(c, (0, pad), value=1.0), nn.functional.pad(s, (0, pad), value=1.0)

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        return self._transform(q, q_pos), self._transform(k, k_pos)

    def _transform(self, x: Tensor, pos: Tensor) -> Tensor:
        if x.shape[-1] != self.head_dim:
            raise ValueError(
                f"fope mixes heads of {self.head_dim} channels but got {x.shape[-1]}: a scheme before it in the stack "
                "changed the head width (pope); put that scheme last"
            )
        c, s = self.waves(pos)
        return rotate_half(x, c, s).to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, train_length={self.train_length}, base={self.base}, "
            f"frequencies={self.theta.numel()}, mixed_pairs={self.cos_coef.shape[-1]}"
        )
