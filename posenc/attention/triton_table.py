"""``triton``: one flash-attention kernel for every distance-only bias, learnable ones included.

Every scheme whose bias is a function of the distance i − j alone (ALiBi, KERPLE, T5, sums of them) describes
it as an (H, L) table through ``distance_bias``; the kernels (``triton_kernels.py``) add table[h, i − j] to each
score inside a FlashAttention-2 forward and backward, and the backward also returns the table's gradient, reduced
per tile along its diagonals with one atomic add per (tile, distance). The scheme's parameters then get their
gradients from autograd through ``distance_bias``, exactly: one fused reduction replaces both identities of
``docs/learnable-bias-gradient.md``, and no scheme is named here. A scheme without a bias runs with
no table.

Opt-in only (``attention=triton``): the kernels are tested on CPU through Triton's interpreter, against
``eager``, values and gradients; their GPU speed is unmeasured, so ``auto`` must not pick this backend until a GPU
session has benchmarked it (``python -m posenc.bench``) against ``flex`` and ``flex_learnable``.

It refuses, never dropping a bias: a scheme whose bias is not distance-only, anything but self-attention over one
window (Lq ≠ Lk or different positions, e.g. cached decoding), head dims outside 16..128, fp32 past head dim 64
(``MAX_FP32_HEAD_DIM``), dtypes other than fp32/bf16/fp16, CPU tensors unless the kernels run under the interpreter
(``TRITON_INTERPRET=1``), bf16 under the interpreter (whose tl.dot multiplies bf16's raw bits), and a machine
without triton.
"""

from __future__ import annotations

import importlib
import math
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from posenc.attention import refuse, refuse_content_bias, refuse_supplied_attention, register_backend
from posenc.attention.bias_grad import row_deltas
from posenc.encodings.base import PositionalEncoding

BLOCK_M = 64  # queries per program (and per tile)
BLOCK_N = 64  # keys per tile
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128  # tl.dot needs ≥ 16; past 128 the tiles no longer fit in registers
# fp32 tiles at head dim 128 need 240 KiB (dq) and 257 KiB (dk, dv) of shared memory compiled for an H100, over its
# 227 KiB (232,448 bytes): the backend refuses fp32 past 64 rather than fail at launch with OutOfResources.
MAX_FP32_HEAD_DIM = 64
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kernels() -> ModuleType:
    """The kernel module, imported on first use so that machines without triton can still import posenc."""
    try:  # through sys.modules, so a test can re-import it under the interpreter
        return importlib.import_module("posenc.attention.triton_kernels")
    except ImportError as error:
        raise RuntimeError(
            f"attention=triton needs the triton package ({error}); install it (Linux: pip install triton) "
            "or use attention=flex_learnable, flex or sdpa"
        ) from None


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _cdiv(n: int, block: int) -> int:
    return -(-n // block)


def launch_config(dtype: torch.dtype, head_dim: int) -> dict[str, Any]:
    """Tiles, precision, warps and stages of every launch for one (dtype, head dim).

    The one source of these numbers: the kernels launch with them, and ``triton_aot`` (run by the CPU test suite)
    compiles each kernel ahead of time for an H100 (sm_90) with them and checks its shared memory. Eight warps at
    head dim 128 keep most of the bf16 backward's accumulators in registers: compiled for sm_90 by triton 3.6, the
    dq kernel spilled ~600 bytes with four warps and ~160 with eight, the dk/dv kernel ~400 and none
    (``python -m posenc.attention.triton_aot --registers`` prints the figures for the triton installed).
    """
    block_d = _next_power_of_2(head_dim)
    return {
        "BLOCK_M": BLOCK_M,
        "BLOCK_N": BLOCK_N,
        "BLOCK_D": block_d,
        # fp32 inputs keep fp32 products (eager's precision) rather than TF32; bf16/fp16 ignore the setting.
        "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "num_warps": 8 if block_d >= 128 else 4,
        "num_stages": 3,
    }


def diagonal_width() -> int:
    """Columns of the dq kernel's skewed tile: every diagonal of a BLOCK_M × BLOCK_N tile (``WIDTH``)."""
    return _next_power_of_2(BLOCK_M + BLOCK_N - 1)


def _strides(t: Tensor) -> tuple[int, int, int]:
    """(batch, head, position) strides of a (B, H, L, D) tensor whose last dimension is contiguous."""
    return t.stride(0), t.stride(1), t.stride(2)


def _unit_last_stride(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class TableAttention(torch.autograd.Function):
    """Causal attention with the bias table[h, i − j]; differentiable in q, k, v and the table."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, table: Tensor | None) -> Tensor:
        module = kernels()
        q, k, v = (_unit_last_stride(t) for t in (q, k, v))
        batch, heads, length, head_dim = q.shape
        out = torch.empty(batch, heads, length, head_dim, device=q.device, dtype=q.dtype)
        lse = torch.empty(batch, heads, length, device=q.device, dtype=torch.float32)
        table_arg = table.float().contiguous() if table is not None else lse  # lse: a pointer never read
        grid = (_cdiv(length, BLOCK_M), batch * heads)
        module.forward_kernel[grid](
            q, k, v, out, lse, table_arg,
            *_strides(q), *_strides(k), *_strides(v), *_strides(out), table_arg.stride(0),
            heads, length, head_dim, 1.0 / math.sqrt(head_dim),
            HAS_BIAS=table is not None, **launch_config(q.dtype, head_dim),
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse, table_arg)
        ctx.has_bias = table is not None
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        module = kernels()
        q, k, v, out, lse, table = ctx.saved_tensors
        batch, heads, length, head_dim = q.shape
        dout = dout.to(q.dtype).contiguous()
        delta = row_deltas(out, dout).contiguous()  # Δ_i = dO_i · O_i in fp32, autocast or not
        dq, dk, dv = (torch.empty_like(dout) for _ in range(3))
        bias_grad = ctx.has_bias and ctx.needs_input_grad[3]
        dtable = torch.zeros(heads, length, device=q.device, dtype=torch.float32) if bias_grad else None
        options = launch_config(q.dtype, head_dim)
        shared = (*_strides(q), *_strides(k), *_strides(v), *_strides(dout), table.stride(0))
        sizes = (heads, length, head_dim, 1.0 / math.sqrt(head_dim))
        module.backward_dq_kernel[(_cdiv(length, BLOCK_M), batch * heads)](
            q, k, v, dout, lse, delta, dq, table, dtable if bias_grad else lse, *shared, *sizes,
            HAS_BIAS=ctx.has_bias, BIAS_GRAD=bias_grad, WIDTH=diagonal_width(), **options,
        )  # fmt: skip
        module.backward_dkdv_kernel[(_cdiv(length, BLOCK_N), batch * heads)](
            q, k, v, dout, lse, delta, dk, dv, table, *shared, *sizes, HAS_BIAS=ctx.has_bias, **options
        )
        return dq, dk, dv, dtable


def check_shape(head_dim: int, dtype: torch.dtype) -> None:
    """Raise for a head dim or dtype the kernels cannot run on an H100 (``triton_aot`` compiles all the others)."""
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"attention=triton supports head dims {MIN_HEAD_DIM}..{MAX_HEAD_DIM}, got {head_dim}; use attention=flex"
        )
    if dtype not in DTYPES:
        raise ValueError(f"attention=triton takes q, k, v of one dtype among fp32, bf16, fp16; got {dtype}")
    if dtype == torch.float32 and head_dim > MAX_FP32_HEAD_DIM:
        raise ValueError(
            f"attention=triton in fp32 supports head dims up to {MAX_FP32_HEAD_DIM} (its tiles at {head_dim} exceed "
            "an H100's shared memory); train in bf16 (trainer.precision=bf16-mixed, the GPU default) or use "
            "attention=flex"
        )


def refuse_other_biases(encoding: PositionalEncoding, backend: str) -> None:
    """The kernel reads a bias by distance and takes q, k and v of one head width."""
    if encoding.adds_bias and not encoding.distance_only:
        raise ValueError(
            f"attention={backend} needs a bias that depends on the distance i - j alone; {encoding.label}'s does "
            "not. Use attention=flex, sdpa or eager."
        )
    if encoding.qk_width != 1:
        raise ValueError(
            f"attention={backend} needs q, k and v of one head width, but {encoding.label} widens q and k to "
            f"{encoding.qk_width}× the head; use attention=sdpa, flex or eager"
        )


def check_supported(
    q: Tensor, k: Tensor, v: Tensor, encoding: PositionalEncoding, q_pos: Tensor, k_pos: Tensor
) -> None:
    """Raise with what to do instead when this backend cannot honour the call exactly."""
    refuse(encoding, "triton")
    if q.shape[-2] != k.shape[-2] or (q_pos is not k_pos and not torch.equal(q_pos, k_pos)):
        raise ValueError(
            "attention=triton handles self-attention over one window (Lq == Lk, q_pos == k_pos), not cached "
            "decoding; use attention=sdpa or eager."
        )
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"attention=triton takes q, k, v of one dtype among fp32, bf16, fp16; got {q.dtype}")
    check_shape(q.shape[-1], q.dtype)
    if kernels().INTERPRETED and q.dtype == torch.bfloat16:
        raise ValueError(
            "Triton's interpreter has no bf16 tl.dot (numpy stores bf16 as raw uint16 bits): run attention=triton "
            "in bf16 on a GPU, or use fp16/fp32 under TRITON_INTERPRET=1"
        )
    if not q.is_cuda and not kernels().INTERPRETED:
        raise RuntimeError(
            "attention=triton runs on CUDA tensors (on CPU only under Triton's interpreter, TRITON_INTERPRET=1, "
            "for tests); use attention=sdpa on CPU"
        )


@register_backend("triton", refuses=(refuse_supplied_attention, refuse_content_bias, refuse_other_biases))
def triton_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    encoding: PositionalEncoding,
    q_pos: Tensor,
    k_pos: Tensor,
    features: Tensor | None = None,
) -> Tensor:
    check_supported(q, k, v, encoding, q_pos, k_pos)
    table = encoding.distance_bias(q.shape[-2]) if encoding.adds_bias else None  # (H, L) fp32, differentiable
    return TableAttention.apply(q, k, v, table)
