"""The ``triton`` backend's table kernels compiled for each GPU of the lane, with the tiles the backend launches there.

The kernels do not depend on the scheme: every distance-only bias, learnable or not, reaches them as one (H, L) table,
so one compile per (GPU, kernel, dtype, head dim) covers KERPLE, T5, ALiBi, Sandwich and their stacks alike. Each
kernel is compiled by Triton for the GPU's target with ``triton_table.launch_config`` for that GPU class, and ptxas
(the one in Triton's wheel) reports its registers and spilled bytes. A row is a finding when the kernel does not
compile, needs more shared memory than the device has, or spills (``failures``). Triton must not be in interpreter
mode in this process: ``python -m posenc.lane`` runs it in workers of its own.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch

from posenc.attention import triton_table
from posenc.lane.gpus import GPU, ptxas_report

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # fp16 compiles as bf16 does: the same tiles and bytes
HEAD_DIMS = (64, 128)


def units(dtypes: list[str] | None = None, head_dims: list[int] | None = None) -> list[tuple[str, str, int]]:
    """Every (kernel, dtype, head dim) the lane compiles for each GPU."""
    return list(itertools.product(triton_table.KERNELS, dtypes or list(DTYPES), head_dims or list(HEAD_DIMS)))


def _signature(kernel: Any, dtype: str, constexprs: dict[str, Any]) -> dict[str, str]:
    """Triton's argument types: the data tensors in ``dtype``, lse, Δ and the table's tensors fp32, sizes int32.

    ``scale`` is fp64, as Inductor types a Python float on a device with fp64: a kernel that let it promote its fp32
    loop state failed there, never under Triton's own fp32 typing.
    """
    fp32 = {"Lse", "Delta", "Table", "DTable"}
    pointers = {"Q", "K", "V", "Out", "DOut", "DQ", "DK", "DV"}
    signature = {}
    for arg in kernel.arg_names:
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg in fp32:
            signature[arg] = "*fp32"
        elif arg in pointers:
            signature[arg] = f"*{dtype}"
        else:
            signature[arg] = "fp64" if arg == "scale" else "i32"
    return signature


def compile_kernel(kernel: str, dtype: str, head_dim: int, gpu: GPU, registers: bool = True) -> dict[str, Any]:
    """One row: the kernel compiled for ``gpu`` with its launch configuration there, or why the backend refuses it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    row: dict[str, Any] = {"gpu": gpu.key, "kernel": kernel, "dtype": dtype, "head_dim": head_dim}
    try:
        triton_table.check_shape(head_dim, DTYPES[dtype])
    except ValueError as refusal:
        return {**row, "refused": str(refusal)}
    config = triton_table.launch_config(DTYPES[dtype], head_dim, kernel, (gpu.major, gpu.minor))
    options = {"num_warps": config.pop("num_warps"), "num_stages": config.pop("num_stages")}
    module = triton_table.kernels()
    if module.INTERPRETED:
        raise RuntimeError("the kernels were imported under TRITON_INTERPRET=1: compile them with the variable unset")
    function = {"forward": module.forward_kernel, "backward_dkdv": module.backward_dkdv_kernel}.get(
        kernel, module.backward_dq_kernel
    )
    constexprs = {**config, "HAS_BIAS": True}
    if function is module.backward_dq_kernel:
        constexprs |= {"BIAS_GRAD": True, "DETERMINISTIC": kernel == "backward_dq_deterministic"}
    started = time.perf_counter()
    source = ASTSource(fn=function, signature=_signature(function, dtype, constexprs), constexprs=constexprs)
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", gpu.arch, gpu.warp_size), options=options)
    except Exception as error:  # a kernel that does not compile is the finding
        return {**row, "error": (str(error).strip().splitlines() or [type(error).__name__])[0][:300]}
    used, spills = ptxas_report(compiled.asm["ptx"], gpu.arch) if registers else (None, None)
    return {
        **row,
        "block_m": config["BLOCK_M"],
        "block_n": config["BLOCK_N"],
        **options,
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
        where = f"{row['gpu']}: table kernel {row['kernel']} {row['dtype']} d{row['head_dim']}"
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
    """The docs' section on the table kernels: one line per (GPU, kernel, dtype, head dim)."""
    lines = [
        "",
        "## The table kernels of `attention=triton`, per GPU",
        "",
        "One compile per kernel covers every distance-only bias (the kernels read the scheme's (H, L) table, never",
        "its formula). Tiles and warps are `triton_table.launch_config`'s for that GPU class;",
        "`backward_dq_deterministic` is the table gradient without atomics (`torch.use_deterministic_algorithms`).",
        "",
        "| GPU | kernel | dtype | head dim | tiles (M × N) | warps | stages | shared memory (B) | registers "
        "| spilled (B) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        head = f"| {row['gpu']} | {row['kernel']} | {row['dtype']} | {row['head_dim']} |"
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
