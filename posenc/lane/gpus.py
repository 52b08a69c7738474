"""The GPUs the lane compiles for: what torch and Triton would read off each, and ptxas's report on a kernel.

Three devices span what researchers train on: an H100 (Hopper, the largest shared memory), an A100 (Ampere), and an
L4, which has the same compute capability and per-block shared memory as an RTX 4090 (Ada) and the least of the
three. Shared memory is the opt-in maximum per block (``cudaDevAttrMaxSharedMemoryPerBlockOptin``), the figure a
kernel's launch is checked against.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    """The device properties Inductor and Triton read (``torch.cuda.get_device_properties`` and Triton's driver)."""

    key: str
    name: str
    major: int
    minor: int
    shared_memory_per_block_optin: int
    shared_memory_per_multiprocessor: int
    multi_processor_count: int
    max_threads_per_multi_processor: int
    total_memory: int
    L2_cache_size: int
    clock_rate: int  # kHz
    memory_clock_rate: int  # kHz
    memory_bus_width: int
    warp_size: int = 32
    max_threads_per_block: int = 1024
    regs_per_multiprocessor: int = 65_536
    shared_memory_per_block: int = 49_152

    @property
    def arch(self) -> int:
        """Compute capability as Triton's target names it (90 for 9.0)."""
        return self.major * 10 + self.minor


GPUS = {
    gpu.key: gpu
    for gpu in (
        GPU("h100", "NVIDIA H100 80GB HBM3", 9, 0, 232_448, 233_472, 132, 2048, 85_045_477_376, 52_428_800,
            1_980_000, 2_619_000, 5120),
        GPU("a100", "NVIDIA A100-SXM4-80GB", 8, 0, 166_912, 167_936, 108, 2048, 85_100_000_000, 41_943_040,
            1_410_000, 1_593_000, 5120),
        GPU("l4", "NVIDIA L4", 8, 9, 101_376, 102_400, 58, 1536, 23_580_000_000, 50_331_648,
            2_040_000, 6_251_000, 192),
    )
}  # fmt: skip


def ptxas_report(ptx: str, arch: int) -> tuple[int | None, int | None]:
    """(registers, spilled bytes) of a PTX kernel, from the ptxas in Triton's wheel, as loading it on ``arch`` would."""
    from triton.backends.nvidia.compiler import get_ptxas

    suffix = "a" if arch >= 90 else ""  # Hopper's kernels use sm_90a features (wgmma, TMA)
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "kernel.ptx")
        with open(source, "w") as file:
            file.write(ptx)
        result = subprocess.run(
            [get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}{suffix}", source, "-o", os.devnull],
            capture_output=True,
            text=True,
        )
    registers = re.search(r"Used (\d+) registers", result.stderr)
    spills = re.search(r"(\d+) bytes spill stores", result.stderr)
    return (int(registers.group(1)) if registers else None, int(spills.group(1)) if spills else None)
