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

Everything is computed in log space in fp32 with the keys in reverse order (nearest first), so the inner sum is a
plain cumulative sum, accumulated from the nearest key (where the weights are large and need the precision)
outwards. ``attend`` takes blocks of query rows, each over the keys it may see: memory O(Lk) per query row, never
O(Lq × Lk). Its backward recomputes each block and differentiates it by hand (no autograd graph is kept per block):
with g_ij = W_ij · (dO_i · v_j) the gradient of log W_ij, and F_ij the g of the keys farther than j plus the
remainder's,

    ∂L/∂z_ij = g_ij · σ(−z_ij) − σ(z_ij) · F_ij          for j < i,

since z_ij enters log W_ij through log σ(z_ij) and every farther key's log W (and the remainder's) through
log σ(−z_ij). On CUDA the same blocked path runs (no Triton kernel is provided: see docs/stick-breaking.md).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from posenc.encodings import register
from posenc.encodings.base import PositionalEncoding
from posenc.runtime import full_precision

BLOCK_ELEMENTS = 1 << 20  # (batch × heads × rows × keys) per block: ~7 fp32 temporaries of 4 MiB in the backward


def log_weights(scores: Tensor, q_pos: Tensor, k_pos_nearest_first: Tensor) -> Tensor:
    """The log-weights (..., Lq, Lk) from fp32 scaled scores whose keys come in decreasing position order.

    Entries for keys after the query are −inf; the query's own key holds the log of the stick no key took.
    """
    before = k_pos_nearest_first[None, :] < q_pos[:, None]  # (Lq, Lk): the keys query i breaks its stick over
    own = k_pos_nearest_first[None, :] == q_pos[:, None]
    log_rest = F.logsigmoid(-scores).masked_fill(~before, 0.0)  # log(1 − β_ik), 0 where k does not precede i
    left = log_rest.cumsum(-1)  # Σ over k from the nearest key to k = j inclusive: the stick left after j
    log_a = F.logsigmoid(scores) + (left - log_rest)  # log β_ij + Σ_{j<k<i} log(1 − β_ik)
    remainder = left[..., -1:]  # Σ over every preceding key (the rest are 0): the stick no key took
    return torch.where(before, log_a, torch.where(own, remainder, float("-inf")))


def _precision(q: Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs (checks in double precision): never the activations' half precision."""
    return torch.promote_types(q.dtype, torch.float32)


def block_rows(batch_heads: int, keys: int, elements: int = BLOCK_ELEMENTS) -> int:
    """Query rows per block so that one (batch × heads × rows × keys) temporary holds about ``elements``."""
    return max(1, elements // max(1, batch_heads * keys))


def _blocks(length: int, rows: int, keys: int, self_attention: bool) -> list[tuple[int, int, slice]]:
    """(first row, end row, keys in nearest-first order) per block; with shared positions a block sees keys < end."""
    blocks = []
    for start in range(0, length, rows):
        end = min(start + rows, length)
        blocks.append((start, end, slice(keys - end, keys) if self_attention else slice(None)))
    return blocks


class _StickBreakingAttention(torch.autograd.Function):
    """o = W · v block by block; the backward recomputes each block's W and differentiates it by hand."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor | None, k_pos: Tensor, rows: int) -> Tensor:
        # q_pos None: self-attention over k_pos (one tensor passed once, as torch.compile wants its inputs distinct).
        return _forward(ctx, q, k, v, q_pos, k_pos, rows)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        return (*_backward(ctx, dout), None, None, None)


@full_precision
def _forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor | None, k_pos: Tensor, rows: int) -> Tensor:
    self_attention = q_pos is None
    q_pos = k_pos if q_pos is None else q_pos
    scale, fp = q.shape[-1] ** -0.5, _precision(q)
    k_near, v_near, pos_near = k.to(fp).flip(-2), v.to(fp).flip(-2), k_pos.flip(0)  # nearest key first
    out = []
    for start, end, keys in _blocks(q.shape[-2], rows, k.shape[-2], self_attention):
        scores = torch.matmul(q[:, :, start:end].to(fp), k_near[:, :, keys].transpose(-1, -2)) * scale
        weights = log_weights(scores, q_pos[start:end], pos_near[keys]).exp_()  # (B, H, rows, keys)
        out.append(torch.matmul(weights, v_near[:, :, keys]))
    ctx.save_for_backward(q, k, v, k_pos, *([] if self_attention else [q_pos]))
    ctx.rows, ctx.self_attention = rows, self_attention
    return torch.cat(out, dim=-2).to(v.dtype)


@full_precision
def _backward(ctx: Any, dout: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v, k_pos, *query_positions = ctx.saved_tensors
    q_pos = query_positions[0] if query_positions else k_pos
    scale, fp = q.shape[-1] ** -0.5, _precision(q)
    k_near, v_near, pos_near = k.to(fp).flip(-2), v.to(fp).flip(-2), k_pos.flip(0)
    dq = torch.empty(q.shape, dtype=fp, device=q.device)
    dk_near, dv_near = torch.zeros_like(k_near), torch.zeros_like(v_near)
    for start, end, keys in _blocks(q.shape[-2], ctx.rows, k.shape[-2], ctx.self_attention):
        q_block, dout_block = q[:, :, start:end].to(fp), dout[:, :, start:end].to(fp)
        scores = torch.matmul(q_block, k_near[:, :, keys].transpose(-1, -2)) * scale
        before = pos_near[keys][None, :] < q_pos[start:end, None]
        weights = log_weights(scores, q_pos[start:end], pos_near[keys]).exp_()
        dv_near[:, :, keys] += torch.matmul(weights.transpose(-1, -2), dout_block)
        grad_log = weights * torch.matmul(dout_block, v_near[:, :, keys].transpose(-1, -2))  # g (B, H, rows, keys)
        # F_ij: the row's total g (the remainder's on the own key, and every preceding key's) less the preceding keys
        # from the nearest to j inclusive.
        farther = grad_log.sum(-1, keepdim=True) - grad_log.masked_fill(~before, 0.0).cumsum(-1)
        dscores = grad_log * torch.sigmoid(-scores) - torch.sigmoid(scores) * farther
        dscores = dscores.masked_fill_(~before, 0.0).mul_(scale)
        dq[:, :, start:end] = torch.matmul(dscores, k_near[:, :, keys])
        dk_near[:, :, keys] += torch.matmul(dscores.transpose(-1, -2), q_block)
    return dq.to(q.dtype), dk_near.flip(-2).to(k.dtype), dv_near.flip(-2).to(v.dtype)


def stick_breaking_attention(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, rows: int | None = None
) -> Tensor:
    """Stick-breaking attention (B, H, Lq, D) of q (B, H, Lq, D) over k, v (B, H, Lk, D), ``rows`` queries a block.

    Keys come in increasing position order and include each query's own position (self-attention, or new queries
    over every cached key). ``rows`` defaults to a block of about ``BLOCK_ELEMENTS`` scores.
    """
    batch, heads, _, _ = q.shape
    rows = rows or block_rows(batch * heads, k.shape[-2])
    return _StickBreakingAttention.apply(q, k, v, None if q_pos is k_pos else q_pos, k_pos, rows)


@register
class StickBreaking(PositionalEncoding):
    """No position encoding: the attention is a stick broken from the nearest key outwards, not a softmax."""

    name = "stick_breaking"
    replaces_softmax = True

    @full_precision
    def attention_weights(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        fp = _precision(q)
        scores = torch.einsum("bhqd,bhkd->bhqk", q.to(fp), k.to(fp).flip(-2)) / math.sqrt(q.shape[-1])
        return log_weights(scores, q_pos, k_pos.flip(0)).exp().flip(-1)  # back to increasing key positions

    def attend(self, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        return stick_breaking_attention(q, k, v, q_pos, k_pos)
