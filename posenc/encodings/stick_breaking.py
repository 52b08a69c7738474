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
ignored). It also declares its ``stick_form``, so that ``attention=triton`` runs it in a fused kernel
(``posenc/attention/triton_stick.py``), tested against the reference.

``attend`` goes tile by tile, a block of query rows against a block of keys, in fp32, the keys nearest first as the
stick is broken (memory O(B·H · rows · keys) at once, never O(Lq × Lk)). With s_ij = σ(−z_ij) = 1 − β_ij (1 on the
keys that do not precede i), a tile's cumulative product of s from its nearest key outwards gives its sticks, and
the stick left past a tile, ℓ_i = Π over the keys of the nearer tiles (exp of the log-space running sum
Σ log σ(−z_ik)), is carried to the next and multiplies it:

    A_ij = ℓ_i · K_i,j−1 · (1 − s_ij) = ℓ_i · (K_i,j−1 − K_ij),    K_ij = Π_{k in the tile, nearer than j or j} s_ik,

and what no key took is ℓ_i past the last tile. One sigmoid and one cumulative product per score, where the log form
costs a log-sigmoid and an exp (three transcendentals against one): faster on a CPU (docs/stick-breaking.md). A product
only falls; once it underflows the stick is used up, and every later weight is below fp32's smallest number either way.

Its backward recomputes each tile and differentiates it by hand (no autograd graph is kept): with
g_ij = A_ij · (dO_i · v_j) and F_ij the g of the keys farther than j plus the remainder's, (1 − Σ A) · (dO_i · target),
which is Δ_i = dO_i · o_i less the g of the keys from the nearest to j (carried from tile to tile, as flash attention
carries its Δ),

    ∂L/∂z_ij = g_ij · s_ij − (1 − s_ij) · F_ij          for j < i,

since ∂s/∂z = −s(1 − s). On CUDA the same tiles run unless ``attention=triton`` is chosen.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posenc.encodings import register
from posenc.encodings.base import PositionalEncoding
from posenc.encodings.forms import StickForm
from posenc.runtime import full_precision

# Where what no key took goes: the query's own value (the reference code's tests) or a learned vector per head (the
# layer the paper's models were trained with).
REMAINDERS = ("value", "head_bias")
# Scores per tile over every (batch, head) at once, and keys per tile. On a CPU, 2^19 (2 MiB fp32 temporaries) of 256
# keys ran fastest single-threaded of the sizes tried (docs/stick-breaking.md: 32 heads of a batch at L 2048, 64 rows
# a tile); on a GPU a tile must be large enough to fill the device (unmeasured: no GPU was at hand, and there the fused
# kernel of ``attention=triton`` is the fast form).
TILE_SCORES = {"cpu": (1 << 19, 256), "cuda": (1 << 25, 1024)}
MIN_ROWS = 16


def default_tile(batch_heads: int, device: torch.device) -> tuple[int, int]:
    """(query rows, keys) per tile for ``batch_heads`` (batch × heads) on this kind of device."""
    scores, keys = TILE_SCORES["cuda" if device.type == "cuda" else "cpu"]
    return max(MIN_ROWS, scores // (batch_heads * keys)), keys


def _precision(q: Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs (checks in double precision): never the activations' half precision."""
    return torch.promote_types(q.dtype, torch.float32)


def _row_blocks(rows: int, q_pos: Tensor, k_pos: Tensor, self_attention: bool) -> list[tuple[int, int, int, int]]:
    """(first row, end row, keys before its last query, keys before its first query) per block of query rows.

    A block reads only the keys before its last query; those before its first query precede all of its rows, so
    only the keys between need a mask. Self-attention knows both counts from the rows; new queries over cached keys
    look them up (keys come in increasing position order).
    """
    length = q_pos.shape[0]
    before = None if self_attention else torch.searchsorted(k_pos, q_pos).tolist()
    blocks = []
    for start in range(0, length, rows):
        end = min(start + rows, length)
        blocks.append((start, end, *((end - 1, start) if before is None else (before[end - 1], before[start]))))
    return blocks


def _tiles(
    q_neg: Tensor, k_near: Tensor, q_pos: Tensor, pos_near: Tensor, visible: int, unmasked: int, keys: int,
    left: Tensor,
) -> Iterator[tuple[slice, Tensor, Tensor, Tensor]]:  # fmt: skip
    """Per tile of ``keys`` keys, nearest first: (its keys, s, A / the stick left before it, that stick left).

    ``q_neg`` (BH, rows, D) holds the block's queries times −1/√D, so that q_neg · k = −z; ``k_near`` (BH, Lk, D)
    and ``pos_near`` hold the keys nearest first (flipped), of which the block reads the last ``visible``, all but
    the last ``unmasked`` of them masked where a key does not precede a row. The stick left ``left`` (BH, rows, 1),
    carried from tile to tile (exp of the log-space running sum, as a product) and updated in place past each,
    multiplies a tile's A: the caller scales the (BH, rows, D) side of a product by it, not the (BH, rows, keys) tile.
    """
    total = k_near.shape[-2]
    masked_to = total - unmasked  # the nearest-first index where the keys that precede every row begin
    for first in range(total - visible, total, keys):
        last = min(first + keys, total)
        rest = torch.bmm(q_neg, k_near[:, first:last].transpose(1, 2))  # −z
        if first < masked_to:  # keys at or after a row's position get −z = +∞, so s = 1: they break nothing
            width = min(last, masked_to) - first
            after = pos_near[first : first + width][None, :] >= q_pos[:, None]
            rest[..., :width].masked_fill_(after, float("inf"))
        rest = rest.sigmoid_()  # s = σ(−z) = 1 − β
        kept = torch.cumprod(rest, -1)  # what the tile's keys up to j leave of the stick
        sticks = F.pad(kept[..., :-1], (1, 0), value=1.0).sub_(kept)  # A_j = kept_{j−1} (1 − s_j) = kept_{j−1} − kept_j
        yield slice(first, last), rest, sticks, left.clone()
        left.mul_(kept[..., -1:])


class _StickBreakingAttention(torch.autograd.Function):
    """o = A · v + remainder · target, tile by tile; the backward recomputes each tile and differentiates by hand."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        q_pos: Tensor | None,
        k_pos: Tensor,
        head_bias: Tensor | None,
        rows: int,
        keys: int,
    ) -> Tensor:
        # q_pos None: self-attention over k_pos (one tensor passed once, as torch.compile wants its inputs distinct).
        # head_bias None: the remainder goes to the query's own value; else to this (H, D) vector.
        return _forward(ctx, q, k, v, q_pos, k_pos, head_bias, rows, keys)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        dq, dk, dv, dhead_bias = _backward(ctx, dout)
        return dq, dk, dv, None, None, dhead_bias, None, None


def _flat(t: Tensor, fp: torch.dtype) -> Tensor:
    """(B, H, L, D) as (B·H, L, D) in ``fp``: one batch of matrix products per tile for every head."""
    return t.to(fp).reshape(-1, *t.shape[-2:])


def _target(v: Tensor, q_pos: Tensor, k_pos: Tensor, head_bias: Tensor | None, fp: torch.dtype) -> Tensor:
    """What the remainder multiplies: each query's own value (B·H, Lq, D), or the head's vector (B·H, 1, D)."""
    if head_bias is None:
        own = _flat(v, fp)
        return own if q_pos is k_pos else own.index_select(1, torch.searchsorted(k_pos, q_pos))
    return head_bias.to(fp).expand(v.shape[0], -1, -1).reshape(-1, 1, v.shape[-1])


def _inputs(q: Tensor, k: Tensor, v: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, float]:
    """Queries times −1/√D, keys and values nearest first, their positions (flipped), and 1/√D; fp32 (fp64 for fp64)."""
    fp, scale = _precision(q), q.shape[-1] ** -0.5
    return _flat(q, fp) * -scale, _flat(k, fp).flip(1), _flat(v, fp).flip(1), k_pos.flip(0), scale


@full_precision
def _forward(
    ctx: Any, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor | None, k_pos: Tensor, head_bias: Tensor | None,
    rows: int, keys: int,
) -> Tensor:  # fmt: skip
    self_attention = q_pos is None
    q_pos = k_pos if self_attention else q_pos
    q_neg, k_near, v_near, pos_near, _ = _inputs(q, k, v, k_pos)
    target = _target(v, q_pos, k_pos, head_bias, q_neg.dtype)
    out = q_neg.new_empty(*q_neg.shape[:-1], v.shape[-1])  # (B·H, Lq, D)
    for start, end, visible, unmasked in _row_blocks(rows, q_pos, k_pos, self_attention):
        # Accumulators of their own: an in-place product into a strided view of ``out`` runs head by head.
        acc, left = (
            q_neg.new_zeros(q_neg.shape[0], end - start, v.shape[-1]),
            q_neg.new_ones(q_neg.shape[0], end - start, 1),
        )
        for keys_at, _, sticks, before in _tiles(q_neg[:, start:end], k_near, q_pos[start:end], pos_near, visible,
                                                 unmasked, keys, left):  # fmt: skip
            acc.addcmul_(before, torch.bmm(sticks, v_near[:, keys_at]))
        out[:, start:end] = acc.addcmul_(left, target if head_bias is not None else target[:, start:end])
    ctx.save_for_backward(q, k, v, k_pos, head_bias, out, *([] if self_attention else [q_pos]))
    ctx.rows, ctx.keys, ctx.self_attention = rows, keys, self_attention
    return out.view(*q.shape[:-1], v.shape[-1]).to(v.dtype)


@full_precision
def _backward(ctx: Any, dout: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """By hand, nearest key first: F_ij (what the keys farther than j and the remainder took) from Δ_i = dO_i · o_i.

    Δ_i less the g of the keys up to j, carried from tile to tile, as flash attention carries its Δ.
    """
    q, k, v, k_pos, head_bias, out, *query_positions = ctx.saved_tensors
    q_pos = query_positions[0] if query_positions else k_pos
    q_neg, k_near, v_near, pos_near, scale = _inputs(q, k, v, k_pos)
    dout = _flat(dout, q_neg.dtype)
    farther_all = (out * dout).sum(-1, keepdim=True).neg_()  # −Δ (B·H, Lq, 1)
    dq, left_all = torch.empty_like(q_neg), q_neg.new_empty(*q_neg.shape[:-1], 1)
    dk_near, dv_near = torch.zeros_like(k_near), torch.zeros_like(v_near)
    for start, end, visible, unmasked in _row_blocks(ctx.rows, q_pos, k_pos, ctx.self_attention):
        q_block, dout_block, dq_block = q_neg[:, start:end], dout[:, start:end], torch.zeros_like(q_neg[:, start:end])
        farther, left = farther_all[:, start:end], q_neg.new_ones(q_neg.shape[0], end - start, 1)
        for keys_at, rest, sticks, before in _tiles(q_block, k_near, q_pos[start:end], pos_near, visible, unmasked,
                                                    ctx.keys, left):  # fmt: skip
            dout_left = dout_block * before  # the stick left before the tile scales its A, so dO's share
            dv_near[:, keys_at] += torch.bmm(sticks.transpose(1, 2), dout_left)
            grad = torch.bmm(dout_left, v_near[:, keys_at].transpose(1, 2)).mul_(sticks)  # g_ij = A_ij (dO_i · v_j)
            grad[..., :1] += farther  # so that its cumulative sum is −F_ij: the g up to j, nearest first, less Δ_i
            farther_tile = grad.cumsum(-1)
            # ∂L/∂z = g s − (1 − s) F, a lerp from −F to g by s (less the carry added to the first g); 0 where s = 1
            dscores = torch.lerp(farther_tile, grad, rest)
            dscores[..., :1] -= rest[..., :1] * farther
            farther = farther_tile[..., -1:]
            dq_block.baddbmm_(dscores, k_near[:, keys_at])
            dk_near[:, keys_at] += torch.bmm(dscores.transpose(1, 2), q_block)
        dq[:, start:end], left_all[:, start:end] = dq_block, left
    dv, dhead_bias, taken = dv_near.flip(1), None, left_all * dout  # the remainder's share of dO
    if head_bias is not None:
        dhead_bias = taken.view(*v.shape[:2], -1, v.shape[-1]).sum((0, 2)).to(head_bias.dtype)  # (H, D)
    elif ctx.self_attention:  # the remainder took the query's own value
        dv += taken
    else:
        dv.index_add_(1, torch.searchsorted(k_pos, q_pos), taken)
    grads = dq.mul_(scale), dk_near.flip(1).neg_(), dv  # dk: Σ dz (−q_neg)
    return (*(g.view(t.shape).to(t.dtype) for g, t in zip(grads, (q, k, v), strict=True)), dhead_bias)


def stick_breaking_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    head_bias: Tensor | None = None,
    tile: tuple[int, int] | None = None,
) -> Tensor:
    """Stick-breaking attention (B, H, Lq, D) of q (B, H, Lq, D) over k, v (B, H, Lk, D), tile by tile.

    Keys come in increasing position order and include each query's own position (self-attention, or new queries
    over every cached key). The remainder goes to each query's own value, or to ``head_bias`` (H, D) when given.
    ``tile`` is (query rows, keys) per tile, ``default_tile`` by default.
    """
    rows, keys = tile or default_tile(q.shape[0] * q.shape[1], q.device)
    return _StickBreakingAttention.apply(q, k, v, None if q_pos is k_pos else q_pos, k_pos, head_bias, rows, keys)


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

    def stick_form(self) -> StickForm:
        return StickForm(head_bias=self.head_bias, finish=self._finish)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, remainder={self.remainder}, head_norm={self.head_norm}"
