"""PaTH: position encoding by accumulating Householder transformations between key and query.

Yang et al., NeurIPS 2025, "PaTH Attention: Position Encoding via Accumulating Householder Transformations".

Between key j and query i sit the transformations of every token after the key up to the query (the paper's Eq. 2):

    s_ij = k_jᵀ (H_{j+1} H_{j+2} ⋯ H_i) q_i / √D,    H_t = I − β_t w_t w_tᵀ,

softmax over j ≤ i as usual. Each H_t is read from the layer's input x_t, as the published layer does
(flash-linear-attention's ``PaTHAttention``, which this follows): w_t is a rank-32 projection of x_t (``rank``),
through a causal depthwise convolution of width 3 over the sequence (``conv_size``) and SiLU, L2-normalised per head;
β_t = 2σ(u_h · x_t + b_h) ∈ (0, 2), so H_t may reflect (β > 1: a negative eigenvalue). The projections start like
the backbone's linear layers (N(0, 0.02)), β's bias at 0 (β = 1), the convolution at PyTorch's default.

PaTH changes the scores themselves (a product that depends on every token between key and query), so it is not a
bias and not a rotation of each token: it ``supplies_attention``. It ``reads_layer_input``: ``token_features`` are
the projection before the convolution and β, per token (B, L, dim + H); the convolution runs over the keys inside
``attention_weights`` and ``attend``, so a KV cache that keeps the features computes every key's w exactly.

- ``attention_weights`` is the reference: each product H_{j+1} ⋯ H_i materialised as a D × D matrix, one distance at
  a time (O(Lq·Lk·D²) work, O(Lq·D²) memory per step): obviously the formula, fine for short windows.
- ``attend`` is exact and bounded: keys and queries in chunks of C ≈ √L positions (16 up to ``chunk``), each
  chunk's product in the compact UT form I − Uᵀ W (one C × C triangular solve per chunk, the paper's §3.2), keys
  carried to the end of their chunk, queries to the start of theirs and then backwards one whole chunk at a time, an
  online softmax over key chunks. Cost O(L²·D·(1 + D/C) + L·C·(C + D)) per head, memory O(L·C) per head at once;
  L/C sequential steps.
- On CUDA, where the optional ``flash-linear-attention`` package is installed (``pip install posenc[fla]``) and the
  head dim is one its kernel takes (16 to 128), self-attention runs its Triton kernel instead (imported only
  there); cached decoding and everything else take the chunked path.
"""

from __future__ import annotations

import importlib.util
import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from posenc.encodings import register
from posenc.encodings.base import PositionalEncoding
from posenc.runtime import full_precision

INIT_STD = 0.02
NORM_EPS = 1e-6  # w / √(Σw² + ε), as the published layer normalises
# Whether flash-linear-attention is installed, looked up (not imported) once: it is imported only on CUDA.
FLA_INSTALLED = importlib.util.find_spec("fla") is not None
FLA_HEAD_DIMS = (16, 32, 64, 128)
MIN_CHUNK = 16  # what parallel_path_attn accepts (flash-linear-attention 0.5)


@register
class PaTH(PositionalEncoding):
    """Data-dependent Householder products between key and query; its own attention (dense reference, chunked path)."""

    name = "path"
    reads_layer_input = True
    supplies_attention = True

    def __init__(self, num_heads: int, head_dim: int, rank: int = 32, conv_size: int = 3, chunk: int = 64) -> None:
        super().__init__(num_heads, head_dim)
        if rank < 1 or conv_size < 1 or chunk < 1:
            raise ValueError(f"path's rank, conv_size and chunk must be positive, got {rank=} {conv_size=} {chunk=}")
        dim = num_heads * head_dim
        self.dim, self.rank, self.conv_size, self.chunk = dim, rank, conv_size, chunk
        self.w_down = nn.Parameter(torch.randn(rank, dim) * INIT_STD)
        self.w_up = nn.Parameter(torch.randn(dim, rank) * INIT_STD)
        bound = 1 / math.sqrt(conv_size)  # nn.Conv1d's default for a depthwise kernel
        self.w_conv = nn.Parameter(torch.empty(dim, conv_size).uniform_(-bound, bound))
        self.beta_weight = nn.Parameter(torch.randn(num_heads, dim) * INIT_STD)
        self.beta_bias = nn.Parameter(torch.zeros(num_heads))

    @full_precision
    def token_features(self, x: Tensor) -> Tensor:
        """(B, L, dim + H) fp32: w's low-rank projection of x_t before the convolution, then β_t = 2σ(u · x_t + b)."""
        x = x.float()
        projected = F.linear(F.linear(x, self.w_down.float()), self.w_up.float())  # (B, L, dim)
        beta = 2 * torch.sigmoid(F.linear(x, self.beta_weight.float(), self.beta_bias.float()))  # (B, L, H)
        return torch.cat([projected, beta], dim=-1)

    @full_precision
    def householders(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """Unit w (B, H, Lk, D) and β (B, H, Lk) of every key from the keys' features (B, Lk, dim + H), in fp32."""
        projected, beta = self.require_features(features).float().split([self.dim, self.num_heads], dim=-1)
        # Causal depthwise convolution over the keys: w_t reads positions t − conv_size + 1 .. t (zeros before the
        # window's first token, as in a full forward of the same window).
        padded = F.pad(projected.transpose(1, 2), (self.conv_size - 1, 0))  # (B, dim, conv_size - 1 + Lk)
        mixed = F.silu(F.conv1d(padded, self.w_conv.float()[:, None, :], groups=self.dim))  # (B, dim, Lk)
        w = rearrange(mixed, "b (h d) l -> b h l d", h=self.num_heads)
        w = w * torch.rsqrt(w.square().sum(dim=-1, keepdim=True) + NORM_EPS)
        return w, beta.transpose(1, 2)

    def _householders_for(self, q: Tensor, features: Tensor | None) -> tuple[Tensor, Tensor]:
        """``householders``, once q is known to have the head's width: the space the transformations act on."""
        if q.shape[-1] != self.head_dim:
            raise ValueError(
                f"path's Householder transformations act on q and k of the head's width ({self.head_dim}), not "
                f"{q.shape[-1]}: stack it with no scheme that widens them (qk_width)"
            )
        return self.householders(features)

    @full_precision
    def attention_weights(
        self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, features: Tensor | None = None
    ) -> Tensor:
        """softmax_j(k_jᵀ (H_{j+1} ⋯ H_i) q_i / √D) (B, H, Lq, Lk) in fp32, each product built as a D × D matrix."""
        w, beta = self._householders_for(q, features)
        q, k = q.float(), k.float()
        batch, heads, queries, head_dim = q.shape
        keys = k.shape[-2]
        rows = torch.arange(keys - queries, keys, device=q.device)  # each query's index among the keys
        product = torch.eye(head_dim, device=q.device).expand(batch, heads, queries, head_dim, head_dim)
        by_distance = []
        for distance in range(keys):  # the last query is key Lk - 1: it sees distances 0 .. Lk - 1
            if distance:  # H_{i-d+1} · (H_{i-d+2} ⋯ H_i): the next factor on the left
                step = (rows - distance + 1).clamp(min=0)
                w_s, beta_s = w[:, :, step], beta[:, :, step]  # (B, H, Lq, D), (B, H, Lq)
                reflected = torch.einsum("bhqd,bhqde->bhqe", w_s, product)  # w_sᵀ P
                product = product - beta_s[..., None, None] * w_s[..., :, None] * reflected[..., None, :]
            key = k[:, :, (rows - distance).clamp(min=0)]  # k_{i-d} (B, H, Lq, D); rows with i < d are masked below
            by_distance.append(torch.einsum("bhqd,bhqde,bhqe->bhq", key, product, q))
        scores = torch.stack(by_distance, dim=-1) / math.sqrt(head_dim)  # (B, H, Lq, distances)
        distance = (rows[:, None] - torch.arange(keys, device=q.device)[None, :]).clamp(min=0)  # (Lq, Lk)
        scores = scores.gather(-1, distance.expand(batch, heads, -1, -1))
        causal = k_pos[None, :] <= q_pos[:, None]
        return scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)

    @full_precision
    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, features: Tensor | None = None
    ) -> Tensor:
        w, beta = self._householders_for(q, features)
        if FLA_INSTALLED and q.is_cuda and q_pos is k_pos and q.shape[-1] in FLA_HEAD_DIMS:
            return fla_attention(q, k, v, w, beta)
        return chunked_attention(q, k, v, w, beta, self.chunk).to(q.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, conv_size={self.conv_size}, chunk={self.chunk}"


def fla_attention(q: Tensor, k: Tensor, v: Tensor, w: Tensor, beta: Tensor) -> Tensor:
    """flash-linear-attention's PaTH kernel on self-attention (CUDA only; layout (B, L, H, D); w and β in fp32)."""
    from fla.ops.path_attn.parallel import parallel_path_attn

    q, k, v, w = (t.transpose(1, 2) for t in (q, k, v, w))
    out, _ = parallel_path_attn(q, k, v, w.float(), beta.transpose(1, 2).float(), scale=q.shape[-1] ** -0.5)
    return out.transpose(1, 2)


def _chunks(x: Tensor, size: int) -> Tensor:
    """(B, H, N·C, ...) → (B, H, N, C, ...)."""
    return x.unflatten(2, (x.shape[2] // size, size))


def chunked_attention(q: Tensor, k: Tensor, v: Tensor, w: Tensor, beta: Tensor, chunk: int) -> Tensor:
    """PaTH attention (B, H, Lq, Dv) in fp32, exact, in chunks of ``chunk`` keys; queries are the last Lq keys' rows.

    Within a chunk, with W (C × D) its unit vectors and T = (I + diag(β) tril₋₁(W Wᵀ))⁻¹ diag(β) (a unit triangular
    solve): the chunk's product H_1 ⋯ H_C is I − Uᵀ W with U = T W; key j carried to the chunk's end is
    k_j − Σ_{t>j} c_tj w_t with C = T tril₋₁(W Kᵀ); query i carried to the chunk's start is
    q_i − Σ_{t≤i} (q_i · w_t) u_t; and the scores inside the chunk are Q Kᵀ − tril(Q Wᵀ) C. Between chunks, a query
    crosses each whole chunk by its I − Uᵀ W, so the score of a key d chunks back is one product with that chunk's
    carried keys.
    """
    q, k, v, w, beta = (t.float() for t in (q, k, v, w, beta))
    queries, head_dim = q.shape[-2:]
    keys = k.shape[-2]
    # Chunks of about √L (at least 16) up to ``chunk``: the solve and the products inside a chunk cost C² per
    # position, the walk between chunks L/C steps; short training windows favour small chunks, long ones large.
    size = max(1, min(chunk, keys, max(MIN_CHUNK, 1 << math.ceil(math.log2(math.sqrt(keys))))))
    count = -(-keys // size)
    pad = count * size - keys
    offset = keys - queries  # the first query's index among the keys
    first = offset // size  # the first chunk holding a query
    scale = head_dim**-0.5

    # Padding at the end: w = 0 makes H = I, and padded keys come after every real query (masked as the future).
    k, v, w = (_chunks(F.pad(t, (0, 0, 0, pad)), size) for t in (k, v, w))  # (B, H, N, C, ·)
    beta = _chunks(F.pad(beta, (0, pad)), size)  # (B, H, N, C)
    q = _chunks(F.pad(q, (0, 0, offset - first * size, pad)), size)  # (B, H, N - first, C, D)

    lower = torch.ones(size, size, dtype=torch.bool, device=q.device).tril(-1)  # t > j
    inclusive = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()  # t ≤ i
    gram = w @ w.transpose(-1, -2)  # (B, H, N, C, C)
    system = torch.eye(size, device=q.device) + beta[..., None] * gram.masked_fill(~lower, 0.0)
    w_k = (w @ k.transpose(-1, -2)).masked_fill(~lower, 0.0)  # w_t · k_j for t > j
    # One unit triangular solve per chunk for both right-hand sides: U = T W (C × D) and C = T tril₋₁(W Kᵀ) (C × C).
    both = beta[..., None] * torch.cat([w, w_k], dim=-1)
    u, carry = torch.linalg.solve_triangular(system, both, upper=False, unitriangular=True).split([head_dim, size], -1)
    carried_k = k - carry.transpose(-1, -2) @ w  # keys at their chunk's end (B, H, N, C, D)

    q_w = (q @ w[:, :, first:].transpose(-1, -2)).masked_fill(~inclusive, 0.0)  # q_i · w_t, t ≤ i
    inside = (q @ k[:, :, first:].transpose(-1, -2) - q_w @ carry[:, :, first:]) * scale
    inside = inside.masked_fill(~inclusive, float("-inf"))  # (B, H, N - first, C, C): causal within the chunk
    current = q - q_w @ u[:, :, first:]  # queries at their chunk's start

    # Online softmax over key chunks, nearest first: running max, normaliser and weighted sum per query row.
    top = inside.amax(dim=-1)
    weights = torch.exp(inside - top[..., None])
    total = weights.sum(dim=-1)
    acc = weights @ v[:, :, first:]
    for distance in range(1, count):
        start = max(first, distance)  # query chunks m ≥ start see key chunk m - distance
        if start >= count:
            break
        current = current[:, :, current.shape[2] - (count - start) :]
        if distance > 1:  # cross the whole chunk m - distance + 1 on the way back: x − (x Wᵀ) U
            crossed = slice(start - distance + 1, count - distance + 1)
            current = current - (current @ w[:, :, crossed].transpose(-1, -2)) @ u[:, :, crossed]
        seen = slice(start - distance, count - distance)
        scores = (current @ carried_k[:, :, seen].transpose(-1, -2)) * scale  # (B, H, N - start, C, C)
        rows = slice(start - first, None)
        new_top = torch.maximum(top[:, :, rows], scores.amax(dim=-1))
        decay = torch.exp(top[:, :, rows] - new_top)
        weights = torch.exp(scores - new_top[..., None])
        keep = slice(0, start - first)
        top = torch.cat([top[:, :, keep], new_top], dim=2)
        total = torch.cat([total[:, :, keep], total[:, :, rows] * decay + weights.sum(dim=-1)], dim=2)
        acc = torch.cat([acc[:, :, keep], acc[:, :, rows] * decay[..., None] + weights @ v[:, :, seen]], dim=2)
    out = (acc / total[..., None]).flatten(2, 3)  # (B, H, (N - first)·C, Dv)
    start = offset - first * size
    return out[:, :, start : start + queries]
