"""``triton``: one flash-attention kernel for every distance-only bias, learnable ones included, and stick-breaking's.

A scheme whose attention is stick-breaking's (it declares a ``stick_form``) runs through the fused kernels of
``triton_stick.py`` instead, with the same refusals below; any other scheme that supplies its own attention is refused.

Every scheme whose bias is a function of the distance i − j alone (ALiBi, KERPLE, T5, Sandwich, sums of them)
describes it as an (H, L) table through ``distance_bias``; the kernels (``triton_kernels.py``) add table[h, i − j] to
each score inside a FlashAttention-2 forward and backward, and the backward also returns the table's gradient,
reduced per tile along its diagonals. The scheme's parameters then get their gradients from autograd through
``distance_bias``, exactly: one fused reduction replaces both identities of ``docs/learnable-bias-gradient.md``, and
no scheme is named here. A scheme without a bias runs with no table.

The kernels are two custom operators, ``posenc::table_attention`` (out and the row log-sum-exp) and
``posenc::table_attention_backward`` (dq, dk, dv and the table's gradient), with their autograd and fake (shape-only)
implementations registered: inside ``torch.compile`` each is one node of the block's graph, never a graph break.
A sink (``posenc/attention/sink.py``) is merged with the output through the lse; the lse's gradient dℓ enters the
backward as Δ_i − dℓ_i in place of Δ_i = dO_i · O_i (dS_ij = P_ij (dO_i · v_j − Δ_i + dℓ_i)), so the kernels stay as
they are.
The table's gradient adds tiles with atomics, whose order varies between runs; under
``torch.use_deterministic_algorithms(True)`` (what ``trainer.deterministic=true`` sets) the backward writes each
block of distances once per query block into a buffer and sums it in a fixed order instead: the same bits on every
run, at the cost of that buffer (B · H · (L / BLOCK_M) · L fp32).

Tiles and warps come per GPU class (``triton_launch.launch_config``), chosen so that every kernel compiles for sm_80,
sm_89 and sm_90 within the device's shared memory and with no register spill (``python -m posenc.lane --only table``
compiles them and reports both). Opt-in only (``attention=triton``): the kernels are tested on CPU through Triton's
interpreter, against ``eager``, values and gradients; their GPU speed is unmeasured, so ``auto`` picks this backend only
where a recorded measurement says it is faster (``auto.MEASURED_FASTER``, empty until a GPU has timed it).

A local layer's window (``posenc/attention/window.py``) goes to the table kernels, which mask the keys past it and
start or end each loop at the first or last tile it reaches; stick-breaking's kernel refuses one.

It refuses, never dropping a bias: a scheme whose bias is not distance-only, anything but self-attention over one
window (Lq ≠ Lk or different positions, e.g. cached decoding), head dims outside 16..128, fp32 past head dim 64
(``MAX_FP32_HEAD_DIM``), dtypes other than fp32/bf16/fp16, CPU tensors unless the kernels run under the interpreter
(``TRITON_INTERPRET=1``), bf16 under the interpreter (whose tl.dot multiplies bf16's raw bits), and a machine
without triton.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from posenc.attention import refuse, refuse_content_bias, register_backend
from posenc.attention.bias_grad import row_deltas
from posenc.attention.sink import SinkColumns
from posenc.attention.triton_launch import (
    backward_launches,
    check_device,
    forward_launch,
    table_gradient_buffer,
)
from posenc.attention.triton_stick import refuse_deterministic, stick_attention
from posenc.attention.window import refuse_window
from posenc.encodings.base import PositionalEncoding

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128  # tl.dot needs ≥ 16; past 128 the tiles no longer fit in registers
# fp32 tiles at head dim 128 need 240 KiB (dq) and 257 KiB (dk, dv) of shared memory compiled for an H100, over its
# 227 KiB (232,448 bytes): the backend refuses fp32 past 64 rather than fail at launch with OutOfResources.
MAX_FP32_HEAD_DIM = 64
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _capability(t: Tensor) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(t.device) if t.is_cuda else None


def _unit_last_stride(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@torch.library.custom_op("posenc::table_attention", mutates_args=())
def table_attention(
    q: Tensor, k: Tensor, v: Tensor, table: Tensor | None, window: int | None = None
) -> tuple[Tensor, Tensor]:
    """Causal attention with the bias table[h, i − j] (or none): out (B, H, L, D) and the natural row lse (B, H, L).

    ``window``: a local layer's, the keys fewer than it positions back; ``None`` for a global layer.
    """
    module = check_device(q)
    q, k, v = (_unit_last_stride(t) for t in (q, k, v))
    batch, heads, length, head_dim = q.shape
    out = torch.empty(batch, heads, length, head_dim, device=q.device, dtype=q.dtype)
    lse = torch.empty(batch, heads, length, device=q.device, dtype=torch.float32)
    table = table.float().contiguous() if table is not None else None
    forward_launch(q, k, v, out, lse, table, _capability(q), window).run(module)
    return out, lse


@table_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, table: Tensor | None, window: int | None = None) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("posenc::table_attention_backward", mutates_args=())
def table_attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    table: Tensor | None,
    bias_grad: bool,
    dlse: Tensor | None = None,
    window: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv and (``bias_grad``) the table's gradient (H, L) fp32; without it an empty (0,) tensor.

    ``dlse`` (B, H, L): the lse's own gradient, when a caller read it (a sink).
    """
    module = check_device(q)
    q, k, v = (_unit_last_stride(t) for t in (q, k, v))
    batch, heads, length, _ = q.shape
    dout = dout.to(q.dtype).contiguous()
    delta = row_deltas(out, dout)  # Δ_i = dO_i · O_i in fp32, autocast or not
    delta = (delta if dlse is None else delta - dlse.float()).contiguous()
    dq, dk, dv = (torch.empty_like(dout) for _ in range(3))
    table = table.float().contiguous() if table is not None else None
    deterministic = bias_grad and torch.are_deterministic_algorithms_enabled()
    capability = _capability(q)
    dtable = table_gradient_buffer(q, deterministic, bias_grad, capability, window is not None)
    tensors = {"q": q, "k": k, "v": v, "dout": dout, "lse": lse, "delta": delta, "dq": dq, "dk": dk, "dv": dv}
    tensors["dtable"] = dtable if bias_grad else lse
    for launch in backward_launches(tensors, table, bias_grad, deterministic, capability, window):
        launch.run(module)
    if deterministic:  # a fixed order: over batch, then over query blocks, each a torch reduction
        dtable = dtable.view(batch, heads, dtable.shape[1], -1).sum(dim=0).sum(dim=1)[:, :length].contiguous()
    return dq, dk, dv, dtable


@table_attention_backward.register_fake
def _(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    table: Tensor | None,
    bias_grad: bool,
    dlse: Tensor | None = None,
    window: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    heads, length = q.shape[1], q.shape[2]
    dtable = q.new_empty((heads, length) if bias_grad else (0,), dtype=torch.float32)
    return q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(q.shape), dtable


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, table, *rest = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, table)
    ctx.window = rest[0] if rest else None


def _backward(ctx: Any, dout: Tensor, dlse: Tensor | None) -> tuple[Tensor | None, ...]:
    q, k, v, out, lse, table = ctx.saved_tensors
    bias_grad = table is not None and ctx.needs_input_grad[3]
    dq, dk, dv, dtable = table_attention_backward(dout, q, k, v, out, lse, table, bias_grad, dlse, ctx.window)
    return dq, dk, dv, dtable if bias_grad else None, None


# The lse is saved for the backward, and a caller may differentiate through it (a sink merges with it).
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


def refuse_unfused_attention(encoding: PositionalEncoding, backend: str) -> None:
    """Refuse a scheme that supplies its own attention unless it is stick-breaking's (``stick_form``), fused here."""
    if encoding.supplies_attention and encoding.stick_form() is None:
        raise ValueError(
            f"attention={backend} runs softmax(q·kᵀ/√D + bias) attention or stick-breaking's, and {encoding.label} "
            "supplies another attention; use attention=auto, scheme or eager"
        )


@register_backend("triton", refuses=(refuse_unfused_attention, refuse_content_bias, refuse_other_biases))
def triton_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    encoding: PositionalEncoding,
    q_pos: Tensor,
    k_pos: Tensor,
    features: Tensor | None = None,
    sink: SinkColumns | None = None,
    window: int | None = None,
) -> Tensor:
    check_supported(q, k, v, encoding, q_pos, k_pos)
    form = encoding.stick_form()
    if form is not None:
        # stick-breaking's kernel has no window; a model refuses a local layer for it before it is built
        refuse_window("triton", window, f"a global layer for {encoding.label}, whose attention is its own")
        if sink is not None:  # the model refuses the pair before it is built (sink.refuse_sink)
            raise ValueError(
                f"attention=triton runs {encoding.label}'s own attention, which has no softmax row for a sink"
            )
        refuse_deterministic(torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))
        return form.finish(stick_attention(q, k, v, form.head_bias))
    table = encoding.distance_bias(q.shape[-2]).float() if encoding.adds_bias else None  # (H, L), differentiable
    out, lse = table_attention(q, k, v, table, window)
    return out if sink is None else sink.merge(out, lse, q, encoding, q_pos)
