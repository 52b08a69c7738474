"""Timing one attention call: the helpers ``posenc.bench`` and the GPU tests share, and the unbiased references.

A ratio "× the fastest unbiased attention" is only honest if the denominator really is the fastest that torch
offers on the machine at hand; the references below are each timed in the same process, and the winner per mode
(forward, forward+backward) divides every scheme's time.
"""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch.nn.attention import SDPBackend, sdpa_kernel

from posenc.attention import get_backend
from posenc.encodings import build
from posenc.encodings.base import PositionalEncoding


def resolve_device(name: str) -> torch.device:
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


# Unbiased causal attention held to one SDPA kernel. Which is fastest depends on the GPU, the head dim and torch's
# version (published H100 figures put SDPA's flash kernel, FlashAttention-2, 1.6-1.7x behind cuDNN's for training
# shapes), so the benchmark times each one it can run and divides by the winner, not by what SDPA dispatches to.
SDPA_KERNELS = {
    "sdpa:flash": SDPBackend.FLASH_ATTENTION,
    "sdpa:cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa:efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def reference_backends(setting: str | list[str], device: torch.device) -> list[str]:
    """The unbiased kernels NoPE is timed through, the fastest per mode being every ratio's denominator.

    ``auto`` on CUDA: SDPA as it dispatches, SDPA held to each of its flash, cuDNN and memory-efficient kernels,
    and FlexAttention without a score_mod. On CPU: SDPA as it dispatches and held to its flash kernel; FlexAttention
    is left out there, since it runs uncompiled on CPU (materialising every score) and has no CPU backward.
    """
    if setting != "auto":
        return list(setting)
    if device.type != "cuda":
        return ["sdpa", "sdpa:flash"]
    return ["sdpa", "sdpa:flash", "sdpa:cudnn", "sdpa:efficient", "flex"]


def fastest(rows: list[dict[str, Any]], mode: str) -> dict[str, Any] | None:
    """The row with the shortest ``mode`` time among those that ran (None if none did)."""
    timed = [row for row in rows if f"{mode}_ms" in row]
    return min(timed, key=lambda row: row[f"{mode}_ms"]) if timed else None


def median_ms(
    fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int, budget_s: float = float("inf")
) -> float:
    """Median wall time of ``fn`` in ms: CUDA events on a GPU, ``perf_counter`` on CPU.

    Timing stops early, after at least three calls, once ``budget_s`` is spent: a case seconds long (the atomics
    backward this benchmark exists to show) does not need ten repeats to be told apart from one taking ms.
    """
    for _ in range(warmup):
        fn()
    times: list[float] = []
    for _ in range(repeats):
        if len(times) >= 3 and sum(times) > budget_s * 1e3:
            break
        times.append(timed_ms(fn, device))
    return statistics.median(times)


def timed_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """One call of ``fn`` in ms: between CUDA events on a GPU (the queue drained before and after), else wall time."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1e3


def peak_mib(fn: Callable[[], Any], device: torch.device) -> float | None:
    """Peak CUDA memory of one call of ``fn`` above what was allocated before it (None on CPU: not measured)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def failure(err: BaseException) -> str:
    """A case's cause for its table cell: the exception's type and its first lines that say something.

    Not only the first line: a compile error's first line is often a header (dynamo's ``backend='inductor'
    raised:``), and the cause (Triton's ``at 12:4: ...``) follows it. The whole exception and its traceback go to
    the record and the log (``record_failure``).
    """
    if isinstance(err, torch.cuda.OutOfMemoryError):
        torch.cuda.empty_cache()
        return "OOM"
    lines = [line.strip() for line in str(err).splitlines() if line.strip() and not line.strip().endswith("raised:")]
    return f"{type(err).__name__}: {' / '.join(lines)}"[:FAILURE_CHARS]


FAILURE_CHARS = 300  # a table cell's share of a failure; the record keeps the whole of it
TRACEBACK_CHARS = 20_000  # the end of a traceback, where the cause is, kept in the record


def record_failure(row: dict[str, Any], key: str, err: BaseException) -> None:
    """Why a case failed, kept whole: ``row[key]`` the table's cause, ``row[<key>_traceback]`` the traceback.

    Why whole: a GPU is lent for minutes and returns a few files, so a failure whose cause was cut off costs a
    second lease just to read it. The traceback is also printed, so the step's log holds it too.
    """
    row[key] = failure(err)
    trace = "".join(traceback.format_exception(err))[-TRACEBACK_CHARS:]
    row[f"{key}_traceback"] = trace
    print(f"--- {key} of {row.get('item') or row.get('scheme') or 'a case'}: {row[key]}\n{trace}", flush=True)


def attention_call(
    encoding: PositionalEncoding, backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> Callable[[], torch.Tensor]:
    """One attention layer's positional work: the scheme's rotation, then the backend with its bias.

    ``backend`` is a posenc backend, or one of the ``SDPA_KERNELS`` (SDPA held to one kernel, no bias: the
    references, for NoPE only). A scheme that reads the layer's input computes its features from a random input
    inside the timed call, as the attention layer does.
    """
    if backend in SDPA_KERNELS:
        if encoding.adds_bias or encoding.adds_content_bias or encoding.rotates or encoding.supplies_attention:
            raise ValueError(
                f"{backend} is a reference without a bias or rotation (a plain softmax); {encoding.name} is not"
            )
        kernel = SDPA_KERNELS[backend]

        def reference() -> torch.Tensor:
            with sdpa_kernel(kernel):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        return reference
    attend = get_backend(backend)
    batch, heads, length, head_dim = q.shape
    pos = torch.arange(length, device=q.device)
    reads_input = encoding.reads_layer_input
    x = torch.randn(batch, length, heads * head_dim, device=q.device, dtype=q.dtype) if reads_input else None

    def call() -> torch.Tensor:
        rotated_q, rotated_k = encoding.rotate(q, k, pos, pos)
        features = encoding.token_features(x) if x is not None else None
        return attend(rotated_q, rotated_k, v, encoding, pos, pos, features=features)

    return call


def measure_attention(scheme: str, backend: str, length: int, cfg: DictConfig, device: torch.device) -> dict:
    """Forward (no grad) and forward+backward of one scheme × backend at one length."""
    heads, head_dim = cfg.attention.heads, cfg.attention.head_dim
    batch = max(1, cfg.attention.tokens // length)
    dtype = resolve_dtype(cfg.dtype, device)
    row: dict[str, Any] = {"scheme": scheme, "backend": backend, "length": length, "batch": batch}
    encoding = build(scheme, num_heads=heads, head_dim=head_dim).to(device)
    shape = (batch, heads, length, head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(shape, device=device, dtype=dtype)
    call = attention_call(encoding, backend, q, k, v)

    def forward() -> None:
        with torch.no_grad():
            call()

    def train() -> None:
        call().backward(grad_out)
        for tensor in (q, k, v, *encoding.parameters()):
            tensor.grad = None

    tokens = batch * length
    for mode, fn in (("forward", forward), ("train", train)):
        try:
            row[f"{mode}_ms"] = median_ms(fn, device, cfg.warmup, cfg.repeats, cfg.case_budget_s)
            row[f"{mode}_tokens_per_s"] = tokens / row[f"{mode}_ms"] * 1e3
            row[f"{mode}_peak_mib"] = peak_mib(fn, device)
        except Exception as err:  # a refused or failed case is a result, reported as such
            record_failure(row, f"{mode}_error", err)
    return row
