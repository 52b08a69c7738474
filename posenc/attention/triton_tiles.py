"""Tile-level pieces of the ``triton`` backend's kernels (``triton_kernels.py``): scores, dS, the table's gradient.

A tile is BLOCK_M queries by BLOCK_N keys of one (batch, head). ``_scores`` adds table[h, i − j] to the scaled scores;
``_probs_and_dscores`` recomputes P from the row log-sum-exp and forms dS = P ∘ (dO·vᵀ − Δ). The table's gradient,
dtable[h, d] = Σ_{b, i−j=d} dS_ij, is reduced per tile along its diagonals: the tile is skewed so that its diagonals
become columns (``tl.gather``) and summed over rows, giving one value per distance the tile holds. Then either:

- ``_add_diagonal_sums``: one atomic add per (tile, distance) into dtable, not one per score. Atomics from many
  programs land in an order that varies from run to run, so fp32's rounding does too;
- ``_diagonal_halves`` (deterministic, square tiles of B): the tile's sums split at its block boundary, the distances
  (m − n)·B + 0 .. B − 1 (its upper half) and the B − 1 below them (its lower half, the next block down). A query block
  visits its key tiles in a fixed order, each tile's upper half completed by the previous tile's lower half, so it
  writes every block of distances exactly once, with no atomics, into a buffer of its own; torch then sums the
  buffer over query blocks and batch in a fixed order. Bitwise the same on every run, at the cost of that buffer
  (B · H · (L / B_M) · L fp32).
"""

# Triton's conventions: constexpr parameters in capitals, and no Python type hints on JIT arguments (Triton reads
# annotations as specialisation hints, and the values are tensors of its own).
# ruff: noqa: ANN001, ANN202, N803

from __future__ import annotations

import triton
import triton.language as tl

# exp(x) = exp2(x · log2 e): the kernels work in base 2, the lse is stored natural. A constexpr, because a
# @triton.jit function may read no other module global: compiled for a GPU, a plain float here is a NameError at
# the first launch (Triton's interpreter, which runs the kernels as Python, would not notice).
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _scores(
    q,
    k,
    table_row,
    rows,
    cols,
    length,
    window,
    scale,
    HAS_BIAS: tl.constexpr,
    LOCAL: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Scaled scores plus bias (BLOCK_M, BLOCK_N) in fp32 natural units, and where keys are visible and in range.

    Visible: causal and, in a ``LOCAL`` layer, fewer than ``window`` positions back. Rows past the length (the last
    block's padding) read no bias, and nothing of them is stored or, in the backward, counted.
    """
    distance = rows[:, None] - cols[None, :]
    causal = (distance >= 0) & (cols[None, :] < length)
    if LOCAL:
        causal = causal & (distance < window)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    if HAS_BIAS:
        scores += tl.load(table_row + distance, mask=causal & (rows[:, None] < length), other=0.0)
    return scores, causal


@triton.jit
def _probs_and_dscores(
    q,
    k,
    v,
    dout,
    lse,
    delta,
    table_row,
    rows,
    cols,
    length,
    window,
    scale,
    HAS_BIAS: tl.constexpr,
    LOCAL: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """P recomputed from the lse, and dS = P ∘ (dO·vᵀ − Δ), both (BLOCK_M, BLOCK_N) fp32, zero outside the mask."""
    scores, causal = _scores(q, k, table_row, rows, cols, length, window, scale, HAS_BIAS, LOCAL, PRECISION)
    valid = causal & (rows[:, None] < length)
    probs = tl.where(valid, tl.exp2((scores - lse[:, None]) * LOG2E), 0.0)
    dprobs = tl.dot(dout, tl.trans(v), input_precision=PRECISION)
    return probs, probs * (dprobs - delta[:, None])


@triton.jit
def _add_diagonal_sums(
    DTable,
    dscores,
    row_start,
    col_start,
    length,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WIDTH: tl.constexpr,
):
    """dtable[d] += Σ over the tile's diagonal i − j = d of dS: one atomic per diagonal of the tile.

    Column t of the skewed tile holds row r's entry at column r + BLOCK_N − 1 − t, so the tile's diagonal
    i − j = t − (BLOCK_N − 1) becomes column t; WIDTH ≥ BLOCK_M + BLOCK_N − 1 columns cover every diagonal.
    """
    r = tl.arange(0, BLOCK_M)[:, None]
    t = tl.arange(0, WIDTH)[None, :]
    source_col = r + (BLOCK_N - 1) - t  # (BLOCK_M, WIDTH)
    inside = (source_col >= 0) & (source_col < BLOCK_N)
    skewed = tl.gather(dscores, tl.where(inside, source_col, 0), axis=1)
    sums = tl.sum(tl.where(inside, skewed, 0.0), axis=0)  # (WIDTH,)
    distance = row_start - col_start + tl.arange(0, WIDTH) - (BLOCK_N - 1)
    tl.atomic_add(DTable + distance, sums, mask=(distance >= 0) & (distance < length))


@triton.jit
def _diagonal_halves(dscores, BLOCK: tl.constexpr):
    """(lower, upper), each (BLOCK,): a square tile's sums of dS by distance, split at its block boundary.

    With e = i − j within the tile, upper[p] sums the diagonal e = p (p = 0 .. BLOCK − 1), lower[p] the diagonal
    e = p − BLOCK (p = 1 .. BLOCK − 1; lower[0] is 0): in the tile's distance block and in the block below it.
    """
    r = tl.arange(0, BLOCK)[:, None]
    p = tl.arange(0, BLOCK)[None, :]
    upper_col = r - p  # the tile column of row r on diagonal e = p
    lower_col = r + BLOCK - p  # ... on diagonal e = p − BLOCK
    upper_in = upper_col >= 0
    lower_in = (lower_col < BLOCK) & (p > 0)
    upper = tl.gather(dscores, tl.where(upper_in, upper_col, 0), axis=1)
    lower = tl.gather(dscores, tl.where(lower_in, lower_col, 0), axis=1)
    return tl.sum(tl.where(lower_in, lower, 0.0), axis=0), tl.sum(tl.where(upper_in, upper, 0.0), axis=0)


@triton.jit
def _table_grad_tile(
    DTable,
    dscores,
    pending,
    h,
    length,
    start_n,
    DETERMINISTIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WIDTH: tl.constexpr,
):
    """The query block's tile at key ``start_n``: its share of the table's gradient; returns the next ``pending``.

    Atomics add the tile's diagonal sums into row ``h`` of the (H, L) gradient. ``DETERMINISTIC`` (square tiles:
    tile (m, n) holds distances (m − n)·B − (B − 1) .. (m − n)·B + B − 1) stores the upper half plus ``pending``
    (the previous tile's lower half, same block of distances) once, in the program's own row of the buffer, so no
    two programs write one address and the caller's fixed-order sum is reproducible; the lower half is returned.
    """
    start_m = tl.program_id(0)
    if DETERMINISTIC:
        blocks = tl.num_programs(0)
        partial_row = (tl.program_id(1).to(tl.int64) * blocks + start_m) * blocks * BLOCK_N
        lower, upper = _diagonal_halves(dscores, BLOCK_N)
        block = start_m - start_n // BLOCK_N
        tl.store(DTable + partial_row + block * BLOCK_N + tl.arange(0, BLOCK_N), upper + pending)
        return lower  # the last tile's (block −1: negative distances, masked) is dropped
    _add_diagonal_sums(DTable + h * length, dscores, start_m * BLOCK_M, start_n, length, BLOCK_M, BLOCK_N, WIDTH)
    return pending
