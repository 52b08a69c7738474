"""``triton``: one flash-attention kernel for every distance-only bias, learnable ones included.

Every scheme whose bias is a function of the distance i − j alone (ALiBi, KERPLE, T5, Sandwich, sums of them)
describes it as an (H, L) table through ``distance_bias``; the kernels (``triton_kernels.py``) add table[h, i − j] to
each score inside a FlashAttention-2 forward and backward, and the backward also returns the table's gradient,
reduced per tile along its diagonals. The scheme's parameters then get their gradients from autograd through
``distance_bias``, exactly: one fused reduction replaces both identities of ``docs/learnable-bias-gradient.md``, and
no scheme is named here. A scheme without a bias runs with no table.

The kernels are two custom operators, ``posenc::table_attention`` (out and the row log-sum-exp) and
``posenc::table_attention_backward`` (dq, dk, dv and the table's gradient), with their autograd and fake (shape-only)
implementations registered: inside ``torch.compile`` each is one node of the block's graph, never a graph break.
The table's gradient adds tiles with atomics, whose order varies between runs; under
``torch.use_deterministic_algorithms(True)`` (what ``trainer.deterministic=true`` sets) the backward writes each
block of distances once per query block into a buffer and sums it in a fixed order instead: the same bits on every
run, at the cost of that buffer (B · H · (L / BLOCK_M) · L fp32).

Tiles and warps come per GPU class (``launch_config``), chosen so that every kernel compiles for sm_80, sm_89 and
sm_90 within the device's shared memory and with no register spill (``python -m posenc.lane --only table`` compiles them
and reports both). Opt-in only (``attention=triton``): the kernels are tested on CPU through Triton's interpreter,
against ``eager``, values and gradients; their GPU speed is unmeasured, so ``auto`` picks this backend only where a
recorded measurement says it is faster (``auto.MEASURED_FASTER``, empty until a GPU has timed it).

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

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128  # tl.dot needs ≥ 16; past 128 the tiles no longer fit in registers
# fp32 tiles at head dim 128 need 240 KiB (dq) and 257 KiB (dk, dv) of shared memory compiled for an H100, over its
# 227 KiB (232,448 bytes): the backend refuses fp32 past 64 rather than fail at launch with OutOfResources.
MAX_FP32_HEAD_DIM = 64
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


BLOCK_M = 64  # queries per tile off a GPU (Triton's interpreter, the CPU tests, which shrink it)
BLOCK_N = 64  # keys per tile off a GPU
KERNELS = ("forward", "backward_dq", "backward_dq_deterministic", "backward_dkdv")
# (BLOCK_M, BLOCK_N, num_warps, num_stages) per GPU class (compute capability), kernel, and (16-bit or fp32,
# BLOCK_D ≤ 64 or 128): the smallest shared memory is the L4's / RTX 4090's (sm_89, 99 KiB a block), then the A100's
# (sm_80, 163 KiB), the H100's (sm_90, 227 KiB). For each, the largest tiles of a few candidates that the kernel lane
# compiled for that GPU with no register spill and within its shared memory (``python -m posenc.lane --only table``;
# docs/gpu-kernels.md): the dq kernel, which also skews each tile to reduce the table's gradient, spilled 144–712
# bytes with the forward's tiles. How fast each is, a GPU has yet to time. The deterministic dq kernel needs square
# tiles.
Tiles = tuple[int, int, int, int]
# Keyed (fp32, BLOCK_D): (False, 64) is bf16/fp16 at head dims up to 64, (False, 128) up to 128, (True, 64) fp32.
TILES: dict[tuple[int, int], dict[str, dict[tuple[bool, int], Tiles]]] = {
    (8, 0): {  # A100
        "forward": {(False, 64): (64, 64, 4, 2), (False, 128): (64, 64, 8, 2), (True, 64): (64, 32, 8, 2)},
        "backward_dq": {(False, 64): (32, 32, 4, 2), (False, 128): (32, 32, 4, 2), (True, 64): (64, 32, 8, 2)},
        "backward_dq_deterministic": {
            (False, 64): (32, 32, 4, 2), (False, 128): (32, 32, 8, 2), (True, 64): (32, 32, 8, 2)},
        "backward_dkdv": {(False, 64): (64, 64, 4, 3), (False, 128): (64, 64, 8, 3), (True, 64): (32, 32, 4, 1)},
    },
    (8, 9): {  # L4, RTX 4090
        "forward": {(False, 64): (64, 64, 4, 2), (False, 128): (64, 64, 8, 3), (True, 64): (64, 32, 8, 2)},
        "backward_dq": {(False, 64): (64, 32, 4, 2), (False, 128): (32, 64, 8, 2), (True, 64): (64, 32, 8, 2)},
        "backward_dq_deterministic": {
            (False, 64): (32, 32, 4, 2), (False, 128): (32, 32, 8, 2), (True, 64): (32, 32, 8, 2)},
        "backward_dkdv": {(False, 64): (64, 64, 4, 3), (False, 128): (64, 64, 8, 2), (True, 64): (32, 32, 4, 1)},
    },
    (9, 0): {  # H100, H200
        "forward": {(False, 64): (64, 64, 4, 3), (False, 128): (64, 64, 8, 3), (True, 64): (64, 32, 8, 2)},
        "backward_dq": {(False, 64): (64, 64, 8, 3), (False, 128): (32, 64, 8, 2), (True, 64): (64, 32, 8, 2)},
        "backward_dq_deterministic": {
            (False, 64): (64, 64, 8, 3), (False, 128): (32, 32, 8, 2), (True, 64): (32, 32, 8, 2)},
        "backward_dkdv": {(False, 64): (64, 64, 4, 3), (False, 128): (64, 64, 8, 3), (True, 64): (32, 32, 4, 1)},
    },
}  # fmt: skip
SMALLEST_SHARED_MEMORY = (8, 9)


def launch_config(
    dtype: torch.dtype, head_dim: int, kernel: str, capability: tuple[int, int] | None = None
) -> dict[str, Any]:
    """Tiles, precision, warps and stages of one kernel's launch for one (dtype, head dim) on a GPU class.

    The one source of these numbers: the kernels launch with them, and the kernel lane compiles each kernel for each
    GPU with them (``posenc.lane.table``). ``capability`` ``None`` (no GPU: the interpreter) takes ``BLOCK_M`` ×
    ``BLOCK_N``; a GPU class the lane has not compiled for takes the L4's tiles, which fit the least shared memory
    of the three (an RTX 3090 or 5090 has as little).
    """
    block_d = _next_power_of_2(head_dim)
    wide = 128 if block_d > 64 else 64
    fp32 = dtype == torch.float32
    if capability is None:
        block_m, block_n, warps, stages = BLOCK_M, BLOCK_N, 4, 3
    else:
        block_m, block_n, warps, stages = TILES.get(capability, TILES[SMALLEST_SHARED_MEMORY])[kernel][fp32, wide]
    if kernel == "backward_dq_deterministic":
        block_n = block_m  # the halves of a tile's diagonal sums meet at block boundaries: square tiles
    return {
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_D": block_d,
        # fp32 inputs keep fp32 products (eager's precision) rather than TF32; bf16/fp16 ignore the setting.
        "PRECISION": "ieee" if fp32 else "tf32",
        **({"WIDTH": _next_power_of_2(block_m + block_n - 1)} if kernel.startswith("backward_dq") else {}),
        "num_warps": warps,
        "num_stages": stages,
    }


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


def _capability(t: Tensor) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(t.device) if t.is_cuda else None


def _strides(t: Tensor) -> tuple[int, int, int]:
    """(batch, head, position) strides of a (B, H, L, D) tensor whose last dimension is contiguous."""
    return t.stride(0), t.stride(1), t.stride(2)


def _unit_last_stride(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@torch.library.custom_op("posenc::table_attention", mutates_args=())
def table_attention(q: Tensor, k: Tensor, v: Tensor, table: Tensor | None) -> tuple[Tensor, Tensor]:
    """Causal attention with the bias table[h, i − j] (or none): out (B, H, L, D) and the natural row lse (B, H, L)."""
    module = check_device(q)
    q, k, v = (_unit_last_stride(t) for t in (q, k, v))
    batch, heads, length, head_dim = q.shape
    out = torch.empty(batch, heads, length, head_dim, device=q.device, dtype=q.dtype)
    lse = torch.empty(batch, heads, length, device=q.device, dtype=torch.float32)
    table_arg = table.float().contiguous() if table is not None else lse  # lse: a pointer never read
    config = launch_config(q.dtype, head_dim, "forward", _capability(q))
    module.forward_kernel[(_cdiv(length, config["BLOCK_M"]), batch * heads)](
        q, k, v, out, lse, table_arg,
        *_strides(q), *_strides(k), *_strides(v), *_strides(out), table_arg.stride(0),
        heads, length, head_dim, 1.0 / math.sqrt(head_dim), HAS_BIAS=table is not None, **config,
    )  # fmt: skip
    return out, lse


@table_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, table: Tensor | None) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("posenc::table_attention_backward", mutates_args=())
def table_attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, table: Tensor | None, bias_grad: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv and (``bias_grad``) the table's gradient (H, L) fp32; without it an empty (0,) tensor."""
    module = check_device(q)
    q, k, v = (_unit_last_stride(t) for t in (q, k, v))
    batch, heads, length, head_dim = q.shape
    dout = dout.to(q.dtype).contiguous()
    delta = row_deltas(out, dout).contiguous()  # Δ_i = dO_i · O_i in fp32, autocast or not
    dq, dk, dv = (torch.empty_like(dout) for _ in range(3))
    has_bias = table is not None
    table_arg = table.float().contiguous() if has_bias else lse  # lse: a pointer never read
    deterministic = bias_grad and torch.are_deterministic_algorithms_enabled()
    kernel = "backward_dq_deterministic" if deterministic else "backward_dq"
    config = launch_config(q.dtype, head_dim, kernel, _capability(q))
    blocks = _cdiv(length, config["BLOCK_M"])
    if deterministic:  # one row per (batch, head, query block), every block of distances it reaches written once
        dtable = torch.zeros(batch * heads, blocks, blocks * config["BLOCK_N"], device=q.device, dtype=torch.float32)
    else:
        dtable = torch.zeros(heads, length if bias_grad else 0, device=q.device, dtype=torch.float32)
    shared = (*_strides(q), *_strides(k), *_strides(v), *_strides(dout), table_arg.stride(0))
    sizes = (heads, length, head_dim, 1.0 / math.sqrt(head_dim))
    module.backward_dq_kernel[(blocks, batch * heads)](
        q, k, v, dout, lse, delta, dq, table_arg, dtable if bias_grad else lse, *shared, *sizes,
        HAS_BIAS=has_bias, BIAS_GRAD=bias_grad, DETERMINISTIC=deterministic, **config,
    )  # fmt: skip
    config = launch_config(q.dtype, head_dim, "backward_dkdv", _capability(q))
    module.backward_dkdv_kernel[(_cdiv(length, config["BLOCK_N"]), batch * heads)](
        q, k, v, dout, lse, delta, dk, dv, table_arg, *shared, *sizes, HAS_BIAS=has_bias, **config
    )
    if deterministic:  # a fixed order: over batch, then over query blocks, each a torch reduction
        dtable = dtable.view(batch, heads, blocks, -1).sum(dim=0).sum(dim=1)[:, :length].contiguous()
    return dq, dk, dv, dtable


@table_attention_backward.register_fake
def _(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, table: Tensor | None, bias_grad: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    heads, length = q.shape[1], q.shape[2]
    dtable = q.new_empty((heads, length) if bias_grad else (0,), dtype=torch.float32)
    return q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(q.shape), dtable


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, table = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, table)


def _backward(ctx: Any, dout: Tensor, dlse: Tensor | None) -> tuple[Tensor | None, ...]:
    q, k, v, out, lse, table = ctx.saved_tensors
    bias_grad = table is not None and ctx.needs_input_grad[3]
    dq, dk, dv, dtable = table_attention_backward(dout, q, k, v, out, lse, table, bias_grad)
    return dq, dk, dv, dtable if bias_grad else None


# The lse is an output for the backward only: it is saved, and a caller never differentiates through it.
table_attention.register_autograd(_backward, setup_context=_setup_context)


def check_shape(head_dim: int, dtype: torch.dtype) -> None:
    """Raise for a head dim or dtype the kernels cannot run (the kernel lane compiles all the others for each GPU)."""
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


def check_device(q: Tensor) -> ModuleType:
    """The kernel module, once the device and the way the kernels run (compiled or interpreted) can take ``q``.

    Checked where the kernels launch, inside the operator: a compiled block traces the operator as one node and
    never the import behind it.
    """
    module = kernels()
    if module.INTERPRETED and q.dtype == torch.bfloat16:
        raise ValueError(
            "Triton's interpreter has no bf16 tl.dot (numpy stores bf16 as raw uint16 bits): run attention=triton "
            "in bf16 on a GPU, or use fp16/fp32 under TRITON_INTERPRET=1"
        )
    if not q.is_cuda and not module.INTERPRETED:
        raise RuntimeError(
            "attention=triton runs on CUDA tensors (on CPU only under Triton's interpreter, TRITON_INTERPRET=1, "
            "for tests); use attention=sdpa on CPU"
        )
    return module


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
    table = encoding.distance_bias(q.shape[-2]).float() if encoding.adds_bias else None  # (H, L), differentiable
    return table_attention(q, k, v, table)[0]
