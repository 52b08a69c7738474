"""SDPA with a content-dependent bias (``adds_content_bias``: CoPE, DAPE, data-dependent ALiBi, FoX).

Such a bias is one (B, H, Lq, Lk) tensor per batch, so its query chunks are sized over batch and heads together
(``content_chunk_elements``: a CPU's caches, a GPU's memory); each chunk's bias is computed from that chunk's queries
and the keys it may see, with those keys' ``features`` for a scheme that reads the layer's input (the scheme's rows need
nothing else). A content bias that varies along a row only through a per-key term (the scheme's ``key_bias``: data-
dependent ALiBi, FoX) needs no (Lq × Lk) tensor: the term rides in one extra channel of q and k, and SDPA runs its fused
kernel with a causal boolean mask (on CPU, in fp32 or fp64; the CUDA path keeps the dense bias, whose bf16 behaviour is
the measured one).

Kept apart from ``sdpa`` (which dispatches here) because none of it shares the fixed-bias path's masks or cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from posenc.attention.window import key_span, local_rows, visible
from posenc.encodings.base import PositionalEncoding
from posenc.runtime import cuda_path, full_precision

MAX_MASK_ELEMENTS = 1 << 24  # per head: 16M entries, 64 MiB in fp32
MAX_CONTENT_ELEMENTS = 1 << 22  # on CPU, over batch and heads: 16 MiB per fp32 temporary, cache-sized
CONTENT_TEMPORARIES = 32  # fp32 temporaries per content-bias element at once (DAPE's MLP holds 8-32 of them)
CONTENT_MEMORY_FRACTION = 8  # a chunk's temporaries may take 1/8 of a GPU's memory
MAX_FOLDED_ROWS = 1024  # a folded key term spans ≤ 1024 positions' worth of decay per chunk: fp32-exact enough
FOLDED_DTYPES = (torch.float32, torch.float64)  # the key term folds into q and k exactly enough only here


def content_chunk_elements(device: torch.device) -> int:
    """(query, key) pairs over batch and heads that one chunk of a content bias may hold on ``device``.

    On CPU a cache-sized constant; on a GPU a share of its memory (``CONTENT_MEMORY_FRACTION``) over the chunk's fp32
    temporaries: with the CPU's size, a 16K window of 12 heads would run ~800 SDPA calls per layer, each too small
    to fill the GPU; with an H100's 80 GB it runs ~40.
    """
    if device.type != "cuda":
        return MAX_CONTENT_ELEMENTS
    total = torch.cuda.get_device_properties(device).total_memory
    return max(MAX_CONTENT_ELEMENTS, total // CONTENT_MEMORY_FRACTION // (4 * CONTENT_TEMPORARIES))


@full_precision
def sdpa_with_content_bias(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    encoding: PositionalEncoding,
    q_pos: Tensor,
    k_pos: Tensor,
    features: Tensor | None = None,
    logit: Tensor | None = None,
    window: int | None = None,
    pinned: int = 0,
) -> Tensor:
    """Causal SDPA with the scheme's content bias (plus its position bias, if any), one query chunk at a time.

    ``logit`` (H,): a sink's column, a key and a value of zeros in front of the chunk's keys, scored by the mask alone.
    ``pinned``: sink tokens in front of the keys, which a ``window`` does not hide.

    A scheme that ``reads_scores`` (CoPE, DAPE) gets each chunk's fp32 scaled scores from here on CPU, computed
    once. When the bias needs a gradient, SDPA could only run its math kernel, which computes the same scores a
    second time and takes a safe softmax; the chunk then goes through a plain softmax of those scores plus the
    bias instead (the eager reference's arithmetic). The CUDA path keeps SDPA for every chunk.
    """
    batch, heads, length, _ = q.shape
    rows = max(1, content_chunk_elements(q.device) // (batch * heads * k.shape[-2]))
    rows = local_rows(rows, None if pinned else window, q_pos is k_pos)
    share_scores = encoding.reads_scores and not cuda_path(q)
    chunks = []
    for start in range(0, length, rows):
        end = start + rows
        keys = key_span(q_pos, k_pos, start, end, window, pinned)  # the keys this chunk's queries may see
        chunk_q, chunk_k, chunk_v = q[:, :, start:end], k[:, :, keys], v[:, :, keys]
        chunk_q_pos, chunk_k_pos = q_pos[start:end], k_pos[keys]
        scores = None
        if share_scores:
            scores = torch.matmul(chunk_q.float(), chunk_k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
        chunk_features = None if features is None else features[:, keys]
        mask = encoding.content_bias(chunk_q, chunk_k, chunk_q_pos, chunk_k_pos, scores, chunk_features)  # fp32
        if encoding.adds_bias:
            mask = mask + encoding.bias(chunk_q_pos, chunk_k_pos)
        mask = mask.masked_fill(~visible(chunk_q_pos, chunk_k_pos, window, pinned)[None, None], float("-inf"))
        if logit is not None:
            mask = torch.cat((logit.float()[None, :, None, None].expand(*mask.shape[:-1], 1), mask), dim=-1)
            chunk_k = torch.cat((chunk_k.new_zeros(*chunk_k.shape[:2], 1, chunk_k.shape[-1]), chunk_k), dim=-2)
            chunk_v = torch.cat((chunk_v.new_zeros(*chunk_v.shape[:2], 1, chunk_v.shape[-1]), chunk_v), dim=-2)
            scores = None if scores is None else torch.cat((scores.new_zeros(*scores.shape[:-1], 1), scores), dim=-1)
        if scores is not None and torch.is_grad_enabled() and mask.requires_grad:
            probs = (scores + mask).softmax(dim=-1)
            chunks.append(torch.matmul(probs, chunk_v.float()).to(q.dtype))
        else:
            chunks.append(F.scaled_dot_product_attention(chunk_q, chunk_k, chunk_v, attn_mask=mask.to(q.dtype)))
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=-2)


def sdpa_with_key_bias(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_term: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    window: int | None = None,
    pinned: int = 0,
) -> Tensor:
    """Causal SDPA with a bias r_i + t_j given by its key term t (B, H, Lk): t folded into an extra channel.

    q gets a channel of ones, k the channel t / scale, v a channel of zeros (dropped from the output), and the scale
    stays 1/√D of the real head dim, so q'·k'·scale = q·k·scale + t_j: the scores of the dense bias up to r_i,
    which softmax ignores. Per query chunk t is shifted by its largest value over the chunk's keys (constant along
    every row, so exact in arithmetic, and detached since its gradient is zero): the channel then holds values
    within a chunk's span of decay instead of a running sum that grows with the position, which keeps fp32 exact
    enough at any length. No (Lq × Lk) float tensor exists: the mask is boolean, and SDPA takes its flash kernel.
    """
    scale = q.shape[-1] ** -0.5
    rows = local_rows(
        max(1, min(MAX_FOLDED_ROWS, MAX_MASK_ELEMENTS // k.shape[-2])), None if pinned else window, q_pos is k_pos
    )
    ones = q.new_ones(*q.shape[:-1], 1)
    padded_v = torch.cat([v, v.new_zeros(*v.shape[:-1], 1)], dim=-1)
    chunks = []
    for start in range(0, q.shape[-2], rows):
        end = start + rows
        keys = key_span(q_pos, k_pos, start, end, window, pinned)  # the keys this chunk's queries may see
        term = key_term[..., keys]
        term = term - term.detach().amax(dim=-1, keepdim=True)
        chunk_k = torch.cat([k[:, :, keys], (term / scale).to(k.dtype)[..., None]], dim=-1)
        chunk_q = torch.cat([q[:, :, start:end], ones[:, :, start:end]], dim=-1)
        causal = visible(q_pos[start:end], k_pos[keys], window, pinned)[None, None]
        out = F.scaled_dot_product_attention(chunk_q, chunk_k, padded_v[:, :, keys], attn_mask=causal, scale=scale)
        chunks.append(out[..., :-1])
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=-2)
