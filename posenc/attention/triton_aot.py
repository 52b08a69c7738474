"""Compile the ``triton`` backend's kernels ahead of time for an H100 (sm_90), on any machine, GPU or not.

    python -m posenc.attention.triton_aot               # kernel, dtype, BLOCK_D, warps, shared memory
    python -m posenc.attention.triton_aot --registers   # ... and ptxas's registers and spills (slower)
    python -m posenc.attention.triton_aot --json        # the rows as JSON (what the CPU test suite reads)

Why: Triton's interpreter (``TRITON_INTERPRET=1``), which the CPU tests use for values and gradients, runs the
kernels as Python, so it accepts kernels that do not compile (a module global read inside ``@triton.jit``) and
knows no shared-memory limit. Triton compiles for a named GPU target without the GPU: its wheel ships ``ptxas``.
Every kernel is compiled for every dtype and every BLOCK_D the backend admits, with the launch configuration the
backend uses (``launch_config``); a shape the backend refuses up front is listed as refused. The interpreter must
be off in this process (Triton decides at import time), so the test suite runs this module in a subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

import torch

from posenc.attention import triton_table

H100 = 90  # compute capability of the GPU the kernels are compiled for
H100_SHARED_MEMORY = 232_448  # bytes per block an H100 kernel may use (227 KiB, the opt-in maximum)
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def block_dims() -> list[int]:
    """Every BLOCK_D an admitted head dim maps to (head dims are padded to a power of 2)."""
    sizes = range(triton_table.MIN_HEAD_DIM, triton_table.MAX_HEAD_DIM + 1)
    return sorted({triton_table.launch_config(torch.float32, size)["BLOCK_D"] for size in sizes})


def _kernels(dtype: str) -> dict[str, tuple[Any, dict[str, str], dict[str, Any]]]:
    """Each kernel, its pointer arguments' types and the constexprs it takes beyond the launch configuration."""
    module = triton_table.kernels()
    data, fp32 = f"*{dtype}", "*fp32"
    qkv = {"Q": data, "K": data, "V": data}
    grads = {"DOut": data, "Lse": fp32, "Delta": fp32}
    return {
        "forward": (module.forward_kernel, {**qkv, "Out": data, "Lse": fp32, "Table": fp32}, {}),
        "backward_dq": (
            module.backward_dq_kernel,
            {**qkv, **grads, "DQ": data, "Table": fp32, "DTable": fp32},
            {"BIAS_GRAD": True, "WIDTH": triton_table.diagonal_width()},
        ),
        "backward_dkdv": (module.backward_dkdv_kernel, {**qkv, **grads, "DK": data, "DV": data, "Table": fp32}, {}),
    }


def _ptxas_report(ptx: str, arch: int) -> str:
    """Registers and spilled bytes as ptxas reports them (the ptxas Triton itself uses for this GPU)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "kernel.ptx")
        with open(source, "w") as file:
            file.write(ptx)
        result = subprocess.run(
            [ptxas, "-v", f"--gpu-name=sm_{arch}a", source, "-o", os.devnull], capture_output=True, text=True
        )
    registers = re.search(r"Used (\d+) registers", result.stderr)
    spills = re.search(r"(\d+) bytes spill stores", result.stderr)
    return f"{registers.group(1) if registers else '?'} registers, {spills.group(1) if spills else '?'} B spilled"


def compile_all(arch: int = H100, registers: bool = False) -> list[dict[str, Any]]:
    """One row per (kernel, dtype, BLOCK_D): ``shared`` bytes (and ptxas's report), or ``refused`` with the message."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if triton_table.kernels().INTERPRETED:
        raise RuntimeError("the kernels were imported under TRITON_INTERPRET=1: run this with the variable unset")
    rows = []
    for dtype in triton_table.DTYPES:
        for block_d in block_dims():
            try:
                triton_table.check_shape(block_d, dtype)
            except ValueError as refusal:
                rows.append({"dtype": DTYPE_NAMES[dtype], "block_d": block_d, "refused": str(refusal)})
                continue
            config = triton_table.launch_config(dtype, block_d)
            options = {"num_warps": config.pop("num_warps"), "num_stages": config.pop("num_stages")}
            for name, (kernel, pointers, extra) in _kernels(DTYPE_NAMES[dtype]).items():
                constexprs = {**config, "HAS_BIAS": True, **extra}
                # ``scale`` as fp64: Inductor types a Python float argument so on a device with fp64, and a kernel
                # that let it promote its fp32 loop state failed there, never under Triton's own fp32 typing.
                signature = {
                    arg: "constexpr" if arg in constexprs else pointers.get(arg, "fp64" if arg == "scale" else "i32")
                    for arg in kernel.arg_names
                }
                source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
                compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
                rows.append(
                    {
                        "kernel": name,
                        "dtype": DTYPE_NAMES[dtype],
                        "block_d": block_d,
                        **options,
                        "shared": compiled.metadata.shared,
                        "ptxas": _ptxas_report(compiled.asm["ptx"], arch) if registers else "",
                    }
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m posenc.attention.triton_aot", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--registers", action="store_true", help="add ptxas's registers and spills per kernel")
    args = parser.parse_args(argv)
    try:
        rows = compile_all(registers=args.registers)
    except (RuntimeError, ImportError) as error:
        print(f"triton_aot: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rows))
        return 0
    over = 0
    for row in rows:
        head = f"{row.get('kernel', '(all)'):14s} {row['dtype']} BLOCK_D={row['block_d']:<4d}"
        if "refused" in row:
            print(f"{head} refused by the backend: {row['refused']}")
            continue
        fits = row["shared"] <= H100_SHARED_MEMORY
        over += not fits
        verdict = "fits" if fits else f"OVER the H100's {H100_SHARED_MEMORY}"
        print(f"{head} warps={row['num_warps']} shared={row['shared']:>6d} B ({verdict})  {row['ptxas']}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
