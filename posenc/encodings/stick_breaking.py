"""Stick-breaking attention: no softmax and no position encoding; order comes from the attention itself.

Tan et al., ICLR 2025, "Scaling Stick-Breaking Attention: An Efficient Implementation and In-depth Study".

Query i breaks a stick of length 1 from its nearest earlier key outwards: key j takes the fraction β_ij = σ(z_ij)
of what the keys between them left, z_ij = q_i · k_j / √D (the paper's definition of A_ij):

    A_ij = β_ij · Π_{j<k<i} (1 − β_ik),    log A_ij = log σ(z_ij) + Σ_{j<k<i} log σ(−z_ik)    for j < i.

The query's own position is not among the keys it breaks the stick over, as in the paper's reference code
(github.com/shawntan/stickbreaking-attention: ``attend_current=False``, its default). What no key took,
1 − Σ_j A_ij = Π_{j<i} σ(−z_ij), goes to the query's own value, as that code's tests add it (``o + rem · v``):

    o_i = Σ_{j<i} A_ij v_j + (1 − Σ_{j<i} A_ij) v_i.

The weights W (A below the diagonal, the remainder on it) are therefore a distribution over keys 0..i, like
softmax's: they are what attention maps and statistics read. Only which keys precede the query depends on
positions, so the scheme is invariant to a shift of all positions and accepts any length.

Having no softmax, the scheme ``supplies_attention``: ``attention_weights`` is the reference, computed as written
above in log space, and the ``scheme`` backend runs ``attend`` (neither reads the layer's input: ``features`` are
ignored). ``attend`` takes blocks of query rows, each over the keys it may see (memory O(Lk) per query row, never
O(Lq × Lk)), in fp32 with the keys nearest first, as the stick is broken: with s_ij = σ(−z_ij) = 1 − β_ij (1 on
the keys that do not precede i) and P_ij = Π_{j<k<i} s_ik the stick left when key j breaks it, a cumulative product
from the nearest key outwards,

    A_ij = (1 − s_ij) · P_ij,    1 − Σ_j A_ij = Π_{k<i} s_ik.

One sigmoid and one cumulative product per score, where the log form costs a log-sigmoid and an exp (three
transcendentals against one): about three times faster on a CPU (docs/stick-breaking.md). The product only
falls, and once it underflows the stick is used up: every later weight is below fp32's smallest number either way.

Its backward recomputes each block and differentiates it by hand (no autograd graph is kept per block): with
g_ij = A_ij · (dO_i · v_j), g_i = (1 − Σ_j A_ij) · (dO_i · v_i) the remainder's, and F_ij = g_i + Σ_{j'<j} g_ij'
(the remainder and the keys farther than j, whose sticks s_ij shortened),

    ∂L/∂z_ij = g_ij · s_ij − (1 − s_ij) · F_ij          for j < i,

since ∂s/∂z = −s(1 − s). On CUDA the same blocked path runs: no Triton kernel is provided (docs/stick-breaking.md
says why).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posenc.encodings import register
from posenc.encodings.base import PositionalEncoding
from posenc.runtime import full_precision

# Where what no key took goes: the query's own value (the reference code's tests) or a learned vector per head (the
# layer the paper's models were trained with).
REMAINDERS = ("value", "head_bias")
# Scores per block: 1 MiB fp32 temporaries on a CPU (its cache), far more on a GPU.
BLOCK_ELEMENTS = {"cpu": 1 << 18, "cuda": 1 << 25}


def _precision(q: Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs (checks in double precision): never the activations' half precision."""
    return torch.promote_types(q.dtype, torch.float32)


def block_rows(batch_heads: int, keys: int, device: torch.device) -> int:
    """Query rows per block so that one (batch × heads × rows × keys) temporary holds ``BLOCK_ELEMENTS`` scores.

    On a CPU, blocks that fit its cache ran fastest (32-64 rows of 2,048 keys for 4 heads, measured); on a GPU, a
    block must be large enough to fill the device (unmeasured: no GPU was at hand).
    """
    elements = BLOCK_ELEMENTS["cuda" if device.type == "cuda" else "cpu"]
    return max(1, elements // max(1, batch_heads * keys))


def _blocks(length: int, rows: int, keys: int, self_attention: bool) -> list[tuple[int, int, slice, int]]:
    """(first row, end row, keys in nearest-first order, leading keys that may not precede a row) per block.

    With shared positions a block sees keys < end, and only its first ``end - start`` (its own rows' keys) can be
    at or after one of its queries; over cached keys every key may be.
    """
    blocks = []
    for start in range(0, length, rows):
        end = min(start + rows, length)
        if self_attention:
            blocks.append((start, end, slice(keys - end, keys), end - start))
        else:
            blocks.append((start, end, slice(None), keys))
    return blocks


def _block(
    q_neg: Tensor, k_near: Tensor, q_pos: Tensor, k_pos_near: Tensor, leading: int
) -> tuple[Tensor, Tensor, Tensor]:
    """One block's s = σ(−z) (1 on keys that do not precede the query), sticks A, and remainder (B, H, rows).

    ``q_neg`` holds the queries times −1/√D, so that q_neg · k = −z. Keys come nearest first, so a cumulative
    product over them runs from the nearest key outwards.
    """
    rest = torch.matmul(q_neg, k_near.transpose(-1, -2))  # −z (B, H, rows, keys)
    # Keys at or after the query get −z = +∞, so s = 1: they break nothing off the stick.
    rest[..., :leading].masked_fill_(k_pos_near[None, :leading] >= q_pos[:, None], float("inf"))
    rest = rest.sigmoid_()  # s = σ(−z) = 1 − β
    left = F.pad(rest[..., :-1], (1, 0), value=1.0).cumprod_(-1)  # P_ij: the stick left when key j breaks it
    remainder = left[..., -1] * rest[..., -1]  # what no key took
    return rest, left.addcmul_(left, rest, value=-1.0), remainder  # A = P · (1 − s)


class _StickBreakingAttention(torch.autograd.Function):
    """o = A · v + remainder · v_own, block by block; the backward recomputes each block and differentiates by hand."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        q_pos: Tensor | None,
        k_pos: Tensor,
        rows: int,
        head_bias: Tensor | None,
    ) -> Tensor:
        # q_pos None: self-attention over k_pos (one tensor passed once, as torch.compile wants its inputs distinct).
        # head_bias None: the remainder goes to the query's own value; else to this (H, D) vector.
        return _forward(ctx, q, k, v, q_pos, k_pos, rows, head_bias)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        dq, dk, dv, dhead_bias = _backward(ctx, dout)
        return dq, dk, dv, None, None, None, dhead_bias


def _remainder_target(v: Tensor, q_pos: Tensor, k_pos: Tensor, head_bias: Tensor | None, fp: torch.dtype) -> Tensor:
    """What the stick's remainder multiplies: each query's own value (B, H, Lq, D), or the (H, 1, D) head bias."""
    if head_bias is None:
        return v.to(fp).index_select(-2, torch.searchsorted(k_pos, q_pos))
    return head_bias.to(fp)[:, None, :]


@full_precision
def _forward(
    ctx: Any, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor | None, k_pos: Tensor, rows: int, head_bias: Tensor | None
) -> Tensor:
    self_attention = q_pos is None
    q_pos = k_pos if q_pos is None else q_pos
    scale, fp = q.shape[-1] ** -0.5, _precision(q)
    k_near, v_near, pos_near = k.to(fp).flip(-2), v.to(fp).flip(-2), k_pos.flip(0)  # nearest key first
    v_own = _remainder_target(v, q_pos, k_pos, head_bias, fp).expand(*q.shape[:2], q.shape[2], v.shape[-1])
    q_neg = q.to(fp) * -scale
    out = []
    for start, end, keys, leading in _blocks(q.shape[-2], rows, k.shape[-2], self_attention):
        _, sticks, remainder = _block(q_neg[:, :, start:end], k_near[:, :, keys], q_pos[start:end], pos_near[keys],
                                      leading)  # fmt: skip
        block = torch.matmul(sticks, v_near[:, :, keys])
        out.append(block.addcmul_(remainder[..., None], v_own[:, :, start:end]))
    ctx.save_for_backward(q, k, v, k_pos, head_bias, *([] if self_attention else [q_pos]))
    ctx.rows, ctx.self_attention = rows, self_attention
    return torch.cat(out, dim=-2).to(v.dtype)


@full_precision
def _backward(ctx: Any, dout: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    q, k, v, k_pos, head_bias, *query_positions = ctx.saved_tensors
    q_pos = query_positions[0] if query_positions else k_pos
    scale, fp = q.shape[-1] ** -0.5, _precision(q)
    k_near, v_near, pos_near = k.to(fp).flip(-2), v.to(fp).flip(-2), k_pos.flip(0)
    own = torch.searchsorted(k_pos, q_pos)
    v_own = _remainder_target(v, q_pos, k_pos, head_bias, fp).expand(*dout.shape)
    dout = dout.to(fp)
    dq = torch.empty(q.shape, dtype=fp, device=q.device)
    dk_near, dv_near = torch.zeros_like(k_near), torch.zeros_like(v_near)
    remainders = torch.empty(dout.shape[:-1], dtype=fp, device=q.device)  # (B, H, Lq)
    q_fp = q.to(fp)
    q_neg = q_fp * -scale
    for start, end, keys, leading in _blocks(q.shape[-2], ctx.rows, k.shape[-2], ctx.self_attention):
        q_block, dout_block = q_fp[:, :, start:end], dout[:, :, start:end]
        rest, sticks, remainder = _block(q_neg[:, :, start:end], k_near[:, :, keys], q_pos[start:end],
                                         pos_near[keys], leading)  # fmt: skip
        remainders[:, :, start:end] = remainder
        dv_near[:, :, keys] += torch.matmul(sticks.transpose(-1, -2), dout_block)
        grad = torch.matmul(dout_block, v_near[:, :, keys].transpose(-1, -2)).mul_(sticks)  # g_ij
        grad_rest = remainder * (dout_block * v_own[:, :, start:end]).sum(-1)  # g_i
        # F_ij = g_i + the g of the keys farther than j: the row's total less the keys from the nearest to j.
        farther = (grad.sum(-1) + grad_rest)[..., None] - grad.cumsum(-1)
        dscores = grad.add_(farther).mul_(rest).sub_(farther).mul_(scale)  # (g + F) s − F; 0 where s = 1, g = 0
        dq[:, :, start:end] = torch.matmul(dscores, k_near[:, :, keys])
        dk_near[:, :, keys] += torch.matmul(dscores.transpose(-1, -2), q_block)
    dv, dhead_bias = dv_near.flip(-2), None
    if head_bias is None:  # the remainder took the query's own value
        dv = dv.index_add_(-2, own, remainders[..., None] * dout)
    else:
        dhead_bias = (remainders[..., None] * dout).sum((0, 2)).to(head_bias.dtype)  # (H, D)
    return dq.to(q.dtype), dk_near.flip(-2).to(k.dtype), dv.to(v.dtype), dhead_bias


def stick_breaking_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    rows: int | None = None,
    head_bias: Tensor | None = None,
) -> Tensor:
    """Stick-breaking attention (B, H, Lq, D) of q (B, H, Lq, D) over k, v (B, H, Lk, D), ``rows`` queries a block.

    Keys come in increasing position order and include each query's own position (self-attention, or new queries
    over every cached key). ``rows`` defaults to a block of ``BLOCK_ELEMENTS`` scores for the device. The remainder
    goes to each query's own value, or to ``head_bias`` (H, D) when given.
    """
    batch, heads, _, _ = q.shape
    rows = rows or block_rows(batch * heads, k.shape[-2], q.device)
    return _StickBreakingAttention.apply(q, k, v, None if q_pos is k_pos else q_pos, k_pos, rows, head_bias)


@register
class StickBreaking(PositionalEncoding):
    """No position encoding: the attention is a stick broken from the nearest key outwards, not a softmax."""

    name = "stick_breaking"
    supplies_attention = True  # reads q and k only: the keys' ``features`` are ignored
    own_sink = "its remainder, what no key takes, already goes to a value of its own: a sink of its own"

    def __init__(self, num_heads: int, head_dim: int, remainder: str = "value", head_norm: bool = False) -> None:
        super().__init__(num_heads, head_dim)
        if remainder not in REMAINDERS:
            raise ValueError(f"stick_breaking remainder must be one of {', '.join(REMAINDERS)}, got {remainder!r}")
        self.remainder = remainder
        self.head_norm = bool(head_norm)
        # The trained form (module docstring): a learned vector per head takes the remainder, initialised at zero,
        # and each head's output is normalised with its own gain and offset (GroupNorm, one group per head).
        self.head_bias = nn.Parameter(torch.zeros(num_heads, head_dim)) if remainder == "head_bias" else None
        self.norm = nn.GroupNorm(num_heads, num_heads * head_dim) if self.head_norm else None

    @classmethod
    def label_of(cls, options: Mapping[str, Any]) -> str:
        """``stick_breaking_trained`` for the form its paper's models trained (``head_bias`` and ``head_norm``).

        Any other departure from the reference form is named after the name, so that no two forms share a run or column.
        """
        head_bias = options.get("remainder", "value") == "head_bias"
        head_norm = bool(options.get("head_norm", False))
        if head_bias and head_norm:
            return f"{cls.name}_trained"
        return cls.name + ("-head_bias" if head_bias else "") + ("-head_norm" if head_norm else "")

    @property
    def label(self) -> str:
        return self.label_of({"remainder": self.remainder, "head_norm": self.head_norm})

    def _finish(self, out: Tensor) -> Tensor:
        """Each head's output (B, H, Lq, D) normalised over its D channels, as the trained layer does before o_proj."""
        if self.norm is None:
            return out
        batch, heads, length, dim = out.shape
        flat = out.transpose(1, 2).reshape(batch * length, heads * dim)
        normed = F.group_norm(flat.float(), heads, self.norm.weight.float(), self.norm.bias.float(), self.norm.eps)
        return normed.reshape(batch, length, heads, dim).transpose(1, 2).to(out.dtype)

    @full_precision
    def attention_weights(
        self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, features: Tensor | None = None
    ) -> Tensor:
        fp = _precision(q)
        scores = torch.einsum("bhqd,bhkd->bhqk", q.to(fp), k.to(fp)) / math.sqrt(q.shape[-1])  # z (B, H, Lq, Lk)
        before = k_pos[None, :] < q_pos[:, None]  # the keys query i breaks its stick over
        log_rest = F.logsigmoid(-scores).masked_fill(~before, 0.0)  # log(1 − β_ik) on them
        between = log_rest.flip(-1).cumsum(-1).flip(-1) - log_rest  # Σ_{j<k<i} log(1 − β_ik)
        sticks = (F.logsigmoid(scores) + between).masked_fill(~before, float("-inf")).exp()  # A_ij
        # The stick left, Π_{k<i} (1 − β_ik): the reference code's 1 − Σ_j A_ij (telescoping), which in floating
        # point could round below 0 (and an entropy of it to −∞).
        remainder = log_rest.sum(-1, keepdim=True).exp()
        if self.remainder == "head_bias":  # no key takes it: weights_output adds it on the head's vector
            return sticks
        return sticks + (k_pos[None, :] == q_pos[:, None]) * remainder  # on the query's own key

    @full_precision
    def weights_output(self, weights: Tensor, v: Tensor) -> Tensor:
        out = torch.einsum("bhqk,bhkd->bhqd", weights, v.to(weights.dtype))
        if self.head_bias is not None:  # what no key took, 1 − Σ_j A_ij, on the head's learned vector
            left = (1 - weights.sum(-1, keepdim=True)).clamp(min=0)
            out = out + left * self.head_bias.to(weights.dtype)[None, :, None, :]
        return self._finish(out)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, features: Tensor | None = None
    ) -> Tensor:
        return self._finish(stick_breaking_attention(q, k, v, q_pos, k_pos, head_bias=self.head_bias))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, remainder={self.remainder}, head_norm={self.head_norm}"
