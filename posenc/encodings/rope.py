"""RoPE (Su et al., 2021, "RoFormer"): rotate query/key channel pairs by an angle proportional to position.

q_m · k_n then depends on m - n only (the paper's Eq. 16). Pairs are (x_i, x_{i + r/2}) over the first ``r``
channels (the GPT-NeoX / Llama "rotate half" layout); θ_i = base^(-2i/r). ``rotary_fraction`` < 1 rotates only
the first r = fraction · head_dim channels and leaves the rest position-free (as GPT-NeoX does with 0.25).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

from posenc.encodings import register
from posenc.encodings.base import PositionalEncoding


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

    Eagerly, a rotation is a chain of ~10 elementwise ops, each a full pass over q or k in fp32 (the anchor
    benchmark measured RoPE + SDPA at 2.2–3.2× SDPA alone); compiled, it is one pass. Compiled once per process
    with dynamic shapes, so evaluating at new lengths does not recompile; never on CPU, where tests would pay
    the compile time. Inside an already compiled model the plain function is traced into the model's graph.
    """
    compiled: list[Callable[..., Tensor]] = []

    def dispatch(x: Tensor, *args: object) -> Tensor:
        if not x.is_cuda or torch.compiler.is_compiling():
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
        return rope_rotate(x, pos, self.inv_freq, self.rotary_dims)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, base={self.base}, rotary_dims={self.rotary_dims}"
