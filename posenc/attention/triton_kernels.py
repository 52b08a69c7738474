"""Triton kernels of the ``triton`` backend: causal flash attention plus a per-head bias table by distance.

The score of query i and key j is q_i·k_j/√d + table[h, i − j] (j ≤ i), so one kernel serves every scheme whose
bias is a function of distance alone; the table comes from the scheme's ``distance_bias``. A local layer (``LOCAL``)
passes its ``window``: keys ``window`` or more positions back are masked, and every loop starts or ends at the first or
last block its window reaches, so a local layer reads L · W scores, not L². A global layer's kernels are compiled
without any of it (``LOCAL`` is a constexpr), so the window costs them no register. The forward is
FlashAttention-2's (online softmax, fp32 accumulation, the row log-sum-exp saved); the backward recomputes P
from the lse with Δ_i = dO_i·O_i (computed by the caller), one kernel for dk, dv (a program per key block) and
one for dq (a program per query block). The dq kernel also reduces the table's gradient,
dtable[h, d] = Σ_{b, i−j=d} dS_ij, per tile along its diagonals (``triton_tiles.py``): one atomic per
(tile, distance), not one per score, which is what made FlexAttention's backward of a learnable bias hundreds of
times slower than the forward (``docs/learnable-bias-gradient.md``); or, ``DETERMINISTIC``, each block of distances
written once per query block into a buffer that the caller sums in a fixed order.

Which mode the kernels run in is fixed when this module is imported: compiled for the GPU, or Python under
Triton's interpreter when ``TRITON_INTERPRET=1`` is set (how the tests run them on CPU). The backend imports it
lazily, on its first call.
"""

# Triton's conventions: constexpr parameters in capitals, and no Python type hints on JIT arguments (Triton reads
# annotations as specialisation hints, and the values are tensors of its own).
# ruff: noqa: ANN001, ANN201, ANN202, N803

from __future__ import annotations

import triton
import triton.language as tl

from posenc.attention.triton_tiles import LOG2E, _probs_and_dscores, _scores, _table_grad_tile

INTERPRETED = bool(triton.knobs.runtime.interpret)


@triton.jit
def _first_key_block(start_m, window, LOCAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The first key block a query block reads: the one holding its first query's earliest visible key."""
    if LOCAL:
        return tl.maximum(start_m * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    return 0


@triton.jit
def forward_kernel(
    Q,
    K,
    V,
    Out,
    Lse,
    Table,
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
    stride_table,
    num_heads,
    length,
    head_dim,
    scale,
    window,
    HAS_BIAS: tl.constexpr,
    LOCAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One query block of one (batch, head): O and lse (natural log) by the online softmax."""
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
    table_row = Table + h * stride_table

    # Key 0 is causal for every row, so a global layer's running max is finite after the first block: no NaN. A local
    # layer's first block may hold no visible key for some rows: its running max starts finite (masked scores are
    # -inf, so they still weigh 0) rather than make the first correction exp2(-inf + inf).
    if LOCAL:
        row_max = tl.full([BLOCK_M], -1.0e30, tl.float32)  # base 2
    else:
        row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    end = tl.minimum((start_m + 1) * BLOCK_M, length)  # causal: no key past the block's last query
    for start_n in range(_first_key_block(start_m, window, LOCAL, BLOCK_M, BLOCK_N), end, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        col_ok = cols[:, None] < length
        k = tl.load(k_base + cols[:, None] * stride_kl + dims[None, :], col_ok & dim_ok, 0.0)
        v = tl.load(v_base + cols[:, None] * stride_vl + dims[None, :], col_ok & dim_ok, 0.0)
        scores, causal = _scores(q, k, table_row, rows, cols, length, window, scale, HAS_BIAS, LOCAL, PRECISION)
        scores = tl.where(causal, scores * LOG2E, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        correction = tl.exp2(row_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        row_sum = row_sum * correction + tl.sum(probs, 1)
        acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        row_max = new_max

    out = acc / row_sum[:, None]
    o_ptrs = Out + b * stride_ob + h * stride_oh + rows[:, None] * stride_ol + dims[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), row_ok & dim_ok)
    lse = (row_max + tl.log2(row_sum)) / LOG2E
    tl.store(Lse + batch_head * length + rows, lse, rows < length)


@triton.jit
def backward_dq_kernel(
    Q,
    K,
    V,
    DOut,
    Lse,
    Delta,
    DQ,
    Table,
    DTable,
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
    stride_table,
    num_heads,
    length,
    head_dim,
    scale,
    window,
    HAS_BIAS: tl.constexpr,
    LOCAL: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    DETERMINISTIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WIDTH: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One query block: dq = Σ_j dS_ij k_j · scale, and (``BIAS_GRAD``) the table's gradient from its tiles.

    ``DOut`` and ``DQ`` share the strides ``stride_d*`` (both are laid out like the caller's contiguous dO).
    ``DTable`` is the (H, L) gradient the atomics add into, or (``DETERMINISTIC``, square tiles) a zeroed buffer of
    one row per (batch, head, query block), each ``tl.num_programs(0) · BLOCK_N`` distances long, which this program
    fills with one store per block of distances it reaches.
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
    d_offsets = b * stride_db + h * stride_dh + rows[:, None] * stride_dl + dims[None, :]
    dout = tl.load(DOut + d_offsets, row_ok & dim_ok, 0.0)
    lse = tl.load(Lse + batch_head * length + rows, rows < length, 0.0)
    delta = tl.load(Delta + batch_head * length + rows, rows < length, 0.0)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    table_row = Table + h * stride_table

    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    pending = tl.zeros([BLOCK_N], tl.float32)  # DETERMINISTIC: the previous tile's lower half of diagonal sums
    end = tl.minimum((start_m + 1) * BLOCK_M, length)
    for start_n in range(_first_key_block(start_m, window, LOCAL, BLOCK_M, BLOCK_N), end, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        col_ok = cols[:, None] < length
        k = tl.load(k_base + cols[:, None] * stride_kl + dims[None, :], col_ok & dim_ok, 0.0)
        v = tl.load(v_base + cols[:, None] * stride_vl + dims[None, :], col_ok & dim_ok, 0.0)
        _, dscores = _probs_and_dscores(
            q, k, v, dout, lse, delta, table_row, rows, cols, length, window, scale, HAS_BIAS, LOCAL, PRECISION
        )
        dq += tl.dot(dscores.to(k.dtype), k, input_precision=PRECISION)
        if BIAS_GRAD:
            pending = _table_grad_tile(
                DTable, dscores, pending, h, length, start_n, DETERMINISTIC, BLOCK_M, BLOCK_N, WIDTH
            )
    tl.store(DQ + d_offsets, (dq * scale).to(DQ.dtype.element_ty), row_ok & dim_ok)


@triton.jit
def backward_dkdv_kernel(
    Q,
    K,
    V,
    DOut,
    Lse,
    Delta,
    DK,
    DV,
    Table,
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
    stride_table,
    num_heads,
    length,
    head_dim,
    scale,
    window,
    HAS_BIAS: tl.constexpr,
    LOCAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One key block: dv = Σ_i P_ij dO_i and dk = Σ_i dS_ij q_i · scale over the queries at or after it.

    ``DOut``, ``DK`` and ``DV`` share the strides ``stride_d*`` (all laid out like a contiguous (B, H, L, D)).
    """
    scale = tl.cast(scale, tl.float32)  # Inductor passes a Python float as fp64: it would promote the loop
    start_n = tl.program_id(0)
    batch_head = tl.program_id(1)
    b = batch_head // num_heads
    h = batch_head % num_heads
    cols = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims[None, :] < head_dim
    col_ok = cols[:, None] < length
    k = tl.load(K + b * stride_kb + h * stride_kh + cols[:, None] * stride_kl + dims[None, :], col_ok & dim_ok, 0.0)
    v = tl.load(V + b * stride_vb + h * stride_vh + cols[:, None] * stride_vl + dims[None, :], col_ok & dim_ok, 0.0)
    q_base = Q + b * stride_qb + h * stride_qh
    d_base = b * stride_db + h * stride_dh
    table_row = Table + h * stride_table

    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    first = (start_n * BLOCK_N // BLOCK_M) * BLOCK_M  # causal: no query before the block's first key
    # and, in a local layer, none window or more positions after its last key sees it
    last = length
    if LOCAL:
        last = tl.minimum(length, (start_n + 1) * BLOCK_N - 1 + window)
    for start_m in range(first, last, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        row_ok = rows[:, None] < length
        q = tl.load(q_base + rows[:, None] * stride_ql + dims[None, :], row_ok & dim_ok, 0.0)
        dout = tl.load(DOut + d_base + rows[:, None] * stride_dl + dims[None, :], row_ok & dim_ok, 0.0)
        lse = tl.load(Lse + batch_head * length + rows, rows < length, 0.0)
        delta = tl.load(Delta + batch_head * length + rows, rows < length, 0.0)
        probs, dscores = _probs_and_dscores(
            q, k, v, dout, lse, delta, table_row, rows, cols, length, window, scale, HAS_BIAS, LOCAL, PRECISION
        )
        dv += tl.dot(tl.trans(probs.to(dout.dtype)), dout, input_precision=PRECISION)
        dk += tl.dot(tl.trans(dscores.to(q.dtype)), q, input_precision=PRECISION)
    d_offsets = d_base + cols[:, None] * stride_dl + dims[None, :]
    tl.store(DK + d_offsets, (dk * scale).to(DK.dtype.element_ty), col_ok & dim_ok)
    tl.store(DV + d_offsets, dv.to(DV.dtype.element_ty), col_ok & dim_ok)
