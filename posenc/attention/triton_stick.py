"""Stick-breaking attention in fused Triton kernels: the ``triton`` backend's path for a scheme's ``stick_form``.

The kernels (``triton_stick_kernels.py``) compute o = Σ_j A_ij v_j + remainder_i · target tile by tile in log space
(base 2), keys from the diagonal outwards, never holding more than a tile of scores: the forward, and a backward that
returns dq, dk and dv and each row's remainder, from which the target's gradient is added here (the query's own
value, or the head's vector). Two custom operators, ``posenc::stick_attention`` and
``posenc::stick_attention_backward``, with their autograd and fake (shape-only) implementations registered: inside
``torch.compile`` each is one node of the block's graph, never a graph break.

The backward adds dk and dv from every query block with atomics, in an order that varies from run to run, so under
``torch.use_deterministic_algorithms(True)`` the backend refuses in one line (``scheme`` runs the blocked form
instead). Everything else the table kernels refuse (``triton_table.check_supported``) this path refuses too.
Tested on CPU through Triton's interpreter against the dense reference, values and gradients, and compiled in the
kernel lane for each GPU class; its speed on a GPU is unmeasured.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from posenc.attention.bias_grad import row_deltas
from posenc.attention.triton_launch import check_device, stick_backward_launch, stick_forward_launch


def _capability(t: Tensor) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(t.device) if t.is_cuda else None


def _unit_last_stride(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@torch.library.custom_op("posenc::stick_attention", mutates_args=())
def stick_attention(q: Tensor, k: Tensor, v: Tensor, head_bias: Tensor | None) -> Tensor:
    """Stick-breaking attention (B, H, L, D) over one window; the remainder to ``head_bias`` (H, D), else own value."""
    module = check_device(q, "stick_forward")
    q, k, v = (_unit_last_stride(t) for t in (q, k, v))
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    head_bias = head_bias.to(q.dtype).contiguous() if head_bias is not None else None
    stick_forward_launch(q, k, v, head_bias, out, _capability(q)).run(module)
    return out


@stick_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, head_bias: Tensor | None) -> Tensor:
    return q.new_empty(q.shape)


@torch.library.custom_op("posenc::stick_attention_backward", mutates_args=())
def stick_attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients dq (q's dtype), dk and dv of the sticks alone (fp32), and each row's remainder (B, H, L) fp32."""
    module = check_device(q, "stick_backward")
    q, k, v = (_unit_last_stride(t) for t in (q, k, v))
    dout = dout.to(q.dtype).contiguous()
    tensors = {
        "q": q, "k": k, "v": v, "dout": dout, "delta": row_deltas(out, dout).contiguous(),  # Δ_i = dO_i · O_i, fp32
        "dq": torch.empty_like(dout), "dk": torch.zeros(dout.shape, device=q.device, dtype=torch.float32),
        "dv": torch.zeros(dout.shape, device=q.device, dtype=torch.float32),
        "remainder": torch.empty(dout.shape[:-1], device=q.device, dtype=torch.float32),
    }  # fmt: skip
    stick_backward_launch(tensors, _capability(q)).run(module)
    return tensors["dq"], tensors["dk"], tensors["dv"], tensors["remainder"]


@stick_attention_backward.register_fake
def _(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    fp32 = torch.float32
    return (
        q.new_empty(q.shape),
        q.new_empty(q.shape, dtype=fp32),
        q.new_empty(q.shape, dtype=fp32),
        q.new_empty(q.shape[:-1], dtype=fp32),
    )


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    q, k, v, head_bias = inputs
    ctx.save_for_backward(q, k, v, head_bias, output)


def _backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
    q, k, v, head_bias, out = ctx.saved_tensors
    dq, dk, dv, remainder = stick_attention_backward(dout, q, k, v, out)
    taken = remainder[..., None] * dout.float()  # what the remainder's target receives of dO
    if head_bias is None:  # the query's own value
        return dq, dk.to(k.dtype), (dv + taken).to(v.dtype), None
    return dq, dk.to(k.dtype), dv.to(v.dtype), taken.sum((0, 2)).to(head_bias.dtype)


stick_attention.register_autograd(_backward, setup_context=_setup_context)


def refuse_deterministic(training: bool) -> None:
    """Refuse a backward whose atomics add in a varying order while deterministic algorithms are asked for."""
    if training and torch.are_deterministic_algorithms_enabled():
        raise ValueError(
            "attention=triton's stick-breaking backward adds dk and dv with atomics, in an order that varies between "
            "runs; with deterministic algorithms use attention=scheme (the blocked form) or auto"
        )
