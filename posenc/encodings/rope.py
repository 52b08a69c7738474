"""RoPE (Su et al., 2021, "RoFormer"): rotate query/key channel pairs by an angle proportional to position.

q_m · k_n then depends on m - n only (the paper's Eq. 16). Pairs are (x_i, x_{i + r/2}) over the first ``r``
channels (the GPT-NeoX / Llama "rotate half" layout); θ_i = base^(-2i/r). ``rotary_fraction`` < 1 rotates only
the first r = fraction · head_dim channels and leaves the rest position-free (as GPT-NeoX does with 0.25);
``rotary_heads`` < H rotates only the first heads and leaves the others NoPE heads.

Evaluation-time context scaling (``set_context_scaling``, used by ``posenc.evaluate eval.rope_scaling=...``)
stretches a model trained at L to s·L positions without retraining, each method changing the frequencies θ_i
(i = 0 … r/2 − 1). ``yarn``, ``dynamic_ntk`` and ``llama3`` follow the deployed code (Hugging Face transformers'
rope-init functions, the YaRN authors' repository), so a result here means what it means for a released model:

- ``pi``, position interpolation (Chen et al., 2023): θ_i / s, i.e. positions compressed by s.
- ``ntk``, NTK-aware scaling (bloc97, 2023): base' = base · s^(r/(r−2)), high frequencies nearly kept, the lowest
  one interpolated by s.
- ``dynamic_ntk`` (emozilla, 2023; transformers' "dynamic"): NTK with the factor following the sequence. At a
  sequence of n positions (the largest key position + 1) base' = base · (s·n/L − (s − 1))^(r/(r−2)) when n > L,
  the trained base otherwise: in-length results are untouched, and the NTK factor grows by s per further L.
- ``yarn`` (Peng et al., 2024), as deployed: the ramp is linear in the pair index i between the indices where a
  frequency turns β = 32 and α = 1 times within L, i(ρ) = r · ln(L / (2π ρ)) / (2 ln base), the low end floored,
  the high end ceiled, both clamped to [0, r − 1]; γ_i = clamp((i − low) / (high − low), 0, 1) and
  θ'_i = γ_i θ_i / s + (1 − γ_i) θ_i. The attention factor 0.1 ln s + 1 multiplies q and k.
- ``yarn_paper``: the paper's Eq. 17–21 instead, the ramp linear in r_i = L / λ_i (wavelengths λ_i = 2π/θ_i per
  training length), γ_i = clamp((r_i − α)/(β − α), 0, 1), θ'_i = (1 − γ_i) θ_i/s + γ_i θ_i, the same temperature
  √(1/t) = 0.1 ln s + 1 on q and k. It interpolates the fastest pairs of a short model too (at r = 32, L = 64,
  s = 8, pair 0 keeps 0.384 of its frequency; the deployed form keeps all of it), so it is not comparable with a
  released YaRN model.
- ``llama3`` (Llama 3.1's rope_scaling): wavelengths shorter than L / 4 (high_freq_factor 4) keep their frequency,
  those longer than L (low_freq_factor 1) are divided by s, and between them
  θ'_i = (1 − κ_i) θ_i / s + κ_i θ_i with κ_i = (L / λ_i − 1) / (4 − 1). L is the training length.
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


SCALINGS = ("pi", "ntk", "dynamic_ntk", "yarn", "yarn_paper", "llama3")
YARN_ALPHA, YARN_BETA = 1.0, 32.0  # the ramp's ends, in turns per training length (YaRN's beta_slow, beta_fast)
LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR = 1.0, 4.0  # Llama 3.1's defaults


def yarn_temperature(factor: float) -> float:
    """YaRN's q/k multiplier √(1/t) = 0.1 ln s + 1 (the paper's Eq. 22; 1 when s ≤ 1)."""
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def yarn_correction_range(base: float, dims: int, original_length: int) -> tuple[int, int]:
    """Pair indices (low, high) between which deployed YaRN's ramp runs: where θ_i turns β, then α, times in L.

    Solving L θ_i / (2π) = ρ for i gives i(ρ) = r ln(L / (2π ρ)) / (2 ln base); the low end is floored, the high end
    ceiled and both clamped to [0, r − 1], as the YaRN authors' ``find_correction_range`` does.
    """

    def index(turns: float) -> float:
        return dims * math.log(original_length / (turns * 2 * math.pi)) / (2 * math.log(base))

    return max(math.floor(index(YARN_BETA)), 0), min(math.ceil(index(YARN_ALPHA)), dims - 1)


def scaled_frequencies(
    base: float, dims: int, method: str, factor: float, original_length: int
) -> tuple[torch.Tensor, float]:
    """(θ'_i (dims/2,) float64, q/k multiplier) for a fixed context scaling method (see the module docstring).

    ``dynamic_ntk`` depends on the sequence length and lives in ``dynamic_ntk_frequencies``.
    """
    exponents = torch.arange(0, dims, 2, dtype=torch.float64) / dims
    theta = base**-exponents
    if method == "pi":
        return theta / factor, 1.0
    if method == "ntk":
        return (base * factor ** (dims / (dims - 2))) ** -exponents, 1.0
    if method == "yarn":
        low, high = yarn_correction_range(base, dims, original_length)
        span = (high + 0.001 if high == low else high) - low  # the authors' guard against an empty ramp
        interpolated = ((torch.arange(dims // 2, dtype=torch.float64) - low) / span).clamp(0.0, 1.0)
        return interpolated * theta / factor + (1 - interpolated) * theta, yarn_temperature(factor)
    wavelengths = 2 * math.pi / theta
    if method == "yarn_paper":
        wavelengths_in_context = original_length / wavelengths  # r_i = L / λ_i
        ramp = ((wavelengths_in_context - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA)).clamp(0.0, 1.0)
        return (1 - ramp) * theta / factor + ramp * theta, yarn_temperature(factor)
    if method == "llama3":
        # κ clamped to [0, 1] is Llama's three cases in one: κ = 1 below L/4 (kept), 0 beyond L (divided by s)
        kept = (original_length / wavelengths - LLAMA3_LOW_FREQ_FACTOR) / (
            LLAMA3_HIGH_FREQ_FACTOR - LLAMA3_LOW_FREQ_FACTOR
        )
        kept = kept.clamp(0.0, 1.0)
        return (1 - kept) * theta / factor + kept * theta, 1.0
    raise ValueError(f"unknown RoPE scaling {method!r}; choose one of {', '.join(SCALINGS)}")


def dynamic_ntk_frequencies(base: float, dims: int, factor: float, original_length: int, length: Tensor) -> Tensor:
    """θ'_i (dims/2,) float64 under dynamic NTK for a sequence of ``length`` positions (a 0-d tensor).

    base' = base · max(s·n/L − (s − 1), 1)^(r/(r−2)): the trained frequencies up to L, then NTK's base with a
    factor that grows with n. Kept in tensors so a CUDA length never forces a host sync.
    """
    stretch = (factor * length.to(torch.float64) / original_length - (factor - 1)).clamp(min=1.0)
    exponents = torch.arange(0, dims, 2, dtype=torch.float64, device=length.device) / dims
    return (base * stretch ** (dims / (dims - 2))) ** -exponents


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
        self.register_buffer("inv_freq", self.adjust_frequencies(inv_freq).to(torch.float32), persistent=False)
        self.attention_scale = 1.0
        self.scaling: tuple[str, float] | None = None
        self.dynamic: tuple[float, int] | None = None  # (s, L) under dynamic NTK, whose θ follow the sequence

    def set_context_scaling(self, method: str, factor: float, original_length: int) -> bool:
        if method not in SCALINGS:
            raise ValueError(f"unknown RoPE scaling {method!r}; choose one of {', '.join(SCALINGS)}")
        if factor < 1:
            raise ValueError(f"RoPE scaling factor must be ≥ 1 (how many times the training length), got {factor}")
        if method in ("ntk", "dynamic_ntk") and self.rotary_dims < 4:
            raise ValueError(f"{method} scaling raises the base to r/(r−2) and needs r ≥ 4 rotated channels")
        self.dynamic = (float(factor), original_length) if method == "dynamic_ntk" else None
        self.attention_scale = 1.0
        if self.dynamic is None:
            inv_freq, self.attention_scale = scaled_frequencies(
                self.base, self.rotary_dims, method, float(factor), original_length
            )
            inv_freq = self.adjust_frequencies(inv_freq)
            self.inv_freq = inv_freq.to(device=self.inv_freq.device, dtype=torch.float32)
        self.scaling = (method, float(factor))
        return True

    def adjust_frequencies(self, theta: Tensor) -> Tensor:
        """θ_i (r/2,) float64 as this variant uses them; RoPE itself keeps them. Variants override only this.

        Every frequency the scheme rotates by passes through here: the trained ones, and those of an evaluation-time
        scaling (after the scaling, so p-RoPE's and HoPE's still pairs stay still, and Resonance RoPE rounds the
        scaled wavelengths as its authors' Resonance YaRN does).
        """
        return theta

    def frequencies(self, k_pos: Tensor) -> Tensor:
        """θ_i (r/2,) fp32 for a sequence whose keys sit at ``k_pos``; only dynamic NTK depends on them.

        Queries and keys take the same θ, so q_m · k_n still depends on m − n only; the sequence length is the
        largest key position + 1 (cached keys are rotated again with each step's θ, see posenc/decoding.py).
        """
        if self.dynamic is None:
            return self.inv_freq
        factor, original_length = self.dynamic
        length = k_pos.max() + 1
        theta = dynamic_ntk_frequencies(self.base, self.rotary_dims, factor, original_length, length)
        return self.adjust_frequencies(theta).float()

    def angles(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """Cos and sin (L, r/2) of position × frequency, in fp32."""
        theta = pos.to(torch.float32)[:, None] * self.frequencies(pos)[None, :]
        return theta.cos(), theta.sin()

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        inv_freq = self.frequencies(k_pos)
        return self._rotate(q, q_pos, inv_freq), self._rotate(k, k_pos, inv_freq)

    def _rotate(self, x: Tensor, pos: Tensor, inv_freq: Tensor) -> Tensor:
        if x.shape[-1] != self.head_dim:
            raise ValueError(
                f"{self.name} rotates heads of {self.head_dim} channels but got {x.shape[-1]}: a scheme before it in "
                "the stack changed the head width (pope); put that scheme last"
            )
        heads = self.rotary_heads
        rotated = rope_rotate(x if heads == self.num_heads else x[:, :heads], pos, inv_freq, self.rotary_dims)
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
