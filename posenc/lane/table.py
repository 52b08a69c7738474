"""The ``triton`` backend's kernels compiled for each GPU of the lane, with the tiles the backend launches there.

The table kernels do not depend on the scheme: every distance-only bias, learnable or not, reaches them as one (H, L)
table, so one compile per (GPU, kernel, dtype, head dim, length class) covers KERPLE, T5, ALiBi, Sandwich and their
stacks alike. A local layer's table kernels are other kernels (``<kernel>_local``: the window's mask and loop bounds
compiled in), each compiled too. Stick-breaking's kernels serve every scheme that declares a ``stick_form``: the
forward is compiled with the remainder on the head's vector (``stick_forward``, the trained form) and on the query's
own value (``stick_forward_own_value``), the backward once (it never reads the target). Each kernel is compiled as the
backend's launch on that GPU compiles it: the launch is built by the backend's own ``triton_launch`` (tiles, warps
and stages for that GPU class, the arguments Triton specialises on) and compiled through Triton's ``warmup`` for the
GPU's target; ptxas (the one in Triton's wheel) reports its registers and spilled bytes. Compiled instead from a
bare signature (no alignment or divisibility, ``scale`` typed fp64), the table kernels needed up to 1.8 times less
shared memory than the launch's and showed no spill where the launch's spill. A row is a finding when the kernel does
not compile, needs more shared memory than the device has, or spills (``failures``). Triton must not be in
interpreter mode in this process: ``python -m posenc.lane`` runs it in workers of its own.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch

from posenc.attention import triton_table
from posenc.attention.triton_launch import (
    KERNEL_FUNCTIONS,
    KERNELS,
    Launch,
    backward_launches,
    forward_launch,
    kernels,
    stick_backward_launch,
    stick_forward_launch,
    table_gradient_buffer,
)
from posenc.lane.fake import installed
from posenc.lane.gpus import GPU, ptxas_report

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # fp16 compiles as bf16 does: the same tiles and bytes
HEAD_DIMS = (64, 128)
# Triton specialises a launch on its integers (divisible by 16, or 1): a length that is a multiple of 16 and one
# that is not compile to different code. Twelve heads: the bias decomposition's, neither 1 nor a multiple of 16.
LENGTHS = (2048, 2047)
DIVISIBLE = ["tt.divisibility", 16]  # how Triton marks an argument it specialised as divisible by 16
HEADS = 12
# Stick-breaking's kernels as the lane names them: the forward once per target of the remainder.
LANE_STICK_KERNELS = ("stick_forward", "stick_forward_own_value", "stick_backward")
# The table kernels of a local (sliding-window) layer: compiled with their window's mask and loop bounds (``LOCAL``),
# another kernel than a global layer's. Launched with a window of a quarter of the length.
LOCAL = "_local"
LANE_LOCAL_KERNELS = tuple(kernel + LOCAL for kernel in KERNELS)


def units(dtypes: list[str] | None = None, head_dims: list[int] | None = None) -> list[tuple[str, str, int, int]]:
    """Every (kernel, dtype, head dim, length) the lane compiles for each GPU: the table kernels', then the stick's."""
    every = (KERNELS + LANE_LOCAL_KERNELS + LANE_STICK_KERNELS, dtypes or list(DTYPES), head_dims or list(HEAD_DIMS))
    every = (*every, LENGTHS)
    return list(itertools.product(*every))


def launch(kernel: str, dtype: str, head_dim: int, length: int, gpu: GPU) -> Launch:
    """The launch the backend makes for ``kernel`` on ``gpu``, on meta tensors of one representative shape.

    Built by the backend's own functions (``triton_launch``), so the grid, the arguments (their dtypes, strides and
    sizes, on which Triton specialises) and the constexprs are a launch's; meta tensors have no storage and an
    address of 0, aligned as every CUDA allocation is.
    """
    capability = (gpu.major, gpu.minor)
    shape = (1, HEADS, length, head_dim)

    def tensor(*size: int, fp32: bool = False) -> torch.Tensor:
        return torch.empty(size, dtype=torch.float32 if fp32 else DTYPES[dtype], device="meta")

    q, k, v, out, dout, dq, dk, dv = (tensor(*shape) for _ in range(8))
    lse, delta, table = tensor(*shape[:-1], fp32=True), tensor(*shape[:-1], fp32=True), tensor(HEADS, length, fp32=True)
    if kernel in LANE_STICK_KERNELS:
        return stick_launch(kernel, q, k, v, dout, capability)
    window = length // 4 if kernel.endswith(LOCAL) else None
    kernel = kernel.removesuffix(LOCAL)
    if kernel == "forward":
        return forward_launch(q, k, v, out, lse, table, capability, window)
    deterministic = kernel == "backward_dq_deterministic"
    tensors = {"q": q, "k": k, "v": v, "dout": dout, "lse": lse, "delta": delta, "dq": dq, "dk": dk, "dv": dv}
    tensors["dtable"] = table_gradient_buffer(q, deterministic, True, capability, window is not None)
    dq_launch, dkdv_launch = backward_launches(tensors, table, True, deterministic, capability, window)
    return dkdv_launch if kernel == "backward_dkdv" else dq_launch


def planned_kernel(kernel: str) -> str:
    """The backend's name of a kernel the lane names (``triton_launch.KERNEL_FUNCTIONS``'s keys)."""
    return "stick_forward" if kernel == "stick_forward_own_value" else kernel.removesuffix(LOCAL)


def stick_launch(
    kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, capability: tuple[int, int]
) -> Launch:
    """Stick-breaking's launch: the forward's remainder on the head's vector, or (``_own_value``) the query's value."""
    if kernel.startswith("stick_forward"):
        own_value = kernel.endswith("own_value")
        head_bias = None if own_value else torch.empty(q.shape[1], q.shape[-1], dtype=q.dtype, device="meta")
        return stick_forward_launch(q, k, v, head_bias, torch.empty_like(q), capability)
    fp32 = {"dtype": torch.float32, "device": "meta"}
    tensors = {"q": q, "k": k, "v": v, "dout": dout, "dq": torch.empty_like(q)}
    tensors.update({"delta": torch.empty(q.shape[:-1], **fp32), "remainder": torch.empty(q.shape[:-1], **fp32)})
    tensors.update({"dk": torch.empty(q.shape, **fp32), "dv": torch.empty(q.shape, **fp32)})
    return stick_backward_launch(tensors, capability)


def compile_kernel(
    kernel: str, dtype: str, head_dim: int, length: int, gpu: GPU, registers: bool = True
) -> dict[str, Any]:
    """One row: the kernel compiled as its launch on ``gpu`` would compile it, or why the backend refuses it.

    Through Triton's own ``warmup``, which binds the launch's arguments, specialises on them and compiles for the
    active driver's target (the fake ``gpu``, ``posenc.lane.fake``) without launching.
    """
    row: dict[str, Any] = {"gpu": gpu.key, "kernel": kernel, "dtype": dtype, "head_dim": head_dim, "length": length}
    try:
        triton_table.check_shape(head_dim, DTYPES[dtype])
    except ValueError as refusal:
        return {**row, "refused": str(refusal)}
    if installed() != gpu:
        raise RuntimeError(f"this process pretends to be {installed().key}, not {gpu.key}")
    module = kernels(planned_kernel(kernel))
    if module.INTERPRETED:
        raise RuntimeError("the kernels were imported under TRITON_INTERPRET=1: compile them with the variable unset")
    started = time.perf_counter()
    planned = launch(kernel, dtype, head_dim, length, gpu)
    function = getattr(module, KERNEL_FUNCTIONS[planned.kernel])
    try:
        compiled = function.warmup(*planned.args, grid=planned.grid, **planned.constexprs)
    except Exception as error:  # a kernel that does not compile is the finding
        return {**row, "error": (str(error).strip().splitlines() or [type(error).__name__])[0][:300]}
    used, spills = ptxas_report(compiled.asm["ptx"], gpu.arch) if registers else (None, None)
    names = function.arg_names
    return {
        **row,
        # What Triton specialised on: the arguments it compiled as divisible by 16, and the type it gave ``scale``.
        "divisible": sorted(names[path[0]] for path, attrs in compiled.src.attrs.items() if DIVISIBLE in attrs),
        "scale_type": compiled.src.signature["scale"],
        "block_m": planned.constexprs["BLOCK_M"],
        "block_n": planned.constexprs["BLOCK_N"],
        "num_warps": compiled.metadata.num_warps,
        "num_stages": compiled.metadata.num_stages,
        "shared": compiled.metadata.shared,
        "limit": gpu.shared_memory_per_block_optin,
        "registers": used,
        "spills": spills,
        "seconds": round(time.perf_counter() - started, 2),
    }


def failures(rows: list[dict[str, Any]]) -> list[str]:
    """One line per table kernel that did not compile, overflows its device's shared memory, or spills."""
    found = []
    for row in rows:
        where = f"{row['gpu']}: table kernel {row['kernel']} {row['dtype']} d{row['head_dim']} L{row['length']}"
        if "refused" in row:
            continue
        if "error" in row:
            found.append(f"{where}: {row['error']}")
            continue
        if row["shared"] > row["limit"]:
            found.append(f"{where}: needs {row['shared']} B of shared memory, the device has {row['limit']} B")
        if row["spills"]:
            found.append(f"{where}: spills {row['spills']} B of registers")
    return found


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The docs' section on the table kernels: one line per (GPU, kernel, dtype, head dim, length)."""
    lines = [
        "",
        "## The kernels of `attention=triton`, per GPU",
        "",
        "One compile per table kernel covers every distance-only bias (the kernels read the scheme's (H, L) table,",
        "never its formula). Each is compiled as its launch compiles it (`triton_launch`: that GPU class's tiles,",
        "warps and stages; twelve heads; a length divisible by 16 and one that is not, on which Triton specialises);",
        "`backward_dq_deterministic` is the table gradient without atomics (`torch.use_deterministic_algorithms`).",
        "The `stick_` kernels are stick-breaking's (a scheme's `stick_form`), its forward with the remainder on the",
        "head's vector and (`_own_value`) on the query's own value.",
        "",
        "| GPU | kernel | dtype | head dim | length | tiles (M × N) | warps | stages | shared memory (B) | registers "
        "| spilled (B) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        head = f"| {row['gpu']} | {row['kernel']} | {row['dtype']} | {row['head_dim']} | {row['length']} |"
        if "refused" in row or "error" in row:
            what = "refused by the backend" if "refused" in row else f"FAILED: {row['error']}"
            lines.append(f"{head} {what} | | | | | |")
            continue
        registers = "?" if row["registers"] is None else row["registers"]
        spills = "?" if row["spills"] is None else row["spills"]
        lines.append(
            f"{head} {row['block_m']} × {row['block_n']} | {row['num_warps']} | {row['num_stages']} | "
            f"{row['shared']} | {registers} | {spills} |"
        )
    return lines
