"""The fused table kernel's values where it runs: its output and every gradient against the dense fp32 reference.

Why in the bias stage: the suite runs the kernels on CPU under Triton's interpreter, in fp32 and fp16 at small
shapes; the compiled kernel in bf16, at head dim 128, in its deterministic mode and at a length that is not a
multiple of its tiles runs on a GPU or nowhere. So before the stage times the kernel it checks it, at each head dim
of ``bias.check_head_dims``, at ``bias.length`` and one less (a multiple of no tile), with atomics and
deterministically: the output, dq, dk, dv and the gradient of every parameter of the scheme (KERPLE-log's, through
its table), all from one output gradient.

The rule is FlashAttention's own test: against the eager backend in fp32 (on the same inputs, upcast), the fused
kernel's largest error in each tensor may be at most twice that of the same attention computed densely in the
inputs' dtype (``dense``), plus 1e-5 of the reference's largest entry (FlashAttention adds 1e-5 absolute; relative
here, since in fp32 the dense path can be exact and a parameter's gradient sums thousands of scores). Each row records
both errors, relative to the reference's largest entry.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor

from posenc.attention import get_backend
from posenc.bench.attention import record_failure, resolve_dtype
from posenc.encodings import build
from posenc.encodings.base import PositionalEncoding

SLACK = (
    1e-5  # the error allowed beyond twice the dense path's, of the reference's largest entry (fp32's dense is exact)
)


def dense(q: Tensor, k: Tensor, v: Tensor, encoding: PositionalEncoding, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """softmax(q·kᵀ/√D + bias) v, causal, every product in the inputs' dtype: the baseline a fused kernel must match."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    scores = scores + encoding.bias(q_pos, k_pos).to(q.dtype)
    causal = k_pos[None, :] <= q_pos[:, None]
    return torch.matmul(scores.masked_fill(~causal, float("-inf")).softmax(dim=-1), v)


def _gradients(
    attend: Callable[..., Tensor], encoding: PositionalEncoding, inputs: tuple[Tensor, ...], dout: Tensor
) -> dict[str, Tensor]:
    """The output and the gradients of q, k, v and of every trainable parameter of ``encoding``."""
    q, k, v = (t.detach().clone().requires_grad_() for t in inputs)
    encoding.zero_grad(set_to_none=True)
    pos = torch.arange(q.shape[-2], device=q.device)
    out = attend(q, k, v, encoding, pos, pos)
    out.backward(dout.to(out.dtype))
    found = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    for name, parameter in encoding.named_parameters():
        if parameter.requires_grad:
            found[f"d{name}"] = parameter.grad.detach().clone()
    return found


def check(
    encoding: PositionalEncoding, batch: int, length: int, head_dim: int, dtype: torch.dtype, deterministic: bool
) -> dict[str, Any]:
    """One case: the fused kernel (``attention=triton``), the dense path and the fp32 reference on the same inputs."""
    device = next(encoding.parameters()).device
    generator = torch.Generator(device=device).manual_seed(length * 1000 + head_dim)
    shape = (batch, encoding.num_heads, length, head_dim)
    inputs = tuple(torch.randn(shape, device=device, generator=generator).to(dtype) for _ in range(3))
    dout = torch.randn(shape, device=device, generator=generator)
    reference = _gradients(get_backend("eager"), encoding, tuple(t.float() for t in inputs), dout)
    baseline = _gradients(dense, encoding, inputs, dout)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        fused = _gradients(get_backend("triton"), encoding, inputs, dout)
    finally:
        torch.use_deterministic_algorithms(previous)
    errors = {}
    for name, expected in reference.items():
        scale = expected.float().abs().max().item() or 1.0
        got = (fused[name].float() - expected.float()).abs().max().item()
        allowed = (baseline[name].float() - expected.float()).abs().max().item()
        errors[name] = {"fused": got / scale, "dense": allowed / scale, "ok": got <= 2 * allowed + SLACK * scale}
    return {"errors": errors, "ok": all(e["ok"] for e in errors.values())}


def value_checks(cfg: DictConfig, device: torch.device) -> list[dict[str, Any]]:
    """Every case of the module docstring, each a row (or its failure, with its traceback, in the row and the log)."""
    bias = cfg.bias
    dtype = resolve_dtype(cfg.dtype, device)
    rows = []
    for head_dim in bias.check_head_dims:
        encoding = build(bias.derivative_scheme, num_heads=bias.heads, head_dim=head_dim).to(device)
        for length in (bias.length, bias.length - 1):
            for deterministic in (False, True):
                row: dict[str, Any] = {"scheme": encoding.label, "head_dim": head_dim, "length": length,
                                       "deterministic": deterministic, "batch": bias.check_batch}  # fmt: skip
                try:
                    row |= check(encoding, bias.check_batch, length, head_dim, dtype, deterministic)
                except Exception as err:  # on CPU without the interpreter: the kernels refuse, said as such
                    record_failure(row, "error", err)
                rows.append(row)
                print(line(row), flush=True)
    return rows


def line(row: dict[str, Any]) -> str:
    """One case as a progress line: the worst tensor's relative error, fused and dense."""
    case = f"fused values  d{row['head_dim']} L{row['length']} {'deterministic' if row['deterministic'] else 'atomic'}"
    if "error" in row:
        return f"{case}: failed: {row['error']}"
    name, worst = max(row["errors"].items(), key=lambda item: item[1]["fused"])
    verdict = "ok" if row["ok"] else "OVER " + ", ".join(n for n, e in row["errors"].items() if not e["ok"])
    return f"{case}: {verdict}; largest relative error {worst['fused']:.2e} ({name}; dense {worst['dense']:.2e})"


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The values' section of ``bias.md``: one row per case, the largest error of the output and of the gradients."""
    if not rows:
        return []
    lines = [
        "",
        f"### The fused kernel's values against the fp32 reference ({rows[0]['scheme']}, batch {rows[0]['batch']})",
        "",
        "Relative error: a tensor's largest difference from the eager fp32 reference over the reference's largest "
        "entry. Passes when the fused kernel's error is at most twice the dense path's in the same dtype plus "
        f"{SLACK:g} (relative; FlashAttention's test rule), in every tensor.",
        "",
        "| head dim | length | table gradient | output: fused / dense | q, k, v grads: fused / dense "
        "| parameter grads: fused / dense | passes |",
        "|---:|---:|---|---|---|---|---|",
    ]
    for row in rows:
        head = f"| {row['head_dim']} | {row['length']} | {'deterministic' if row['deterministic'] else 'atomic'} |"
        if "error" in row:
            lines.append(f"{head} failed: {row['error'].replace('|', '/')} | | | |")
            continue
        errors = row["errors"]
        groups = (["out"], ["dq", "dk", "dv"], [n for n in errors if n not in ("out", "dq", "dk", "dv")])
        cells = []
        for names in groups:
            fused = max((errors[n]["fused"] for n in names), default=0.0)
            dense_error = max((errors[n]["dense"] for n in names), default=0.0)
            cells.append(f"{fused:.1e} / {dense_error:.1e}")
        lines.append(f"{head} {' | '.join(cells)} | {'yes' if row['ok'] else 'NO'} |")
    return lines
