"""torch's scaled_dot_product_attention: the flash / cuDNN kernels when there is no bias.

With a bias, SDPA can only take it as a dense (Lq × Lk) mask, so it falls back to the memory-efficient or
math kernels; to keep memory bounded at long lengths the queries are processed in chunks of at most
``max_mask_elements / Lk`` rows, so the mask never exceeds that size per head. The mask is computed in fp32 and
cast to the activations' dtype, since SDPA requires them to match: under bf16 this rounds the bias (ALiBi
distances past 256 lose exactness), which is one reason ``auto`` prefers ``flex`` for biased schemes on GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from posenc.attention import register_backend
from posenc.encodings.base import PositionalEncoding

MAX_MASK_ELEMENTS = 1 << 24  # per head: 16M entries, 64 MiB in fp32


@register_backend("sdpa", query_suffix=True)
def sdpa_attention(
    q: Tensor, k: Tensor, v: Tensor, encoding: PositionalEncoding, q_pos: Tensor, k_pos: Tensor
) -> Tensor:
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
