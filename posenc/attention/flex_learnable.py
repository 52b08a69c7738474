"""``flex_learnable``: FlexAttention for learnable biases, with a backward as cheap as a constant bias's.

FlexAttention differentiates a score_mod that reads a trainable tensor by adding into it atomically once per
score, which on an H100 made KERPLE's backward 500–1250× slower than flash attention and T5's table fail to
compile (``docs/learnable-bias-gradient.md``). This backend splits the gradient instead:

- q, k, v: the ordinary attention backward with the bias treated as a constant (the scheme's distance table,
  detached): FlexAttention's own backward on CUDA, no atomics since nothing it reads requires grad. On CPU, where
  FlexAttention has no backward, SDPA with the same constant bias as a chunked mask.
- the bias parameters: from the forms the scheme declares (``bias_gradient_forms``), by that document's
  identities (``bias_grad.py``), every factor read from a table (``tables.GradientPlan``): one extra flex forward
  per ``DerivativeForm`` whose table is the bias plus log f by distance (KERPLE: two, for all heads at once), and
  one O(L · horizon) band pass for all ``TableForm``s (T5). Both use only q, k, v, O, lse and dO.

Every kernel reads tables: no ``log1p``, ``pow``, bucket ``log`` or ``log(log …)`` per score, and no position offset.
The split is an identity-valued autograd node on the attention output: its forward returns a copy of O, its
backward passes dO through to the attention (for q, k, v) and returns the parameters' gradients. The backend asks
the scheme what it declares and never names one; a learnable scheme without forms, or whose bias is not a function
of distance alone, is refused here when gradients are on (``auto`` then keeps ``flex``). Positions are the
self-attention window's, as in ``flex``.

A sink (``posenc/attention/sink.py``) is merged through the row lse, which the node passes on as well: its gradient
goes to the kernel's backward and into the forms' Δ (``GradientPlan.gradients``). On CPU the lse a sink
differentiates is the scores' own, in query chunks (``dense_lse``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from posenc.attention import refuse, refuse_content_bias, refuse_supplied_attention, register_backend
from posenc.attention.flex import bias_score_mod, check_self_attention, flex_run, kernel_options
from posenc.attention.sdpa import MAX_MASK_ELEMENTS, sdpa_with_bias
from posenc.attention.sink import SinkColumns
from posenc.attention.tables import GradientPlan, dense_bias, has_gradient_forms, plan_gradient, table_score_mod
from posenc.attention.window import refuse_window
from posenc.encodings.base import PositionalEncoding
from posenc.runtime import cuda_path


def supports(encoding: PositionalEncoding) -> bool:
    """True when the scheme's trainable bias is a distance table with declared gradient forms (or it trains none).

    A scheme without a trainable bias runs here with a constant bias, whatever its kind, except a content-dependent
    one (a score_mod cannot read it) or an attention of the scheme's own (there is no softmax to bias).
    """
    if encoding.adds_content_bias or encoding.supplies_attention:
        return False
    forms = encoding.bias_gradient_forms()
    return forms == [] or (forms is not None and has_gradient_forms(encoding))


def flex_gradients(
    plan: GradientPlan,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    options: Any = None,
    dlse: Tensor | None = None,
) -> list[Tensor]:
    """The plan's parameter gradients, Identity 1's forwards on FlexAttention, each reading one table."""

    def attend(table: Tensor) -> tuple[Tensor, Tensor]:
        return flex_run(q, k, v, table_score_mod(table), return_lse=True, options=options)

    return plan.gradients(q, k, v, out, lse, dout, attend, dlse)


class _AttachBiasGradient(torch.autograd.Function):
    """Identity on the attention output and row lse whose backward adds the bias parameters' gradients."""

    @staticmethod
    def forward(
        ctx: Any, out: Tensor, lse: Tensor, q: Tensor, k: Tensor, v: Tensor, plan: GradientPlan, options: Any,
        *params: Tensor,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.options = plan, options
        # Copies, not ``out`` or a view of it: an autograd.Function output that aliases an input is replayed as a
        # view by aot_autograd under torch.compile (its ViewMeta regenerated at run time, with symbolic sizes
        # under dynamic shapes: one path to the garbage-shape crash seen on an H100). One copy of (B, H, L, D) is
        # negligible next to the attention.
        return out.clone(), lse.clone()

    @staticmethod
    def backward(ctx: Any, dout: Tensor, dlse: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        grads = flex_gradients(ctx.plan, q, k, v, out, lse, dout, options=ctx.options, dlse=dlse)
        return (dout, dlse, None, None, None, None, None, *grads)


def dense_lse(q: Tensor, k: Tensor, bias: Any, pos: Tensor) -> Tensor:
    """The causal row lse (B, H, L) fp32 of q·kᵀ/√D + ``bias(q_pos, k_pos)``, differentiable, in query chunks."""
    rows = max(1, MAX_MASK_ELEMENTS // k.shape[-2])
    parts = []
    for start in range(0, q.shape[-2], rows):
        chunk_pos = pos[start : start + rows]
        scores = torch.matmul(q[:, :, start : start + rows].float(), k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
        scores = (scores + bias(chunk_pos, pos)).masked_fill(pos[None, :] > chunk_pos[:, None], float("-inf"))
        parts.append(scores.logsumexp(dim=-1))
    return torch.cat(parts, dim=-1)


def constant_bias_attention(
    q: Tensor, k: Tensor, v: Tensor, encoding: PositionalEncoding, pos: Tensor, with_lse: bool, lse_grad: bool = False
) -> tuple[Tensor, Tensor | None]:
    """(out, lse or None) with the bias held constant: out (and with ``lse_grad`` the lse) differentiable in q, k, v."""
    mod = bias_score_mod(encoding, q, pos, detached=True)
    options = kernel_options(encoding, q)
    trains_qkv = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if cuda_path(q) or not trains_qkv:
        if with_lse:
            return flex_run(q, k, v, mod, return_lse=True, options=options)
        return flex_run(q, k, v, mod, options=options), None
    # CPU training: flex has no backward, so the differentiable output comes from SDPA (and the lse from flex).
    bias = dense_bias(encoding, q.shape[-2], detached=True)
    out = sdpa_with_bias(q, k, v, bias, pos, pos)
    if not with_lse:
        return out, None
    if lse_grad:  # a sink differentiates the lse too
        return out, dense_lse(q, k, bias, pos)
    with torch.no_grad():
        return out, flex_run(q, k, v, mod, return_lse=True, options=options)[1]


@register_backend("flex_learnable", refuses=(refuse_supplied_attention, refuse_content_bias))
def flex_learnable_attention(
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
    refuse(encoding, "flex_learnable")
    # Its gradient forms read every distance of the table (the band pass, the derivative forwards): none knows a window.
    refuse_window("flex_learnable", window, "attention=flex or sdpa (auto picks one for a local layer)")
    check_self_attention(q, k, q_pos, k_pos)
    if not supports(encoding) and torch.is_grad_enabled():  # without gradients the forward needs no forms
        raise ValueError(
            f"attention=flex_learnable needs a scheme whose learnable bias is a function of distance alone and "
            f"declares bias_gradient_forms; {encoding.label}'s does not. Use attention=flex or attention=sdpa."
        )
    plan = plan_gradient(encoding, q.shape[-2]) if torch.is_grad_enabled() else None
    bias_grad = plan is not None and len(plan.parameters) > 0
    out, lse = constant_bias_attention(q, k, v, encoding, q_pos, bias_grad or sink is not None, sink is not None)
    if bias_grad:
        lse = lse if sink is not None else lse.detach()  # without a sink nothing reads it: no gradient to pass on
        detached = (t.detach() for t in (q, k, v))
        out, lse = _AttachBiasGradient.apply(out, lse, *detached, plan, kernel_options(encoding, q), *plan.parameters)
    return out if sink is None else sink.merge(out, lse, q, encoding, q_pos)
