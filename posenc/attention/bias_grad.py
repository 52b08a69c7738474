"""Gradients of learnable attention biases from the two identities of ``learnable-bias-gradient.md``.

Both work from what a flash-style forward leaves behind (q, k, v, the output O and the row log-sum-exp) and the
output gradient dO, never build an (L × L) tensor and never add into a parameter once per score. With
Δ_i = dO_i · O_i and dS_ij = P_ij (dO_i · v_j − Δ_i), a bias parameter's gradient is Σ_ij dS_ij ∂b_ij/∂θ:

- Identity 1 (``DerivativeForm``, ∂b/∂θ_h = scale_h · f with f ≥ 0): one more attention forward with the scores
  shifted by log f gives O' and lse'; then Σ_ij dS_ij f_ij = Σ_i e^(lse'_i − lse_i) (dO_i · O'_i − Δ_i).
- Identity 2 (``TableForm``, a table constant from distance ``horizon`` on): every row of dS sums to zero, so the
  sums of dS along the ``horizon`` diagonals next to the main one give every entry but the last, and the last is
  minus their total. The band is computed in query chunks against a key window (O(L · horizon) work and memory).
- Per distance: the gradient of a bias table read by distance (``tables.py``) is the sum of its mask's gradient
  along each diagonal, dtable[h, d] = Σ_{b, i − j = d} dS_ij; ``diagonal_totals`` takes it for every distance at once
  by skewing the (H, Lq, Lk) gradient (a pad and a reshape turn its diagonals into columns): no scatter, no atomics,
  the same sum on every run.

Everything here runs in fp32 (bias arithmetic, dS, the reductions), whatever the activations' dtype, autocast off.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from posenc.encodings.forms import TableForm
from posenc.runtime import full_precision

BAND_CHUNK = 64  # queries per chunk of the band: the key window is BAND_CHUNK + horizon - 1 wide
BAND_MAX_ELEMENTS = 1 << 24  # scores held at once by the band pass (64 MiB in fp32 per temporary)


@full_precision
def row_deltas(out: Tensor, dout: Tensor) -> Tensor:
    """Δ_i = dO_i · O_i (B, H, L) in fp32: the softmax backward's per-row term.

    A product and a sum, not an einsum: the einsum runs as a batched matrix product (cuBLAS), which CUDA refuses
    under deterministic algorithms unless CUBLAS_WORKSPACE_CONFIG was set before its first call, and the
    deterministic table gradient calls this.
    """
    return (dout.float() * out.float()).sum(dim=-1)


@full_precision
def derivative_sums(lse: Tensor, dout: Tensor, deltas: Tensor, out_f: Tensor, lse_f: Tensor) -> Tensor:
    """Σ_{b,i,j} dS_ij · f_ij per head (H,) by Identity 1, from the forward (``out_f``, ``lse_f``) with S + log f."""
    weight = torch.exp(lse_f.float() - lse.float())  # Σ_j P_ij f_ij; 0 on rows where f vanishes (lse' = -inf)
    per_row = torch.einsum("bhld,bhld->bhl", dout.float(), out_f.float()) - deltas
    # A row with f = 0 everywhere has no defined O' (zero or NaN depending on the kernel): its weight is 0.
    return torch.where(weight > 0, weight * per_row, 0.0).sum(dim=(0, 2))


@full_precision
def diagonal_sums(
    q: Tensor, k: Tensor, v: Tensor, lse: Tensor, dout: Tensor, deltas: Tensor, band_bias: Tensor
) -> Tensor:
    """Σ_{b,i} dS_{i,i−d} for d = 0 .. W−1, per head (H, W), where ``band_bias`` (H, W) is the full bias at d.

    Queries go in chunks of C; chunk t (rows tC .. tC+C−1) sees the key window tC−W+1 .. tC+C−1, so every
    pair with 0 ≤ i − j < W lies in exactly one chunk, at window column c = r + W − 1 − d for row r.
    """
    batch, heads, length, head_dim = q.shape
    width = band_bias.shape[-1]
    chunk = BAND_CHUNK
    num_chunks = -(-length // chunk)  # integer ceil: stays symbolic under torch.compile's dynamic shapes
    tail = num_chunks * chunk - length
    window = chunk + width - 1

    # Padded rows get lse = +inf (P = 0); front-padded keys are masked by their position below.
    q_rows = F.pad(q, (0, 0, 0, tail)).unflatten(2, (num_chunks, chunk))  # (B, H, n, C, D)
    dout_rows = F.pad(dout, (0, 0, 0, tail)).unflatten(2, (num_chunks, chunk))
    lse_rows = F.pad(lse.float(), (0, tail), value=float("inf")).unflatten(2, (num_chunks, chunk))  # (B, H, n, C)
    delta_rows = F.pad(deltas, (0, tail)).unflatten(2, (num_chunks, chunk))
    k_windows = F.pad(k, (0, 0, width - 1, tail)).unfold(2, window, chunk)  # (B, H, n, D, window)
    v_windows = F.pad(v, (0, 0, width - 1, tail)).unfold(2, window, chunk)

    device = q.device
    rows = torch.arange(chunk, device=device)
    offsets = torch.arange(width, device=device)
    columns = rows[:, None] + offsets[None, :]  # (C, W): column t of row r is distance W − 1 − t
    bias_by_column = band_bias.float().flip(-1)[:, None, None, :]  # (H, 1, 1, W)
    scale = 1.0 / math.sqrt(head_dim)

    sums = torch.zeros(heads, width, device=device, dtype=torch.float32)
    per_group = max(1, BAND_MAX_ELEMENTS // (batch * heads * chunk * window))
    # One group needs no loop, so a compiled caller guards on a bound of the length rather than its value.
    groups = [slice(0, num_chunks)] if num_chunks <= per_group else chunk_groups(num_chunks, per_group)
    for group in groups:
        n = group.stop - group.start
        index = columns.expand(batch, heads, n, chunk, width)
        scores = torch.matmul(q_rows[:, :, group].float(), k_windows[:, :, group].float()) * scale
        scores = scores.gather(-1, index) + bias_by_column  # (B, H, n, C, W)
        probs = torch.exp(scores - lse_rows[:, :, group, :, None])
        key_pos = (torch.arange(group.start, group.stop, device=device) * chunk)[:, None, None] + columns - width + 1
        probs = probs.masked_fill(key_pos < 0, 0.0)  # keys before the sequence start (front padding)
        dprobs = torch.matmul(dout_rows[:, :, group].float(), v_windows[:, :, group].float()).gather(-1, index)
        dscores = probs * (dprobs - delta_rows[:, :, group, :, None])
        sums += dscores.sum(dim=(0, 2, 3))
    return sums.flip(-1)


def chunk_groups(num_chunks: int, per_group: int) -> list[slice]:
    """Consecutive slices of at most ``per_group`` chunks covering ``0 .. num_chunks``."""
    return [slice(first, min(first + per_group, num_chunks)) for first in range(0, num_chunks, per_group)]


def table_gradient(form: TableForm, diagonals: Tensor, totals: Tensor | None = None) -> Tensor:
    """The table's gradient from the diagonal sums (H, ≥ horizon) by Identity 2 (the last entry: minus the rest).

    ``totals`` (H,): Σ_ij dS_ij per head when the rows of dS do not sum to zero (a sink's lse gradient): the last
    entry is then that total minus the rest.
    """
    near = diagonals[:, : form.horizon]
    rest = -near.sum(dim=-1, keepdim=True) if totals is None else totals[:, None] - near.sum(dim=-1, keepdim=True)
    per_distance = torch.cat((near, rest), dim=-1)  # (H, horizon + 1)
    grad = torch.zeros(form.table.shape, device=diagonals.device, dtype=torch.float32)
    return grad.index_add_(1, form.index.to(diagonals.device), per_distance)


def diagonal_totals(grad: Tensor, offset: Tensor, span: int) -> Tensor:
    """(H, span) fp32: Σ of ``grad`` (…, H, Lq, Lk) over the entries at distance d = offset + i − j, d = 0 .. span − 1.

    Row i of the skewed copy holds row i of ``grad`` with its columns reversed and shifted right by i, so that entry
    (i, j) lands in column t = i + Lk − 1 − j, which is distance offset + t − (Lk − 1) for every row. ``offset`` is a
    tensor (the first query's distance to the first key): no host sync, and a compiled caller keeps one graph.
    """
    grad = grad.float().reshape(-1, *grad.shape[-3:]).sum(0)  # (H, Lq, Lk): a batch of masks shares the table
    heads, rows, cols = grad.shape
    width = rows + cols - 1
    skewed = F.pad(grad.flip(-1), (0, rows)).reshape(heads, rows * (cols + rows))[:, : rows * width]
    sums = skewed.reshape(heads, rows, width).sum(1)  # (H, width): column t is distance offset + t − (cols − 1)
    column = torch.arange(span, device=grad.device) - offset + (cols - 1)
    inside = (column >= 0) & (column < width)
    return torch.where(inside, sums[:, column.clamp(0, width - 1)], 0.0)
