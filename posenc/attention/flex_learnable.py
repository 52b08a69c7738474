"""``flex_learnable``: FlexAttention for learnable biases, with a backward as cheap as a constant bias's.

FlexAttention differentiates a score_mod that reads a trainable tensor by adding into it atomically once per
score, which on an H100 made KERPLE's backward 500–1250× slower than flash attention and T5's table fail to
compile (``docs/learnable-bias-gradient.md``). This backend splits the gradient instead:

- q, k, v: the ordinary attention backward with the bias treated as a constant (``score_mod(detached=True)``):
  FlexAttention's own backward on CUDA, no atomics since nothing it reads requires grad. On CPU, where
  FlexAttention has no backward, SDPA with the same constant bias as a chunked mask.
- the bias parameters: from the forms the scheme declares (``bias_gradient_forms``), by that
  document's identities (``bias_grad.py``): one extra flex forward per ``DerivativeForm`` (KERPLE: two, for all
  heads at once) and one O(L · horizon) band pass for all ``TableForm``s (T5). Both use only q, k, v, O, lse and dO.

The split is an identity-valued autograd node on the attention output: its forward returns a copy of O, its
backward passes dO through to the attention (for q, k, v) and returns the parameters' gradients. The backend asks
the scheme what it declares and never names one; a learnable scheme that declares nothing is refused here when
gradients are on (``auto`` then keeps ``flex``). Positions are the self-attention window's, as in ``flex``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from posenc.attention import refuse, refuse_content_bias, refuse_supplied_attention, register_backend
from posenc.attention.bias_grad import (
    derivative_sums,
    diagonal_sums,
    row_deltas,
    table_gradient,
    with_log_factor,
)
from posenc.attention.flex import check_self_attention, flex_run, kernel_options, shifted
from posenc.attention.sdpa import sdpa_with_bias
from posenc.encodings.base import DerivativeForm, PositionalEncoding, ScoreMod, TableForm
from posenc.runtime import cuda_path


def attend_with_lse(
    q: Tensor, k: Tensor, v: Tensor, score_mod: ScoreMod | None, options: dict[str, int | str] | None = None
) -> tuple[Tensor, Tensor]:
    """One causal flex forward returning (out, lse): the extra forwards of Identity 1 (run without grad)."""
    return flex_run(q, k, v, score_mod, return_lse=True, options=options)


@dataclass
class BiasGradientPlan:
    """What the backward needs: the scheme's forms, its constant score_mod and band bias, and the parameters."""

    derivatives: list[DerivativeForm]
    tables: list[TableForm]
    parameters: list[Tensor]  # one per form, derivatives then tables (a repeated one gets its grads summed)
    score_mod: ScoreMod | None  # the whole scheme's bias, detached, at absolute positions
    offset: Tensor  # the window's first position: kernel index 0
    band_bias: Tensor | None  # (H, max horizon) the whole scheme's bias by distance, for TableForms
    options: dict[str, int | str] | None  # FlexAttention kernel options of the scheme (``flex.kernel_options``)

    def gradients(self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor) -> list[Tensor]:
        """Each parameter's gradient, aligned with ``parameters``."""
        deltas = row_deltas(out, dout)
        attend = functools.partial(attend_with_lse, options=self.options)
        grads = []
        for form in self.derivatives:
            mod = shifted(with_log_factor(self.score_mod, form.log_factor), self.offset)
            grads.append(form.scale * derivative_sums(q, k, v, lse, dout, deltas, mod, attend))
        if self.tables:
            width = max(form.horizon for form in self.tables)
            diagonals = diagonal_sums(q, k, v, lse, dout, deltas, self.band_bias[:, :width])
            grads += [table_gradient(form, diagonals) for form in self.tables]
        return [grad.to(p.dtype) for grad, p in zip(grads, self.parameters, strict=True)]


def supports(encoding: PositionalEncoding) -> bool:
    """True when the scheme declares usable gradient forms for its bias (or has no trainable bias at all).

    Table forms need the whole bias as a function of distance (the band's scores), so they require every bias
    in the scheme to be distance-only. A content-dependent bias is never supported (a score_mod cannot read it), nor
    a scheme that supplies its own attention (there is no softmax to bias).
    """
    if encoding.adds_content_bias or encoding.supplies_attention:
        return False
    forms = encoding.bias_gradient_forms()
    return forms is not None and (encoding.distance_only or not any(isinstance(f, TableForm) for f in forms))


def plan_bias_gradient(encoding: PositionalEncoding, q: Tensor, offset: Tensor) -> BiasGradientPlan | None:
    """The plan for a scheme's trainable bias over the window of ``q`` from ``offset``; ``None`` if unsupported."""
    forms = encoding.bias_gradient_forms()
    if forms is None:
        return None
    derivatives = [f for f in forms if isinstance(f, DerivativeForm) and f.parameter.requires_grad]
    tables = [f for f in forms if isinstance(f, TableForm) and f.table.requires_grad]
    if tables and not encoding.distance_only:
        return None
    parameters = [f.parameter for f in derivatives] + [f.table for f in tables]
    band_bias = None
    if tables:
        with torch.no_grad():
            band_bias = encoding.distance_bias(max(f.horizon for f in tables)).float()
    return BiasGradientPlan(
        derivatives,
        tables,
        parameters,
        encoding.score_mod(detached=True, num_distances=q.shape[-2]),
        offset,
        band_bias,
        kernel_options(encoding, q),
    )


class _AttachBiasGradient(torch.autograd.Function):
    """Identity on the attention output whose backward adds the bias parameters' gradients (see the docstring)."""

    @staticmethod
    def forward(
        ctx: Any, out: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, plan: BiasGradientPlan, *params: Tensor
    ) -> Tensor:
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        # A copy, not ``out`` or a view of it: an autograd.Function output that aliases an input is replayed as a
        # view by aot_autograd under torch.compile (its ViewMeta regenerated at run time, with symbolic sizes
        # under dynamic shapes: one path to the garbage-shape crash seen on an H100). One copy of (B, H, L, D) is
        # negligible next to the attention.
        return out.clone()

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        grads = ctx.plan.gradients(q, k, v, out, lse, dout)
        return (dout, None, None, None, None, None, *grads)


def constant_bias_attention(
    q: Tensor, k: Tensor, v: Tensor, encoding: PositionalEncoding, pos: Tensor, with_lse: bool
) -> tuple[Tensor, Tensor | None]:
    """(out, lse or None) with the bias held constant: out is differentiable in q, k, v only."""
    mod = encoding.score_mod(detached=True, num_distances=q.shape[-2])
    mod = shifted(mod, pos[0]) if mod is not None else None
    options = kernel_options(encoding, q)
    trains_qkv = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if cuda_path(q) or not trains_qkv:
        if with_lse:
            return flex_run(q, k, v, mod, return_lse=True, options=options)
        return flex_run(q, k, v, mod, options=options), None
    # CPU training: flex has no backward, so the differentiable output comes from SDPA (and the lse from flex).
    out = sdpa_with_bias(q, k, v, lambda q_pos, k_pos: encoding.bias(q_pos, k_pos).detach(), pos, pos)
    if not with_lse:
        return out, None
    with torch.no_grad():
        return out, attend_with_lse(q, k, v, mod, options)[1]


@register_backend("flex_learnable", refuses=(refuse_supplied_attention, refuse_content_bias))
def flex_learnable_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    encoding: PositionalEncoding,
    q_pos: Tensor,
    k_pos: Tensor,
    features: Tensor | None = None,
) -> Tensor:
    refuse(encoding, "flex_learnable")
    check_self_attention(q, k, q_pos, k_pos)
    if not supports(encoding) and torch.is_grad_enabled():  # without gradients the forward needs no forms
        raise ValueError(
            f"attention=flex_learnable needs a scheme whose learnable bias declares bias_gradient_forms (distance-only "
            f"for tables); {encoding.label} does not. Use attention=flex or attention=sdpa."
        )
    plan = plan_bias_gradient(encoding, q, q_pos[0]) if torch.is_grad_enabled() else None
    bias_grad = plan is not None and len(plan.parameters) > 0
    out, lse = constant_bias_attention(q, k, v, encoding, q_pos, with_lse=bias_grad)
    if not bias_grad:
        return out
    detached = (t.detach() for t in (q, k, v, lse))
    return _AttachBiasGradient.apply(out, *detached, plan, *plan.parameters)
