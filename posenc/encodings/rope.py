"""RoPE (Su et al., 2021, "RoFormer"): rotate query/key channel pairs by an angle proportional to position.

q_m · k_n then depends on m - n only (the paper's Eq. 16). Pairs are (x_i, x_{i + r/2}) over the first ``r``
channels (the GPT-NeoX / Llama "rotate half" layout); θ_i = base^(-2i/r). ``rotary_fraction`` < 1 rotates only
the first r = fraction · head_dim channels and leaves the rest position-free (as GPT-NeoX does with 0.25);
``rotary_heads`` < H rotates only the first heads and leaves the others NoPE heads.

Evaluation-time context scaling (``set_context_scaling``, used by ``posenc.evaluate eval.rope_scaling=...``)
stretches a model trained at L to s·L positions without retraining, each method changing the frequencies θ_i:

- ``pi``, position interpolation (Chen et al., 2023): θ_i / s, i.e. positions compressed by s.
- ``ntk``, NTK-aware scaling (bloc97, 2023): base' = base · s^(r/(r−2)), high frequencies nearly kept, the lowest
  one interpolated by s.
- ``yarn`` (Peng et al., 2024, Eq. 17–21): with r_i = L / λ_i the number of wavelengths λ_i = 2π/θ_i that fit in
  the training length, and the ramp γ_i = clamp((r_i − α)/(β − α), 0, 1) (α = 1, β = 32), θ'_i = (1 − γ_i) θ_i/s
  + γ_i θ_i: dimensions that turn many times within L keep their frequency, those that do not are interpolated.
  The attention temperature √(1/t) = 0.1 ln s + 1 multiplies q and k (the logits by its square).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

from posenc.encodings import register
from posenc.encodings.base import PositionalEncoding
from posenc.runtime import cuda_path


def rotary_dims(head_dim: int, fraction: float) -> int:
    """Number of rotated channels: the largest even count within ``fraction`` of the head."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"rotary_fraction must be in (0, 1], got {fraction}")
    if fraction == 1.0 and head_dim % 2:
        raise ValueError(
            f"rope rotates channel pairs but head_dim={head_dim} (model.dim / model.heads) is odd: choose an even "
            "head_dim, or a rotary_fraction below 1 to leave channels unrotated on purpose"
        )
    dims = int(head_dim * fraction) // 2 * 2
    if dims == 0:
        raise ValueError(f"rotary_fraction={fraction} of head_dim={head_dim} leaves no channel pair to rotate")
    return dims


def rotate_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x_i, x_{i+r/2}) of the last dim by angles given as cos/sin (L, r/2), in fp32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


RotationFn = TypeVar("RotationFn", bound=Callable[..., Tensor])


def fused_on_gpu(fn: RotationFn) -> RotationFn:
    """Run ``fn(x, ...)`` as one compiled kernel when ``x`` is on CUDA, eagerly elsewhere.

    Eagerly, a rotation is a chain of ~10 elementwise ops, each a full pass over q or k in fp32 (the H100
    benchmark measured RoPE + SDPA at 2.2–3.2× SDPA alone); compiled, it is one pass. Compiled once per process
    with dynamic shapes, so evaluating at new lengths does not recompile; never on CPU, where tests would pay
    the compile time. Inside an already compiled model the plain function is traced into the model's graph.
    """
    compiled: list[Callable[..., Tensor]] = []

    def dispatch(x: Tensor, *args: object) -> Tensor:
        if not cuda_path(x) or torch.compiler.is_compiling():
            return fn(x, *args)
        if not compiled:
            compiled.append(torch.compile(fn, dynamic=True))
        return compiled[0](x, *args)

    return dispatch  # type: ignore[return-value]


@fused_on_gpu
def rope_rotate(x: Tensor, pos: Tensor, inv_freq: Tensor, rotary_dims: int) -> Tensor:
    """RoPE on the first ``rotary_dims`` channels of ``x`` (B, H, L, D) at positions ``pos`` (L,), fp32 inside."""
    theta = pos.to(torch.float32)[:, None] * inv_freq[None, :]
    rotated = rotate_half(x[..., :rotary_dims], theta.cos(), theta.sin()).to(x.dtype)
    return rotated if rotary_dims == x.shape[-1] else torch.cat((rotated, x[..., rotary_dims:]), dim=-1)


SCALINGS = ("pi", "ntk", "yarn")
YARN_ALPHA, YARN_BETA = 1.0, 32.0  # the ramp's ends, in wavelengths per training length (YaRN's defaults)


def scaled_frequencies(
    base: float, dims: int, method: str, factor: float, original_length: int
) -> tuple[torch.Tensor, float]:
    """(θ'_i (dims/2,) float64, q/k multiplier) for a context scaling method (see the module docstring)."""
    exponents = torch.arange(0, dims, 2, dtype=torch.float64) / dims
    theta = base**-exponents
    if method == "pi":
        return theta / factor, 1.0
    if method == "ntk":
        return (base * factor ** (dims / (dims - 2))) ** -exponents, 1.0
    wavelengths_in_context = original_length * theta / (2 * math.pi)  # r_i = L / λ_i
    ramp = ((wavelengths_in_context - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA)).clamp(0.0, 1.0)
    return (1 - ramp) * theta / factor + ramp * theta, 0.1 * math.log(factor) + 1.0


@register
class RoPE(PositionalEncoding):
    """Rotary position embedding on q and k; no bias."""

    name = "rope"
    rotates = True

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        base: float = 10000.0,
        rotary_fraction: float = 1.0,
        rotary_heads: int | None = None,
    ) -> None:
        super().__init__(num_heads, head_dim)
        self.base = float(base)
        self.rotary_dims = rotary_dims(head_dim, rotary_fraction)
        self.rotary_heads = num_heads if rotary_heads is None else rotary_heads
        if not 1 <= self.rotary_heads <= num_heads:
            raise ValueError(f"rope rotary_heads must be in 1..{num_heads} (the heads), got {rotary_heads}")
        inv_freq = self.base ** (-torch.arange(0, self.rotary_dims, 2, dtype=torch.float64) / self.rotary_dims)
        self.register_buffer("inv_freq", inv_freq.to(torch.float32), persistent=False)
        self.attention_scale = 1.0
        self.scaling: tuple[str, float] | None = None

    def set_context_scaling(self, method: str, factor: float, original_length: int) -> bool:
        if method not in SCALINGS:
            raise ValueError(f"unknown RoPE scaling {method!r}; choose one of {', '.join(SCALINGS)}")
        if factor < 1:
            raise ValueError(f"RoPE scaling factor must be ≥ 1 (how many times the training length), got {factor}")
        inv_freq, self.attention_scale = scaled_frequencies(
            self.base, self.rotary_dims, method, float(factor), original_length
        )
        self.inv_freq = inv_freq.to(device=self.inv_freq.device, dtype=torch.float32)
        self.scaling = (method, float(factor))
        return True

    def angles(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """Cos and sin (L, r/2) of position × frequency, in fp32."""
        theta = pos.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return theta.cos(), theta.sin()

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        return self._rotate(q, q_pos), self._rotate(k, k_pos)

    def _rotate(self, x: Tensor, pos: Tensor) -> Tensor:
        heads = self.rotary_heads
        rotated = rope_rotate(x if heads == self.num_heads else x[:, :heads], pos, self.inv_freq, self.rotary_dims)
        if self.attention_scale != 1.0:  # YaRN's temperature, on every head so all logits share it
            rotated = rotated * self.attention_scale
        if heads == self.num_heads:
            return rotated
        rest = x[:, heads:] * self.attention_scale if self.attention_scale != 1.0 else x[:, heads:]
        return torch.cat((rotated, rest), dim=1)

    def extra_repr(self) -> str:
        scaling = f", scaling={self.scaling[0]}×{self.scaling[1]:g}" if self.scaling else ""
        return (
            f"{super().extra_repr()}, base={self.base}, rotary_dims={self.rotary_dims}, "
            f"rotary_heads={self.rotary_heads}{scaling}"
        )
