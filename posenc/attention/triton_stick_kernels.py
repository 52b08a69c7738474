"""Triton kernels of the ``triton`` backend for stick-breaking attention (a scheme's ``stick_form``).

Query i breaks a stick from its nearest earlier key outwards: A_ij = β_ij Π_{j<k<i} (1 − β_ik), β = σ(q·k/√D), and
what no key took goes to a target (the query's own value, or the head's vector), docs/stick-breaking.md. In base 2
with z the score over ln 2, log2 β = z − softplus2(z) and log2 (1 − β) = −softplus2(z), softplus2(z) =
log2(1 + 2^z). A program takes one block of queries and walks its key blocks from the diagonal outwards, as the
stick is broken, carrying ``left`` = Σ log2 (1 − β) over the keys of the blocks already walked (the log of the
stick left); within a block, the keys nearer than j add a reverse cumulative sum, so that

    log2 A_ij = log2 β_ij + left_i + Σ_{k in the block, k > j} log2 (1 − β_ik) = z_ij + left_i + suffix_ij,

suffix_ij being the inclusive reverse cumulative sum (the β of key j cancels its own 1 − β). Everything stays in
fp32: only A (forward) and dS (backward) are rounded to the inputs' dtype for their matrix products, as flash
attention rounds P and dS.

The backward is one program per query block too, walking the key blocks in the same order with the same carries:
with g_ij = A_ij (dO_i · v_j), −F_ij (what the keys farther than j and the remainder took, negated) is the g of the
keys from the nearest to j less Δ_i = dO_i · o_i (computed by the caller), carried from block to block, and
∂L/∂z_ij = g_ij − β_ij (g_ij + F_ij). dq is this program's; dk and dv are sums over every query block, added with
atomics into fp32 buffers (an order that varies from run to run), as the reference implementation adds them. The
stick left past the last key, the remainder, is written per row for the caller, who adds its share to the target's
gradient.

Which mode the kernels run in is fixed when this module is imported: compiled for the GPU, or Python under
Triton's interpreter when ``TRITON_INTERPRET=1`` is set (how the tests run them on CPU).
"""

# Triton's conventions: constexpr parameters in capitals, and no Python type hints on JIT arguments (Triton reads
# annotations as specialisation hints, and the values are tensors of its own).
# ruff: noqa: ANN001, ANN201, ANN202, N803

from __future__ import annotations

import triton
import triton.language as tl

from posenc.attention.triton_tiles import LOG2E

INTERPRETED = bool(triton.knobs.runtime.interpret)


@triton.jit
def _softplus2(x):
    """log2(1 + 2^x) in fp32 at any x, as max(x, 0) + log2(1 + 2^−|x|): no overflow, no threshold."""
    return tl.maximum(x, 0.0) + tl.log2(1.0 + tl.exp2(-tl.abs(x)))


@triton.jit
def _sticks(q, k, rows, cols, length, left, scale, PRECISION: tl.constexpr):
    """One tile's scores in base 2, where keys precede rows, log2 (1 − β), and A; all (BLOCK_M, BLOCK_N) fp32.

    ``left`` (BLOCK_M,) is log2 of the stick left by the nearer blocks' keys. Keys at or after a row's query, or past
    the length, take nothing: log2 (1 − β) = 0 and A = 0 there.
    """
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * (scale * LOG2E)
    before = (cols[None, :] < rows[:, None]) & (cols[None, :] < length)
    log_rest = tl.where(before, -_softplus2(scores), 0.0)
    suffix = tl.cumsum(log_rest, axis=1, reverse=True)  # keys j and nearer within the tile
    return scores, before, log_rest, tl.where(before, tl.exp2(scores + suffix + left[:, None]), 0.0)


@triton.jit
def stick_forward_kernel(
    Q,
    K,
    V,
    HeadBias,
    Out,
    stride_qb,
    stride_qh,
    stride_ql,
    stride_kb,
    stride_kh,
    stride_kl,
    stride_vb,
    stride_vh,
    stride_vl,
    stride_ob,
    stride_oh,
    stride_ol,
    stride_bias,
    num_heads,
    length,
    head_dim,
    scale,
    OWN_VALUE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One query block of one (batch, head): O = Σ_j A_ij v_j + remainder_i · target_i.

    ``OWN_VALUE``: the target is the query's own value; else the head's vector ``HeadBias`` (H, D) row h.
    """
    scale = tl.cast(scale, tl.float32)  # Inductor passes a Python float as fp64: it would promote the loop
    start_m = tl.program_id(0)
    batch_head = tl.program_id(1)
    b = batch_head // num_heads
    h = batch_head % num_heads
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims[None, :] < head_dim
    row_ok = rows[:, None] < length
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_ql + dims[None, :], row_ok & dim_ok, 0.0)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh

    left = tl.zeros([BLOCK_M], tl.float32)  # log2 of the stick left
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = tl.minimum((start_m + 1) * BLOCK_M, length)
    blocks = tl.cdiv(end - 1, BLOCK_N)  # the key blocks holding keys 0 .. end − 2, those that precede a row
    for step in range(0, blocks):
        cols = (blocks - 1 - step) * BLOCK_N + tl.arange(0, BLOCK_N)  # nearest block first
        col_ok = cols[:, None] < length
        k = tl.load(k_base + cols[:, None] * stride_kl + dims[None, :], col_ok & dim_ok, 0.0)
        v = tl.load(v_base + cols[:, None] * stride_vl + dims[None, :], col_ok & dim_ok, 0.0)
        _, _, log_rest, sticks = _sticks(q, k, rows, cols, length, left, scale, PRECISION)
        acc += tl.dot(sticks.to(v.dtype), v, input_precision=PRECISION)
        left += tl.sum(log_rest, 1)

    remainder = tl.exp2(left)[:, None]
    if OWN_VALUE:
        own = tl.load(v_base + rows[:, None] * stride_vl + dims[None, :], row_ok & dim_ok, 0.0)
        acc += remainder * own.to(tl.float32)
    else:
        vector = tl.load(HeadBias + h * stride_bias + dims, dims < head_dim, 0.0)
        acc += remainder * vector.to(tl.float32)[None, :]
    o_ptrs = Out + b * stride_ob + h * stride_oh + rows[:, None] * stride_ol + dims[None, :]
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), row_ok & dim_ok)


@triton.jit
def stick_backward_kernel(
    Q,
    K,
    V,
    DOut,
    Delta,
    DQ,
    DK,
    DV,
    Remainder,
    stride_qb,
    stride_qh,
    stride_ql,
    stride_kb,
    stride_kh,
    stride_kl,
    stride_vb,
    stride_vh,
    stride_vl,
    stride_db,
    stride_dh,
    stride_dl,
    num_heads,
    length,
    head_dim,
    scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One query block: its dq, its share of dk and dv (atomically added), and each row's remainder.

    ``DOut``, ``DQ``, ``DK`` and ``DV`` share the strides ``stride_d*`` (all laid out like a contiguous (B, H, L, D));
    ``DK`` and ``DV`` are zeroed fp32 buffers. ``Delta`` and ``Remainder`` are (B·H, L) fp32.
    """
    scale = tl.cast(scale, tl.float32)  # Inductor passes a Python float as fp64: it would promote the loop
    start_m = tl.program_id(0)
    batch_head = tl.program_id(1)
    b = batch_head // num_heads
    h = batch_head % num_heads
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims[None, :] < head_dim
    row_ok = rows[:, None] < length
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_ql + dims[None, :], row_ok & dim_ok, 0.0)
    d_base = b * stride_db + h * stride_dh
    dout = tl.load(DOut + d_base + rows[:, None] * stride_dl + dims[None, :], row_ok & dim_ok, 0.0)
    farther = -tl.load(Delta + batch_head * length + rows, rows < length, 0.0)  # −F before the nearest key: −Δ
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh

    left = tl.zeros([BLOCK_M], tl.float32)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = tl.minimum((start_m + 1) * BLOCK_M, length)
    blocks = tl.cdiv(end - 1, BLOCK_N)
    for step in range(0, blocks):
        cols = (blocks - 1 - step) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols[:, None] < length
        k = tl.load(k_base + cols[:, None] * stride_kl + dims[None, :], col_ok & dim_ok, 0.0)
        v = tl.load(v_base + cols[:, None] * stride_vl + dims[None, :], col_ok & dim_ok, 0.0)
        scores, before, log_rest, sticks = _sticks(q, k, rows, cols, length, left, scale, PRECISION)
        grad = sticks * tl.dot(dout, tl.trans(v), input_precision=PRECISION)  # g_ij = A_ij (dO_i · v_j)
        farther_tile = farther[:, None] + tl.cumsum(grad, axis=1, reverse=True)  # −F_ij
        beta = tl.where(before, tl.exp2(scores + log_rest), 0.0)
        dscores = grad - beta * (grad - farther_tile)  # ∂L/∂z = g (1 − β) − β F; 0 where no key precedes
        dq += tl.dot(dscores.to(k.dtype), k, input_precision=PRECISION)
        dk = tl.dot(tl.trans(dscores.to(q.dtype)), q, input_precision=PRECISION) * scale
        dv = tl.dot(tl.trans(sticks.to(dout.dtype)), dout, input_precision=PRECISION)
        key_offsets = d_base + cols[:, None] * stride_dl + dims[None, :]
        tl.atomic_add(DK + key_offsets, dk, mask=col_ok & dim_ok)
        tl.atomic_add(DV + key_offsets, dv, mask=col_ok & dim_ok)
        farther += tl.sum(grad, 1)
        left += tl.sum(log_rest, 1)

    tl.store(DQ + d_base + rows[:, None] * stride_dl + dims[None, :], (dq * scale).to(DQ.dtype.element_ty),
             row_ok & dim_ok)  # fmt: skip
    tl.store(Remainder + batch_head * length + rows, tl.exp2(left), rows < length)
