"""torch's scaled_dot_product_attention: the flash / cuDNN kernels when there is no bias.

With a bias, SDPA can only take it as a dense (Lq × Lk) mask, so it falls back to the memory-efficient kernel on
CUDA (its CPU flash kernel takes masks); to keep memory bounded at long lengths the queries are processed in chunks
of at most ``max_mask_elements / Lk`` rows, so the mask never exceeds that size per head. The mask is computed in
fp32 and cast to the activations' dtype, since SDPA requires them to match: under bf16 this rounds the bias (ALiBi
distances past 256 lose exactness), which is one reason ``auto`` prefers ``flex`` for biased schemes on GPU.

A content-dependent bias (``adds_content_bias``: CoPE, DAPE, data-dependent ALiBi, FoX) goes through
``sdpa_content``: its bias is one (B, H, Lq, Lk) tensor per batch, chunked over batch and heads together.

A scheme that supplies its own attention (``supplies_attention``: PaTH, stick-breaking) is no softmax SDPA could run,
and sdpa refuses it in one line rather than hand it to the scheme's ``attend``. Running it would be a second, silent
path to what the ``scheme`` backend does: every benchmark row, run record and kernel check labelled sdpa would then
time or check the scheme's own code, not SDPA. Nothing needs sdpa to take it: ``auto`` picks ``scheme``, and cached
decoding falls back to ``scheme`` for such a scheme where it falls back to sdpa for the others (``decoding_backend``).

When a scheme widens q and k beyond v's width (``qk_width``: PoPE's 2D), v is padded with zero channels to their
width and the padding dropped from the output: SDPA's flash kernels take one head width for q, k and v, and without
them a 2,048-position CPU forward ran on the math kernel ~5× slower (333 ms against 70 ms padded, 4 heads × 64).

Every mask is handed over 4-D, (1, H, Lq, Lk) or (B, H, Lq, Lk): on CPU, SDPA sends a 3-D mask to its math kernel
(scores materialised, a safe softmax) and a 4-D one to its flash kernel, several times faster; CUDA's
memory-efficient kernel takes the same broadcastable 4-D mask.

A fixed bias (the scheme gives a ``bias_key``) is the same in every layer whose scheme has that key and in every
window of the same positions, so its masked form is built once and kept in ``MASKS``, a small cache bounded in bytes:
the layers of one forward and the windows of a long evaluation reuse it.

A bias of the distance alone (``distance_only``: ALiBi, KERPLE, T5, Sandwich, stacks of them) is gathered from the
scheme's (H, L) table (``tables.dense_bias``), not computed per (i, j) by its formula, and the mask's gradient comes
back to the table one total per distance. Training such a bias on CPU through SDPA's math kernel (the only one that
differentiates a mask) cost 1.6–2.6× ALiBi's step; a learnable table that declares gradient forms therefore trains on
SDPA's CPU flash kernel both ways, held constant there, with its parameters' gradients from the forms
(``tables.CpuTableAttention``).

A sink (``posenc/attention/sink.py``) puts its columns in front of the keys SDPA sees, since SDPA returns no row
log-sum-exp to merge them with (``sdpa_with_sink``): a logit as a key of zeros whose score comes from one more channel
(the query's 1 times the key's s / scale), so the mask stays the scheme's own (kept in ``MASKS`` for a fixed bias,
boolean without a bias); sink tokens as their keys, with the scheme's bias at their position in the mask. A content
bias reads every key in order, so there the tokens join the keys (``SinkColumns.prepend``) and a logit is a column of
the chunk's mask. With a sink, a learnable table trains through the mask (SDPA's math kernel on CPU), not
``CpuTableAttention``, and data-dependent ALiBi and FoX through their dense content bias, not the folded key term.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from posenc.attention import refuse, refuse_supplied_attention, register_backend
from posenc.attention.sdpa_content import (
    FOLDED_DTYPES,
    MAX_MASK_ELEMENTS,
    sdpa_with_content_bias,
    sdpa_with_key_bias,
)
from posenc.attention.sink import SinkColumns
from posenc.attention.tables import CpuTableAttention, dense_bias, plan_gradient
from posenc.attention.window import key_span, local_rows, visible
from posenc.encodings.base import PositionalEncoding
from posenc.runtime import cuda_path

MAX_CACHED_BYTES = 1 << 28  # 256 MiB of kept masks: an 8-head fp32 mask up to L = 2048, or a few shorter ones
FLASH_CPU = (torch.float32, torch.bfloat16, torch.float16)  # dtypes SDPA's CPU flash kernel takes


class MaskCache:
    """The most recently used causal bias masks, by what determines them; the oldest go first past ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.masks: OrderedDict[Hashable, Tensor] = OrderedDict()

    def get(self, key: Hashable | None, build: Callable[[], Tensor]) -> Tensor:
        """The mask kept under ``key``, else ``build()`` (kept when it fits); ``key=None`` always builds."""
        if key is None:
            return build()
        if key in self.masks:
            self.masks.move_to_end(key)
            return self.masks[key]
        mask = build()
        size = mask.numel() * mask.element_size()
        if size <= self.max_bytes:
            while self.masks and size + sum(m.numel() * m.element_size() for m in self.masks.values()) > self.max_bytes:
                self.masks.popitem(last=False)
            self.masks[key] = mask
        return mask

    def clear(self) -> None:
        self.masks.clear()


MASKS = MaskCache(MAX_CACHED_BYTES)


def mask_key(
    encoding: PositionalEncoding, q_pos: Tensor, k_pos: Tensor, dtype: torch.dtype, window: int | None = None
) -> Hashable | None:
    """What a causal bias mask depends on (the scheme's ``bias_key``, positions, dtype, window), or ``None``.

    The key reads positions and parameter values on the host: free on CPU, a device sync per layer elsewhere, so
    only CPU masks are kept (on a GPU the mask is rebuilt, one elementwise pass). ``None`` also under
    torch.compile (a compiled graph fuses the bias into its own kernels) and for queries over cached keys, whose
    mask serves one decoding step only.
    """
    if torch.compiler.is_compiling() or q_pos.device.type != "cpu" or q_pos is not k_pos:
        return None
    scheme = encoding.bias_key()
    if scheme is None:
        return None
    positions = tuple(pos.cpu().numpy().tobytes() for pos in (q_pos, k_pos))
    return scheme, positions, str(q_pos.device), dtype, window


@register_backend("sdpa", query_suffix=True, refuses=(refuse_supplied_attention,))
def sdpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    encoding: PositionalEncoding,
    q_pos: Tensor,
    k_pos: Tensor,
    features: Tensor | None = None,
    sink: SinkColumns | None = None,
    window: int | None = None,
) -> Tensor:
    refuse(encoding, "sdpa")
    if sink is not None and not encoding.adds_content_bias:
        return sdpa_with_sink(q, k, v, encoding, q_pos, k_pos, sink, window)
    pinned = 0
    if sink is not None and sink.keys is not None:  # a content bias reads every key in order: the tokens join them
        k, v, k_pos, features = sink.prepend(k, v, k_pos, features)
        sink, pinned = None, sink.width
    extra = q.shape[-1] - v.shape[-1]
    if extra > 0:  # q, k wider than v (PoPE): zero channels give v their width, the flash kernels need one
        padded = F.pad(v, (0, extra))
        if pinned:  # the tokens are keys now: no window hides them
            out = sdpa_with_content_bias(q, k, padded, encoding, q_pos, k_pos, features, None, window, pinned)
            return out[..., : v.shape[-1]]
        return sdpa_attention(q, k, padded, encoding, q_pos, k_pos, features, sink, window)[..., : v.shape[-1]]
    if encoding.adds_content_bias:
        logit = None if sink is None else sink.logit
        if logit is None and not encoding.adds_bias and q.dtype in FOLDED_DTYPES and not cuda_path(q):
            key_term = encoding.key_bias(k, k_pos, features)
            if key_term is not None:
                return sdpa_with_key_bias(q, k, v, key_term, q_pos, k_pos, window, pinned)
        return sdpa_with_content_bias(q, k, v, encoding, q_pos, k_pos, features, logit, window, pinned)
    if window is not None:  # a local layer: the window in a mask, with the scheme's bias in it if it has one
        bias = dense_bias(encoding, k.shape[-2]) if encoding.adds_bias else None
        return sdpa_with_bias(q, k, v, bias, q_pos, k_pos, mask_key(encoding, q_pos, k_pos, q.dtype, window), window)
    if not encoding.adds_bias:
        if q_pos is k_pos:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        # Queries over cached keys are the last Lq key positions (the query-suffix contract): causal aligned to the
        # bottom right, which is no mask at all for one query and torch's lower-right causal bias otherwise. Both
        # leave SDPA its flash kernels on a GPU, where an all-true boolean mask would send it to another kernel.
        if q.shape[-2] == 1:
            return F.scaled_dot_product_attention(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[-2], k.shape[-2]))
    if encoding.learnable_bias and torch.is_grad_enabled() and q_pos is k_pos and not cuda_path(q):
        plan = plan_gradient(encoding, k.shape[-2]) if q.dtype in FLASH_CPU else None
        if plan is not None and plan.parameters:
            rows = max(1, MAX_MASK_ELEMENTS // k.shape[-2])
            return CpuTableAttention.apply(q, k, v, plan, rows, *plan.parameters)
    # Every distance a contiguous window holds: the keys' count.
    bias = dense_bias(encoding, k.shape[-2])
    return sdpa_with_bias(q, k, v, bias, q_pos, k_pos, key=mask_key(encoding, q_pos, k_pos, q.dtype))


def causal_mask(
    bias: Tensor | None, q_pos: Tensor, k_pos: Tensor, dtype: torch.dtype, window: int | None = None
) -> Tensor:
    """The fp32 bias (H, Lq, Lk), keys not visible at -inf, as SDPA's fast kernels take it: (1, H, Lq, Lk) in ``dtype``.

    Without a bias (a local layer of a scheme with none), the visible keys as a boolean (1, 1, Lq, Lk).
    """
    seen = visible(q_pos, k_pos, window)
    if bias is None:
        return seen[None, None]
    return bias.masked_fill(~seen[None], float("-inf")).to(dtype)[None]


def sdpa_with_bias(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Callable[[Tensor, Tensor], Tensor] | None,
    q_pos: Tensor,
    k_pos: Tensor,
    key: Hashable | None = None,
    window: int | None = None,
) -> Tensor:
    """Causal SDPA with ``bias(q_pos, k_pos)`` (H, Lq, Lk) as a dense mask, built one query chunk at a time.

    With a ``key`` (see ``mask_key``), a mask built in one piece is kept in ``MASKS`` and reused; chunked masks are
    not kept, since together they are the whole (H, L, L) bias the chunking exists to avoid. ``bias=None``: the mask
    is the visible keys alone (a local layer of a scheme without a bias), boolean.
    """

    def mask_of(chunk_q_pos: Tensor, chunk_k_pos: Tensor) -> Tensor:
        table = None if bias is None else bias(chunk_q_pos, chunk_k_pos)
        return causal_mask(table, chunk_q_pos, chunk_k_pos, q.dtype, window)

    rows = local_rows(max(1, MAX_MASK_ELEMENTS // k.shape[-2]), window, q_pos is k_pos)
    if q.shape[-2] <= rows:  # one chunk: no loop, so torch.compile keeps the length symbolic
        mask = MASKS.get(key, lambda: mask_of(q_pos, k_pos))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    chunks = []
    for start in range(0, q.shape[-2], rows):
        end = start + rows
        # With shared positions, keys after the chunk's last query (or before its window) are masked: left out.
        keys = key_span(q_pos, k_pos, start, end, window)
        chunk_q_pos, chunk_k_pos = q_pos[start:end], k_pos[keys]
        mask = mask_of(chunk_q_pos, chunk_k_pos)  # (1, H or 1, rows, keys)
        chunks.append(F.scaled_dot_product_attention(q[:, :, start:end], k[:, :, keys], v[:, :, keys], attn_mask=mask))
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=-2)


def sdpa_with_sink(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    encoding: PositionalEncoding,
    q_pos: Tensor,
    k_pos: Tensor,
    sink: SinkColumns,
    window: int | None = None,
) -> Tensor:
    """Causal SDPA over the sink's columns in front of the keys, for a scheme whose bias reads positions only.

    A logit s_h is a key of zeros with s_h / scale in one more channel, where every query has a 1 and every other key a
    0: its score is s_h (rounded to the activations' dtype under bf16), and its gradient reaches s_h through that key.
    Sink tokens are their rotated keys, biased at their position (``encoding.bias``: k columns). Every query sees the
    columns; the keys' part of the mask is the scheme's, built one query chunk at a time as ``sdpa_with_bias`` builds
    it, and kept in ``MASKS`` like it (it never reads the sink's parameters).
    """
    batch, heads, _, head_dim = q.shape
    scale, width, dtype = head_dim**-0.5, sink.width, q.dtype
    if sink.keys is None:
        q = torch.cat((q, q.new_ones(*q.shape[:-1], 1)), dim=-1)
        k = torch.cat((k, k.new_zeros(*k.shape[:-1], 1)), dim=-1)
        folded = (sink.logit.float() / scale).to(dtype)[None, :, None, None].expand(batch, heads, 1, 1)
        column = torch.cat((k.new_zeros(batch, heads, 1, head_dim), folded), dim=-1)
        column_v = v.new_zeros(batch, heads, 1, v.shape[-1])
    else:
        column, column_v = sink.keys.to(dtype), sink.values.to(v.dtype)
    keys = torch.cat((column, k), dim=-2)
    values = F.pad(torch.cat((column_v, v), dim=-2), (0, q.shape[-1] - v.shape[-1]))  # SDPA's kernels: one width
    bias = dense_bias(encoding, k.shape[-2]) if encoding.adds_bias else None

    def mask(chunk_q_pos: Tensor, chunk_k_pos: Tensor) -> Tensor:  # (1, 1 or H, rows, C + keys)
        if bias is None:
            causal = visible(chunk_q_pos, chunk_k_pos, window)
            return torch.cat((causal.new_ones(len(chunk_q_pos), width), causal), dim=-1)[None, None]
        keys_part = causal_mask(bias(chunk_q_pos, chunk_k_pos), chunk_q_pos, chunk_k_pos, dtype, window)
        if sink.keys is None:
            front = keys_part.new_zeros(1, heads, len(chunk_q_pos), width)
        else:
            front = encoding.bias(chunk_q_pos, sink.pos).to(dtype)[None]
        return torch.cat((front, keys_part), dim=-1)

    key = mask_key(encoding, q_pos, k_pos, dtype, window)
    key = None if key is None else (key, "sink", width, sink.keys is None)
    rows = local_rows(max(1, MAX_MASK_ELEMENTS // (width + k.shape[-2])), window, q_pos is k_pos)
    chunks = []
    for start in range(0, q.shape[-2], rows):
        end = start + rows
        # The columns, then only the keys this chunk's queries may see (later ones, and those before its window, are
        # masked: left out, as sdpa_with_bias leaves them).
        span = key_span(q_pos, k_pos, start, end, window)
        first, last = span.start or 0, k.shape[-2] if span.stop is None else min(span.stop, k.shape[-2])
        chunk_q_pos, chunk_k_pos = q_pos[start:end], k_pos[first:last]
        whole = start == 0 and end >= q.shape[-2]
        chunk_mask = MASKS.get(key if whole else None, lambda p=chunk_q_pos, kp=chunk_k_pos: mask(p, kp))
        seen = [slice(0, width + last)] if first == 0 else [slice(0, width), slice(width + first, width + last)]
        chunk_keys, chunk_values = (torch.cat([t[:, :, part] for part in seen], dim=-2) for t in (keys, values))
        chunks.append(
            F.scaled_dot_product_attention(
                q[:, :, start:end], chunk_keys, chunk_values, attn_mask=chunk_mask, scale=scale
            )
        )
    out = chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=-2)
    return out[..., : v.shape[-1]]
