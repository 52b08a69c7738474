"""How posenc runs on the device at hand: its CUDA-only branches, fp32 under autocast, compiled modules run eagerly.

Several fast paths exist only on CUDA: FlexAttention compiled once per process, ``auto`` sending biased schemes to
``flex`` or ``flex_learnable``, the fused rotation kernel. Each asks ``cuda_path(tensor)`` rather than
``tensor.is_cuda``, so the CPU test suite can take exactly those branches (``forced_cuda_path``) and see, without a
GPU, how a compiled block traces on a GPU: its graph breaks, and its values and gradients under
``torch.compile(backend="aot_eager")``. Nothing in a normal run forces the switch.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from torch import Tensor, nn

Fn = TypeVar("Fn", bound=Callable)

_forced = False


def cuda_path(tensor: Tensor) -> bool:
    """Whether computations on ``tensor`` take the CUDA-only branches: on CUDA, or on CPU while forced."""
    return tensor.is_cuda or _forced


@contextlib.contextmanager
def forced_cuda_path() -> Iterator[None]:
    """Take the CUDA-only branches for CPU tensors inside the ``with`` (tests: what a GPU would trace)."""
    global _forced
    previous, _forced = _forced, True
    try:
        yield
    finally:
        _forced = previous


@contextlib.contextmanager
def eager_modules(model: nn.Module) -> Iterator[None]:
    """Run every module compiled with ``nn.Module.compile`` uncompiled inside the ``with``.

    ``nn.Module.compile`` keeps the compiled call in ``_compiled_call_impl`` and uses it when set; clearing it for
    the duration and restoring it after is the one per-module switch torch offers. ``torch.compiler``'s stances are
    process-wide: ``set_stance("force_eager")`` would also run FlexAttention's compiled kernel unfused, which
    materialises every score (and which posenc refuses on CUDA). Used by evaluation and by the attention probes,
    whose forward hooks must fire.
    """
    compiled = {module: module._compiled_call_impl for module in model.modules() if module._compiled_call_impl}
    for module in compiled:
        module._compiled_call_impl = None
    try:
        yield
    finally:
        for module, call in compiled.items():
            module._compiled_call_impl = call


def full_precision(fn: Fn) -> Fn:
    """Run ``fn`` with autocast off, so the fp32 arithmetic it is written in stays fp32 under bf16-mixed training.

    Autocast rewrites matmul-like ops (``einsum``, ``matmul``, ``linear``) to bf16 whatever their inputs: a
    ``.float()`` before them does not keep them in fp32. Bias arithmetic, the softmax backward's per-row terms and
    the dense reference are meant in fp32 (distances past 256 are not exact in bf16), so each such function is
    wrapped; under torch.compile the context is traced into the graph, custom backwards included.
    """

    @functools.wraps(fn)
    def in_fp32(*args: object, **kwargs: object) -> object:
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return fn(*args, **kwargs)

    return in_fp32  # type: ignore[return-value]


def resolve_precision(requested: str, accelerator: str) -> str:
    """``auto`` → bf16-mixed where a CUDA GPU supports bf16, fp32 everywhere else (CPU bf16 is slow)."""
    if requested != "auto":
        return requested
    on_gpu = accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()
    return "bf16-mixed" if on_gpu and torch.cuda.is_bf16_supported() else "32-true"


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16}  # Lightning's precision, by its number
FULL_PRECISIONS = ("32", "64")


def precision_context(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """What Lightning's ``precision`` setting runs a forward under: autocast for the half precisions, else nothing.

    Evaluation uses it so that a model is scored in the precision it trained in (``bf16-mixed`` on a GPU), not in
    fp32: the in-length figure then matches training's, and a backend that needs half precision (the ``triton``
    table kernels past head dim 64) runs as it did in training.
    """
    number = str(precision).split("-")[0]
    if number in FULL_PRECISIONS:
        return contextlib.nullcontext()
    if number not in AUTOCAST_DTYPES:
        raise ValueError(f"unknown trainer.precision {precision!r}: use 32-true, bf16-mixed or 16-mixed")
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[number])


def softplus(z: Tensor) -> Tensor:
    """log(1 + eᶻ), written as −log σ(−z), the same number: what a scheme uses for a softplus of activations.

    torch 2.13's compiled backward of ``F.softplus`` (and of −softplus) over activations fails with a view of a
    non-contiguous gradient in the CUDA-path training step; log σ's does not.
    """
    return -torch.nn.functional.logsigmoid(-z)
