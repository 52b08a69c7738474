"""torch's scaled_dot_product_attention: the flash / cuDNN kernels when there is no bias.

With a bias, SDPA can only take it as a dense (Lq × Lk) mask, so it falls back to the memory-efficient or
math kernels; to keep memory bounded at long lengths the queries are processed in chunks of at most
``max_mask_elements / Lk`` rows, so the mask never exceeds that size per head. The mask is computed in fp32 and
cast to the activations' dtype, since SDPA requires them to match: under bf16 this rounds the bias (ALiBi
distances past 256 lose exactness), which is one reason ``auto`` prefers ``flex`` for biased schemes on GPU.

A content-dependent bias (``adds_content_bias``: CoPE, DAPE, data-dependent ALiBi) is one (B, H, Lq, Lk) tensor per
batch, so its query chunks are sized by ``MAX_CONTENT_ELEMENTS`` over batch and heads together; each chunk's bias
is computed from that chunk's queries and the keys it may see (the scheme's rows need nothing else).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from posenc.attention import register_backend
from posenc.encodings.base import PositionalEncoding

MAX_MASK_ELEMENTS = 1 << 24  # per head: 16M entries, 64 MiB in fp32
MAX_CONTENT_ELEMENTS = 1 << 22  # over batch and heads: 16 MiB per fp32 temporary (DAPE's MLP holds 8-32 of them)


@register_backend("sdpa", query_suffix=True)
def sdpa_attention(
    q: Tensor, k: Tensor, v: Tensor, encoding: PositionalEncoding, q_pos: Tensor, k_pos: Tensor
) -> Tensor:
    if encoding.adds_content_bias:
        return sdpa_with_content_bias(q, k, v, encoding, q_pos, k_pos)
    if not encoding.adds_bias:
        if q_pos is k_pos:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        causal = k_pos[None, :] <= q_pos[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
    return sdpa_with_bias(q, k, v, encoding.bias, q_pos, k_pos)


def sdpa_with_bias(
    q: Tensor, k: Tensor, v: Tensor, bias: Callable[[Tensor, Tensor], Tensor], q_pos: Tensor, k_pos: Tensor
) -> Tensor:
    """Causal SDPA with ``bias(q_pos, k_pos)`` (H, Lq, Lk) as a dense mask, built one query chunk at a time."""
    self_attention = q_pos is k_pos
    rows = max(1, MAX_MASK_ELEMENTS // k.shape[-2])
    if q.shape[-2] <= rows:  # one chunk: no loop, so torch.compile keeps the length symbolic
        mask = bias(q_pos, k_pos).masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype))
    chunks = []
    for start in range(0, q.shape[-2], rows):
        end = start + rows
        # With shared positions, keys after the chunk's last query are all masked: leave them out.
        keys = slice(0, end) if self_attention else slice(None)
        chunk_q_pos, chunk_k_pos = q_pos[start:end], k_pos[keys]
        mask = bias(chunk_q_pos, chunk_k_pos)  # (H, rows, keys) fp32
        mask = mask.masked_fill(chunk_k_pos[None, None, :] > chunk_q_pos[None, :, None], float("-inf"))
        chunks.append(
            F.scaled_dot_product_attention(q[:, :, start:end], k[:, :, keys], v[:, :, keys], attn_mask=mask.to(q.dtype))
        )
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=-2)


def sdpa_with_content_bias(
    q: Tensor, k: Tensor, v: Tensor, encoding: PositionalEncoding, q_pos: Tensor, k_pos: Tensor
) -> Tensor:
    """Causal SDPA with the scheme's content bias (plus its position bias, if any), one query chunk at a time."""
    self_attention = q_pos is k_pos
    batch, heads, length, _ = q.shape
    rows = max(1, MAX_CONTENT_ELEMENTS // (batch * heads * k.shape[-2]))
    chunks = []
    for start in range(0, length, rows):
        end = start + rows
        keys = slice(0, end) if self_attention else slice(None)  # later keys are all masked for this chunk
        chunk_q, chunk_k, chunk_v = q[:, :, start:end], k[:, :, keys], v[:, :, keys]
        chunk_q_pos, chunk_k_pos = q_pos[start:end], k_pos[keys]
        mask = encoding.content_bias(chunk_q, chunk_k, chunk_q_pos, chunk_k_pos)  # (B, H, rows, keys) fp32
        if encoding.adds_bias:
            mask = mask + encoding.bias(chunk_q_pos, chunk_k_pos)
        mask = mask.masked_fill(chunk_k_pos[None, None, None, :] > chunk_q_pos[None, None, :, None], float("-inf"))
        chunks.append(F.scaled_dot_product_attention(chunk_q, chunk_k, chunk_v, attn_mask=mask.to(q.dtype)))
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=-2)
