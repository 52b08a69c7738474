"""The kernel lane: what a GPU would compile, checked on a machine without one.

Triton compiles for a named GPU target with the ``ptxas`` its wheel ships, and Inductor generates its CUDA kernels
for whatever device torch reports. This package makes torch and Triton report a GPU that is not there (``fake``),
has Inductor generate the FlexAttention kernels (forward, backward, and the kernels around them) of every path a
scheme can take on CUDA, and has Triton compile them for that GPU (``flex``). Nothing is launched: what it checks is
that each kernel is generated, compiles, and fits the device's shared memory, and how many registers it spills.
``python -m posenc.lane`` runs it and prints (or writes) the table.

It reaches into torch's internals, so it runs only under the versions it was written for (``PINNED``): the GPU
image's torch and triton, installed in an environment of their own (README, "GPU check").
"""

from __future__ import annotations

PINNED = {"torch": "2.11.0+cu130", "triton": "3.6.0"}


def version_mismatch() -> str | None:
    """A one-line reason this environment cannot run the lane, or ``None`` when it can."""
    try:
        import torch
        import triton
    except ImportError as error:
        return f"the kernel lane needs torch and triton ({error})"
    found = {"torch": torch.__version__, "triton": triton.__version__}
    if found != PINNED:
        wanted = ", ".join(f"{name} {version}" for name, version in PINNED.items())
        have = ", ".join(f"{name} {version}" for name, version in found.items())
        return f"the kernel lane runs under {wanted} (the GPU image's versions), not {have}"
    return None
