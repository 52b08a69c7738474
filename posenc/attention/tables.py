"""Distance-only biases read from a table: what every fast path scores instead of the scheme's per-score formula.

A scheme whose bias is a function of the distance i − j alone says so (``distance_only``) and gives the bias as an
(H, L) fp32 table (``distance_bias``). Built once per call from the scheme's parameters, O(H · L), the table is all a
fast path reads: one load per score, where the scheme's own formula costs a ``log1p`` (KERPLE-log), a ``pow``
(KERPLE-power) or a bucket's ``log`` (T5) per score, and where a score_mod at absolute positions adds the window's
first position to both indices of every score. A distance needs no position: the window's offset cancels. The
table's gradient is one entry per distance, and autograd takes it from there to the scheme's parameters through
``distance_bias``, exactly, whatever the scheme. Which schemes read a table is decided by that declaration alone.

- ``table_score_mod``: FlexAttention's score_mod over a table (``flex``, ``flex_learnable``);
- ``distance_mask``: the dense (H, Lq, Lk) bias gathered from a table, as SDPA takes it, whose backward sums the
  mask's gradient along its diagonals, one total per distance (``sdpa``);
- ``tabulate``: a distance-only score_mod (a gradient form's log factor) evaluated once per (head, distance), so
  that its kernel reads a table too;
- ``GradientPlan``: the parameters' gradients by the forms the scheme declares (``bias_gradient_forms``), every
  factor a table: Identity 1's extra forward reads the bias plus log f by distance, Identity 2's band the bias;
- ``CpuTableAttention``: SDPA's CPU flash kernel, forward and backward, with a learnable table held constant and
  the parameters' gradients from the plan (``sdpa`` on CPU, where SDPA would otherwise differentiate the mask in its
  math kernel).

Positions are contiguous (a window ``p, p + 1, ...``), as every caller in posenc passes them: the keys' span is
then the largest distance, and a table of that length covers every causal score.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from posenc.attention.bias_grad import derivative_sums, diagonal_sums, diagonal_totals, row_deltas, table_gradient
from posenc.encodings.base import PositionalEncoding
from posenc.encodings.forms import DerivativeForm, ScoreMod, TableForm

# (H, L) bias table -> (out (B, H, L, D), lse (B, H, L) fp32): one causal attention forward of the backward's q, k, v.
AttendTable = Callable[[Tensor], tuple[Tensor, Tensor]]


def reads_table(encoding: PositionalEncoding) -> bool:
    """Whether fast paths score this scheme from its distance table: a position bias of the distance alone."""
    return encoding.adds_bias and encoding.distance_only and not encoding.adds_content_bias


@torch.library.custom_op("posenc::materialize", mutates_args=())
def materialize(table: Tensor) -> Tensor:
    """A copy of ``table`` that a compiler must compute as a tensor of its own before any kernel reads it.

    Inside a compiled block the table is computed in the same graph as the attention, and Inductor would otherwise
    inline an elementwise table into FlexAttention's kernel, evaluating the scheme's formula (KERPLE's ``log1p``,
    ``pow``) per score again: the kernel lane showed KERPLE-power's forward at 221 registers against ALiBi's 136.
    An operator the compiler cannot see into is computed once, O(H · L), and read by index. (It also stops Inductor
    failing on a table whose last operation is elementwise over a reduction's output, "convert FlexibleLayout to
    FixedLayout first": ALiBi's table plus Sandwich's.)
    """
    return table.clone()


materialize.register_fake(lambda table: torch.empty_like(table))
materialize.register_autograd(lambda ctx, grad: grad)


def distance_table(encoding: PositionalEncoding, length: int, detached: bool = False) -> Tensor:
    """(H, length) fp32: the scheme's bias at distances 0 .. length − 1, differentiable unless ``detached``."""
    table = materialize(encoding.distance_bias(length).float())
    return table.detach() if detached else table


def table_score_mod(table: Tensor) -> ScoreMod:
    """The score_mod adding ``table[h, q_idx − kv_idx]``: one load per score, no offset, no arithmetic on positions.

    The distance is clamped into the table: the causal mask drops j > i afterwards, and a tile's padded rows may
    reach past the last distance. A table that requires grad is FlexAttention's captured buffer: its gradient, one
    atomic add per score into the entry read, is then FlexAttention's own.
    """
    last = table.shape[-1] - 1

    def by_distance(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score + table[h, (q_idx - kv_idx).clamp(0, last)]

    return by_distance


def tabulate(mod: ScoreMod, heads: int, length: int, device: torch.device | str) -> Tensor:
    """(heads, length) fp32: what a distance-only ``mod`` adds to a zero score at each head and distance.

    The mod is evaluated once on broadcast indices (query d over key 0), as FlexAttention's own dense path evaluates
    a score_mod on tensors; a mod of the distance alone gives every (i, j) with i − j = d the same value.
    """
    head = torch.arange(heads, device=device, dtype=torch.int32)[:, None]
    distance = torch.arange(length, device=device, dtype=torch.int32)[None, :]
    zero = torch.zeros((), device=device, dtype=torch.int32)
    score = torch.zeros(heads, length, device=device, dtype=torch.float32)
    return mod(score, zero, head, distance, zero).float().expand(heads, length)


def dense_bias(encoding: PositionalEncoding, length: int, detached: bool = False) -> Callable[[Tensor, Tensor], Tensor]:
    """The scheme's bias as SDPA takes it, ``bias(q_pos, k_pos)`` (H, Lq, Lk) fp32, over keys spanning ``length``.

    Gathered from the distance table for a scheme that reads one (its gradient per distance), else the scheme's own
    dense ``bias``. ``detached``: a constant.
    """
    if reads_table(encoding):
        table = distance_table(encoding, length, detached=detached)
        return lambda q_pos, k_pos: distance_mask(table, q_pos, k_pos)
    if detached:
        return lambda q_pos, k_pos: encoding.bias(q_pos, k_pos).detach()
    return encoding.bias


class _DistanceMask(torch.autograd.Function):
    """table[:, distance] (H, Lq, Lk), whose backward gives the table one total per distance (no scatter)."""

    @staticmethod
    def forward(ctx: Any, table: Tensor, distance: Tensor, offset: Tensor) -> Tensor:
        ctx.save_for_backward(offset)
        ctx.span = table.shape[-1]
        return table[:, distance]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        (offset,) = ctx.saved_tensors
        return diagonal_totals(grad, offset, ctx.span), None, None


def distance_mask(table: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """The bias (H, Lq, Lk) of queries at ``q_pos`` over keys at ``k_pos`` read from ``table`` (H, span), in fp32.

    Entries with a key after the query read distance 0: the causal mask replaces them.
    """
    span = table.shape[-1]
    distance = (q_pos[:, None] - k_pos[None, :]).clamp(0, span - 1)
    offset = q_pos[0] - k_pos[0]  # the first query's distance to the first key: where the diagonals start
    return _DistanceMask.apply(table, distance, offset)


@dataclass
class GradientPlan:
    """A distance-only learnable bias's backward by its declared forms, with every factor read from a table.

    ``bias`` (H, L) is the scheme's whole bias by distance, detached: the constant the attention itself reads.
    """

    bias: Tensor
    derivatives: list[DerivativeForm]
    shifted: list[Tensor]  # per derivative form: bias + log f by distance (H, L); −inf where f = 0
    tables: list[TableForm]
    band: Tensor | None  # (H, widest horizon): the bias by distance, for the table forms' band pass
    parameters: list[Tensor]  # one per form, derivatives then tables (a repeated one gets its grads summed)

    def gradients(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        dout: Tensor,
        attend: AttendTable,
        dlse: Tensor | None = None,
    ) -> list[Tensor]:
        """Each parameter's gradient, aligned with ``parameters``; ``attend`` runs Identity 1's forwards.

        ``dlse`` (B, H, L): the row lse's own gradient, when something read it (a sink merged through it). It adds
        P_ij dℓ_i to dS_ij, which is Δ_i − dℓ_i in place of Δ_i, and makes row i of dS sum to dℓ_i, not 0.
        """
        deltas = row_deltas(out, dout)
        if dlse is not None:
            deltas = deltas - dlse.float()
        grads = []
        for form, shifted in zip(self.derivatives, self.shifted, strict=True):
            out_f, lse_f = attend(shifted)
            # Row i sees distances 0 .. i: where log f is −inf on all of them, f vanishes on the whole row, and its
            # lse' is −inf whatever a kernel writes there (SDPA's CPU flash kernel writes 0).
            seen = torch.isfinite(shifted).cumsum(dim=-1) > 0  # (H, L)
            lse_f = torch.where(seen[:, : lse_f.shape[-1]], lse_f, float("-inf"))
            grads.append(form.scale * derivative_sums(lse, dout, deltas, out_f, lse_f))
        if self.tables:
            diagonals = diagonal_sums(q, k, v, lse, dout, deltas, self.band)
            totals = None if dlse is None else dlse.float().sum(dim=(0, 2))  # Σ_ij dS_ij per head
            grads += [table_gradient(form, diagonals, totals) for form in self.tables]
        return [grad.to(p.dtype) for grad, p in zip(grads, self.parameters, strict=True)]


def has_gradient_forms(encoding: PositionalEncoding) -> bool:
    """A bias read from a table whose every trainable parameter is covered by a declared form (or has none)."""
    if not reads_table(encoding):
        return False
    return encoding.bias_gradient_forms() is not None


@torch.no_grad()
def plan_gradient(encoding: PositionalEncoding, length: int) -> GradientPlan | None:
    """The backward's plan for a window of ``length``; ``None`` when the scheme reads no table or declares no forms."""
    if not has_gradient_forms(encoding):
        return None
    forms = encoding.bias_gradient_forms() or []
    derivatives = [f for f in forms if isinstance(f, DerivativeForm) and f.parameter.requires_grad]
    tables = [f for f in forms if isinstance(f, TableForm) and f.table.requires_grad]
    bias = distance_table(encoding, length, detached=True)
    heads, device = bias.shape[0], bias.device
    shifted = [bias + tabulate(form.log_factor, heads, length, device) for form in derivatives]
    band = distance_table(encoding, max(f.horizon for f in tables), detached=True) if tables else None
    parameters = [f.parameter for f in derivatives] + [f.table for f in tables]
    return GradientPlan(bias, derivatives, shifted, tables, band, parameters)


def causal_table_mask(table: Tensor, start: int, end: int, dtype: torch.dtype) -> Tensor:
    """(1, H, end − start, end): the bias of queries start .. end − 1 over keys 0 .. end − 1, −inf on future keys.

    One strided read of the table padded with −inf before distance 0 (row i starts i places further into it, each
    row's keys reversed), then one flip: no (L × L) index tensor, no masked_fill.
    """
    heads, span = table.shape
    padded = torch.cat((table.new_full((heads, span - 1), float("-inf")), table), dim=1)  # [k] = table[k − span + 1]
    # Key column c' = end − 1 − j of query row r (position start + r) reads distance start + r − j = r + c' + s0.
    first = span - 1 + start - (end - 1)
    reversed_keys = padded.as_strided((heads, end - start, end), (padded.stride(0), 1, 1), first)
    return reversed_keys.flip(-1).to(dtype)[None]


def flash_table(q: Tensor, k: Tensor, v: Tensor, table: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """(out, lse) of causal attention with ``table`` (H, L) as bias on SDPA's CPU flash kernel, ``rows`` queries a call.

    The private op is the one ``F.scaled_dot_product_attention`` dispatches to on CPU; it is called directly for the
    row log-sum-exp, which the public function does not return.
    """
    length, scale = q.shape[-2], q.shape[-1] ** -0.5
    outs, lses = [], []
    for start in range(0, length, rows):
        end = min(length, start + rows)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[:, :, start:end], k[:, :, :end], v[:, :, :end], attn_mask=causal_table_mask(table, start, end, q.dtype),
            scale=scale,
        )  # fmt: skip
        outs.append(out)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


class CpuTableAttention(torch.autograd.Function):
    """Causal attention with a learnable distance table on CPU: SDPA's flash kernel both ways, the bias constant to it.

    SDPA differentiates a mask only in its math kernel, which materialises the batch's scores and takes a safe
    softmax: a learnable bias trained through it cost 1.6–2.6× ALiBi's step on CPU. Here q, k and v get their
    gradients from the flash kernel's backward, and the parameters theirs from the plan: for KERPLE one more flash
    forward per derivative form, for T5 the band. Queries go ``rows`` at a time (the dense mask stays at most
    ``rows × L`` per head), each over its causal keys.
    """

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, plan: GradientPlan, rows: int, *params: Tensor) -> Tensor:
        out, lse = flash_table(q, k, v, plan.bias, rows)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.rows = plan, rows
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        plan, rows = ctx.plan, ctx.rows
        length, scale = q.shape[-2], q.shape[-1] ** -0.5
        dout = dout.to(q.dtype).contiguous()
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for start in range(0, length, rows):
            end = min(length, start + rows)
            grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout[:, :, start:end], q[:, :, start:end], k[:, :, :end], v[:, :, :end], out[:, :, start:end],
                lse[:, :, start:end], 0.0, False, attn_mask=causal_table_mask(plan.bias, start, end, q.dtype),
                scale=scale,
            )  # fmt: skip
            dq[:, :, start:end] = grads[0]
            dk[:, :, :end] += grads[1]
            dv[:, :, :end] += grads[2]
        params = plan.gradients(q, k, v, out, lse, dout, lambda table: flash_table(q, k, v, table, rows))
        return (dq, dk, dv, None, None, *params)
