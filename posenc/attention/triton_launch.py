"""How the ``triton`` backend launches its kernels: tiles per GPU class, grids, arguments, the kernels' module.

The table kernels (``triton_kernels``) and stick-breaking's (``triton_stick_kernels``). One place for it, read by the
backend (``triton_table``, ``triton_stick``) and by the kernel lane (``posenc.lane.table``), so that
the lane compiles exactly what a launch compiles: Triton specialises a kernel on its arguments (pointers aligned to
16 bytes, integers divisible by 16 or equal to 1, a Python float typed fp32), and that changes the code, its shared
memory and its registers. Importing this needs no triton.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

BLOCK_M = 64  # queries per tile off a GPU (Triton's interpreter, the CPU tests, which shrink it)
BLOCK_N = 64  # keys per tile off a GPU
KERNELS = ("forward", "backward_dq", "backward_dq_deterministic", "backward_dkdv")
STICK_KERNELS = ("stick_forward", "stick_backward")
# (BLOCK_M, BLOCK_N, num_warps, num_stages) per GPU class (compute capability), kernel, and (16-bit or fp32,
# BLOCK_D ≤ 64 or 128): the smallest shared memory is the L4's / RTX 4090's (sm_89, 99 KiB a block), then the A100's
# (sm_80, 163 KiB), the H100's (sm_90, 227 KiB). Each is a configuration that the kernel lane compiled as a launch
# compiles it (specialised on its arguments, at a length divisible by 16 and at one that is not) within the device's
# shared memory and with no register spill (``python -m posenc.lane --only table``; docs/gpu-kernels.md). Where the
# earlier tiles failed that (they had been chosen from kernels compiled without the launch's specialisation, which
# asked up to 1.8 times less shared memory and hid spills), the nearest that passed: the same tiles with other
# warps or stages, else a halved key tile, taking one below the 255-register ceiling where there was a choice. How
# fast each is, a GPU has yet to time. The deterministic dq kernel needs square tiles.
Tiles = tuple[int, int, int, int]
# Stick-breaking's kernels: the same tiles on every GPU class, ones the kernel lane compiled within each class's shared
# memory and with no spill, below the 255-register ceiling (the backward's 64 × 32 with 4 warps spilled on the A100 at
# bf16 d64, and with 4 warps at fp32 took all 255 at a length not divisible by 16; 32 × 32 with 8 warps took 80-202).
# How fast they are, a GPU has yet to time.
STICK_TILES: dict[str, dict[tuple[bool, int], Tiles]] = {
    "stick_forward": {(False, 64): (64, 32, 4, 2), (False, 128): (64, 32, 8, 2), (True, 64): (32, 32, 4, 2)},
    "stick_backward": {(False, 64): (32, 32, 8, 2), (False, 128): (32, 32, 8, 2), (True, 64): (32, 32, 8, 2)},
}
# Keyed (fp32, BLOCK_D): (False, 64) is bf16/fp16 at head dims up to 64, (False, 128) up to 128, (True, 64) fp32.
TILES: dict[tuple[int, int], dict[str, dict[tuple[bool, int], Tiles]]] = {
    (8, 0): {  # A100
        "forward": {(False, 64): (64, 64, 4, 2), (False, 128): (64, 64, 8, 2), (True, 64): (64, 32, 8, 3)},
        "backward_dq": {(False, 64): (32, 32, 4, 2), (False, 128): (32, 32, 4, 2), (True, 64): (64, 32, 8, 3)},
        "backward_dq_deterministic": {
            (False, 64): (32, 32, 4, 2), (False, 128): (32, 32, 8, 2), (True, 64): (32, 32, 8, 2)},
        "backward_dkdv": {(False, 64): (64, 32, 4, 3), (False, 128): (64, 64, 8, 3), (True, 64): (32, 32, 4, 1)},
        **STICK_TILES,
    },
    (8, 9): {  # L4, RTX 4090
        "forward": {(False, 64): (64, 64, 4, 2), (False, 128): (64, 64, 8, 2), (True, 64): (64, 32, 8, 3)},
        "backward_dq": {(False, 64): (64, 32, 4, 2), (False, 128): (32, 64, 8, 2), (True, 64): (64, 32, 8, 2)},
        "backward_dq_deterministic": {
            (False, 64): (32, 32, 4, 2), (False, 128): (32, 32, 8, 2), (True, 64): (32, 32, 8, 2)},
        "backward_dkdv": {(False, 64): (64, 32, 4, 3), (False, 128): (64, 64, 8, 2), (True, 64): (32, 32, 4, 1)},
        **STICK_TILES,
    },
    (9, 0): {  # H100, H200
        "forward": {(False, 64): (64, 64, 4, 3), (False, 128): (64, 64, 8, 3), (True, 64): (64, 32, 8, 3)},
        "backward_dq": {(False, 64): (64, 64, 8, 3), (False, 128): (32, 64, 8, 2), (True, 64): (64, 32, 8, 2)},
        "backward_dq_deterministic": {
            (False, 64): (64, 64, 8, 3), (False, 128): (32, 32, 8, 2), (True, 64): (32, 32, 8, 3)},
        "backward_dkdv": {(False, 64): (64, 64, 4, 3), (False, 128): (64, 32, 8, 3), (True, 64): (32, 16, 8, 3)},
        **STICK_TILES,
    },
}  # fmt: skip
SMALLEST_SHARED_MEMORY = (8, 9)
# A local layer's kernels (``LOCAL``: the window's mask and loop bounds compiled in) where the global tiles spill: the
# L4's fp32 backward spilled 8-24 B with them (python -m posenc.lane --only table), and these are the nearest that
# compiled without a spill at lengths 2,048 and 2,047.
LOCAL_TILES: dict[tuple[int, int], dict[str, dict[tuple[bool, int], Tiles]]] = {
    (8, 9): {
        "backward_dq": {(True, 64): (32, 32, 8, 2)},
        "backward_dq_deterministic": {(True, 64): (32, 32, 4, 2)},
        "backward_dkdv": {(True, 64): (32, 16, 4, 2)},
    },
}


def launch_config(
    dtype: torch.dtype, head_dim: int, kernel: str, capability: tuple[int, int] | None = None, local: bool = False
) -> dict[str, Any]:
    """Tiles, precision, warps and stages of one kernel's launch for one (dtype, head dim) on a GPU class.

    The one source of these numbers: the kernels launch with them, and the kernel lane compiles each kernel for each
    GPU with them (``posenc.lane.table``). ``capability`` ``None`` (no GPU: the interpreter) takes ``BLOCK_M`` ×
    ``BLOCK_N``; a GPU class the lane has not compiled for takes the L4's tiles, which fit the least shared memory
    of the three (an RTX 3090 or 5090 has as little). ``local``: a local layer's kernel, whose tiles are the global
    one's unless ``LOCAL_TILES`` gives its own.
    """
    block_d = _next_power_of_2(head_dim)
    wide = 128 if block_d > 64 else 64
    fp32 = dtype == torch.float32
    if capability is None:
        block_m, block_n, warps, stages = BLOCK_M, BLOCK_N, 4, 3
    else:
        gpu_class = capability if capability in TILES else SMALLEST_SHARED_MEMORY
        block_m, block_n, warps, stages = TILES[gpu_class][kernel][fp32, wide]
        if local:
            own = LOCAL_TILES.get(gpu_class, {}).get(kernel, {})
            block_m, block_n, warps, stages = own.get((fp32, wide), (block_m, block_n, warps, stages))
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


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _cdiv(n: int, block: int) -> int:
    return -(-n // block)


def _strides(t: Tensor) -> tuple[int, int, int]:
    """(batch, head, position) strides of a (B, H, L, D) tensor whose last dimension is contiguous."""
    return t.stride(0), t.stride(1), t.stride(2)


@dataclass(frozen=True)
class Launch:
    """One kernel launch as the backend makes it: which kernel, its grid, its arguments and its constexprs.

    Built in one place (``forward_launch``, ``backward_launches``) for both the launch and the kernel lane, so that
    the lane compiles what a launch compiles: Triton specialises a kernel on its arguments (pointers aligned to 16
    bytes, integers divisible by 16 or equal to 1, a Python float typed fp32), and that changes the code, the
    shared memory and the registers it needs.
    """

    kernel: str  # one of KERNELS
    grid: tuple[int, int]
    args: tuple[Any, ...]
    constexprs: dict[str, Any]  # the kernel's constexprs with num_warps and num_stages

    def run(self, module: ModuleType) -> None:
        """Launch it from ``module`` (the compiled kernels, or the interpreter's)."""
        getattr(module, KERNEL_FUNCTIONS[self.kernel])[self.grid](*self.args, **self.constexprs)


KERNEL_FUNCTIONS = {
    "forward": "forward_kernel",
    "backward_dq": "backward_dq_kernel",
    "backward_dq_deterministic": "backward_dq_kernel",
    "backward_dkdv": "backward_dkdv_kernel",
    "stick_forward": "stick_forward_kernel",
    "stick_backward": "stick_backward_kernel",
}
# The module of each kernel under posenc.attention, imported on first use (machines without triton import posenc).
KERNEL_MODULES = {**dict.fromkeys(KERNELS, "triton_kernels"), **dict.fromkeys(STICK_KERNELS, "triton_stick_kernels")}


def kernels(kernel: str = "forward") -> ModuleType:
    """The module of ``kernel``, imported on first use so that machines without triton can still import posenc."""
    try:  # through sys.modules, so a test can re-import it under the interpreter
        return importlib.import_module(f"posenc.attention.{KERNEL_MODULES[kernel]}")
    except ImportError as error:
        raise RuntimeError(
            f"attention=triton needs the triton package ({error}); install it (Linux: pip install triton) "
            "or use attention=flex_learnable, flex or sdpa"
        ) from None


def check_device(q: Tensor, kernel: str = "forward") -> ModuleType:
    """The module of ``kernel``, once the device and the way the kernels run (compiled or interpreted) can take ``q``.

    Checked where the kernels launch, inside the operators: a compiled block traces an operator as one node and
    never the import behind it.
    """
    module = kernels(kernel)
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


def forward_launch(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    table: Tensor | None,
    capability: tuple[int, int] | None,
    window: int | None = None,
) -> Launch:
    """The forward's launch: a program per (query block, batch × head); ``table`` fp32 (H, L) or None.

    ``window``: a local layer's; a global layer passes the length, so both run one kernel.
    """
    batch, heads, length, head_dim = q.shape
    config = launch_config(q.dtype, head_dim, "forward", capability, window is not None)
    table_arg = table if table is not None else lse  # lse: a pointer never read
    args = (
        q, k, v, out, lse, table_arg,
        *_strides(q), *_strides(k), *_strides(v), *_strides(out), table_arg.stride(0),
        heads, length, head_dim, 1.0 / math.sqrt(head_dim), length if window is None else window,
    )  # fmt: skip
    flags = {"HAS_BIAS": table is not None, "LOCAL": window is not None}
    return Launch("forward", (_cdiv(length, config["BLOCK_M"]), batch * heads), args, {**flags, **config})


def backward_launches(
    tensors: dict[str, Tensor], table: Tensor | None, bias_grad: bool, deterministic: bool,
    capability: tuple[int, int] | None, window: int | None = None,
) -> tuple[Launch, Launch]:  # fmt: skip
    """The dq kernel's launch (a program per query block) and the dk, dv kernel's (a program per key block).

    ``tensors`` holds q, k, v, dout, lse, delta, dq, dk, dv and dtable (the table gradient's buffer, any tensor
    when ``bias_grad`` is off); ``table`` is fp32 (H, L) or None.
    """
    t = tensors
    batch, heads, length, head_dim = t["q"].shape
    table_arg = table if table is not None else t["lse"]  # lse: a pointer never read
    shared = (*_strides(t["q"]), *_strides(t["k"]), *_strides(t["v"]), *_strides(t["dout"]), table_arg.stride(0))
    sizes = (heads, length, head_dim, 1.0 / math.sqrt(head_dim), length if window is None else window)
    kernel = "backward_dq_deterministic" if deterministic else "backward_dq"
    config = launch_config(t["q"].dtype, head_dim, kernel, capability, window is not None)
    dq = Launch(
        kernel,
        (_cdiv(length, config["BLOCK_M"]), batch * heads),
        (t["q"], t["k"], t["v"], t["dout"], t["lse"], t["delta"], t["dq"], table_arg, t["dtable"], *shared, *sizes),
        {
            "HAS_BIAS": table is not None,
            "LOCAL": window is not None,
            "BIAS_GRAD": bias_grad,
            "DETERMINISTIC": deterministic,
            **config,
        },
    )
    config = launch_config(t["q"].dtype, head_dim, "backward_dkdv", capability, window is not None)
    dkdv = Launch(
        "backward_dkdv",
        (_cdiv(length, config["BLOCK_N"]), batch * heads),
        (t["q"], t["k"], t["v"], t["dout"], t["lse"], t["delta"], t["dk"], t["dv"], table_arg, *shared, *sizes),
        {"HAS_BIAS": table is not None, "LOCAL": window is not None, **config},
    )
    return dq, dkdv


def table_gradient_buffer(
    q: Tensor, deterministic: bool, bias_grad: bool, capability: tuple[int, int] | None, local: bool = False
) -> Tensor:
    """Where the dq kernel adds the table's gradient: (H, L), or per query block when deterministic, or nothing.

    ``local``: for a local layer's kernel, whose tiles may be its own (``LOCAL_TILES``).
    """
    batch, heads, length, head_dim = q.shape
    if deterministic:  # one row per (batch, head, query block), every block of distances it reaches written once
        config = launch_config(q.dtype, head_dim, "backward_dq_deterministic", capability, local)
        blocks = _cdiv(length, config["BLOCK_M"])
        return torch.zeros(batch * heads, blocks, blocks * config["BLOCK_N"], device=q.device, dtype=torch.float32)
    return torch.zeros(heads, length if bias_grad else 0, device=q.device, dtype=torch.float32)


def stick_forward_launch(
    q: Tensor, k: Tensor, v: Tensor, head_bias: Tensor | None, out: Tensor, capability: tuple[int, int] | None
) -> Launch:
    """Stick-breaking's forward: a program per (query block, batch × head); ``head_bias`` (H, D) or None (own value)."""
    batch, heads, length, head_dim = q.shape
    config = launch_config(q.dtype, head_dim, "stick_forward", capability)
    bias_arg = head_bias if head_bias is not None else v  # v: a pointer never read
    args = (
        q, k, v, bias_arg, out, *_strides(q), *_strides(k), *_strides(v), *_strides(out), bias_arg.stride(0),
        heads, length, head_dim, 1.0 / math.sqrt(head_dim),
    )  # fmt: skip
    grid = (_cdiv(length, config["BLOCK_M"]), batch * heads)
    return Launch("stick_forward", grid, args, {"OWN_VALUE": head_bias is None, **config})


def stick_backward_launch(tensors: dict[str, Tensor], capability: tuple[int, int] | None) -> Launch:
    """Stick-breaking's backward: a program per query block.

    ``tensors`` holds q, k, v, dout, delta, dq, dk, dv and remainder: dk, dv zeroed fp32 buffers laid out like dout,
    delta and remainder (B, H, L) fp32.
    """
    t = tensors
    batch, heads, length, head_dim = t["q"].shape
    config = launch_config(t["q"].dtype, head_dim, "stick_backward", capability)
    args = (
        t["q"], t["k"], t["v"], t["dout"], t["delta"], t["dq"], t["dk"], t["dv"], t["remainder"],
        *_strides(t["q"]), *_strides(t["k"]), *_strides(t["v"]), *_strides(t["dout"]),
        heads, length, head_dim, 1.0 / math.sqrt(head_dim),
    )  # fmt: skip
    return Launch("stick_backward", (_cdiv(length, config["BLOCK_M"]), batch * heads), args, config)
