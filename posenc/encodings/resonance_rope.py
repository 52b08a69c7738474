"""Resonance RoPE (Wang et al., 2024, arXiv 2403.00071; Findings of ACL 2024): RoPE with integer wavelengths.

"Resonance RoPE: Improving Context Length Generalization of Large Language Models".

RoPE with every wavelength rounded to a whole number of positions, θ'_i = 2π / round(2π/θ_i) (the paper's
Algorithm 1). A pair then repeats exactly every round(2π/θ_i) positions, so the angles a pair shows past the
training length are angles it has already shown during training (for every pair whose rounded wavelength fits in the
training length), which removes the interpolation gap the paper measures on those pairs.

Composition with the evaluation-time scalings (``eval.rope_scaling``): the scaling comes first and the rounding
applies to the scaled wavelengths, as the authors' Resonance YaRN does (their code rounds the YaRN frequencies, in
``ResonanceYaRNScaledRotaryEmbedding``); YaRN's temperature is unchanged. Everything else is RoPE's (``rope.py``).
"""

from __future__ import annotations

import math

from torch import Tensor

from posenc.encodings import register
from posenc.encodings.rope import RoPE


def resonance_frequencies(theta: Tensor) -> Tensor:
    """θ'_i = 2π / round(2π/θ_i) (Algorithm 1); a pair with θ_i = 0 stays still."""
    wavelengths = (2 * math.pi / theta).round()
    return (2 * math.pi / wavelengths).nan_to_num(0.0, posinf=0.0)


@register
class ResonanceRoPE(RoPE):
    """Resonance RoPE: RoPE with integer wavelengths."""

    name = "resonance_rope"

    def adjust_frequencies(self, theta: Tensor) -> Tensor:
        return resonance_frequencies(theta)
