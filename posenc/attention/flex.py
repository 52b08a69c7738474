"""FlexAttention: the scheme's ``score_mod`` fused into the attention kernel with a causal block mask.

No (L × L) tensor exists on this path: the bias is computed per score inside the kernel, and the block mask
(built once per length and cached) skips the blocks above the diagonal. On CUDA the kernel is compiled once
and reused, with static shapes, and never silently falls back to the unfused path (``compiled_flex_attention``).
On CPU, FlexAttention runs the forward only (torch has no CPU backward for it), so this backend refuses to run on
CPU when gradients are needed rather than failing deep inside torch.

Positions are assumed contiguous and shared by queries and keys (self-attention over one window): the kernel
sees indices ``0..L-1``. A distance-only bias is read from its (H, L) table by i − j (``tables.py``); any other
score_mod receives the indices shifted by the window's first position.

A local layer's window (``posenc/attention/window.py``) is in the block mask: its blocks wholly outside the window
are skipped, the rest masked by a mask_mod (``build_window_block_mask``).

A sink (``posenc/attention/sink.py``) is merged with the kernel's output through its row log-sum-exp
(``SinkColumns.merge``), which FlexAttention returns and differentiates (its backward takes the lse's gradient).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from posenc.attention import refuse, refuse_content_bias, refuse_supplied_attention, register_backend
from posenc.attention.sink import SinkColumns
from posenc.attention.tables import distance_table, reads_table, table_score_mod
from posenc.encodings.base import PositionalEncoding
from posenc.encodings.forms import ScoreMod
from posenc.runtime import cuda_path


def _causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return q_idx >= kv_idx


BLOCK = 128  # FlexAttention's default block size


def build_causal_block_mask(length: int, device: str | torch.device) -> BlockMask:
    """The causal block mask written down directly: O((L/128)²) integers, never the (L × L) mask.

    ``create_block_mask`` evaluates the mask_mod on every (q, kv) pair, a dense L × L boolean (4 GiB at 64k)
    and, inside a compiled model, L² work on every call. Causality needs no evaluation: query block i sees key
    blocks j < i in full and its diagonal block partially. When L is not a multiple of the block, the last query
    block's blocks are all partial, as ``create_block_mask`` marks them.
    """
    blocks = -(-length // BLOCK)
    rows = torch.arange(blocks, device=device, dtype=torch.int32)
    ordered = rows[None, :].expand(blocks, blocks)  # row i lists blocks 0, 1, ...: its first i are the full ones
    diagonal_first = torch.cat((rows[:, None], ordered[:, 1:]), dim=1)  # row i starts with block i
    full_counts = rows.clone()
    partial_counts = torch.ones_like(rows)
    partial_indices = diagonal_first
    if length % BLOCK:
        full_counts[-1] = 0
        partial_counts[-1] = blocks
        partial_indices = torch.cat((diagonal_first[:-1], ordered[-1:]), dim=0)
    return BlockMask.from_kv_blocks(
        partial_counts[None, None],
        partial_indices[None, None].contiguous(),
        full_counts[None, None],
        ordered[None, None].contiguous(),
        BLOCK_SIZE=BLOCK,
        mask_mod=_causal,
        seq_lengths=(length, length),
    )


def windowed(window: int) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """The mask_mod of a local layer: causal, and at most ``window`` − 1 positions back."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return mask_mod


def build_window_block_mask(length: int, window: int, device: str | torch.device) -> BlockMask:
    """A local layer's block mask, written down per block: O((L/128)²) integers, never the (L × L) mask.

    Query block i reads the key blocks that hold a visible key: at or before its own, and not wholly ``window`` or
    more behind its first query. Those whose every pair is visible (wholly past the diagonal and within the window,
    and not cut by the sequence's end) are full; the rest partial, evaluated through the mask_mod. Blocks wholly
    outside the window are skipped: a local layer's cost grows as L · W, not L².
    """
    blocks = -(-length // BLOCK)
    index = torch.arange(blocks, device=device)
    first, last = index * BLOCK, (index + 1) * BLOCK - 1  # a block's first and last position
    rows_first, cols_last = first[:, None], last[None, :]
    seen = (index[None, :] <= index[:, None]) & (rows_first - cols_last < window)
    whole = last < length  # not cut by the sequence's end
    full = (rows_first - cols_last >= 0) & (last[:, None] - first[None, :] < window) & whole[:, None] & whole[None, :]
    partial = seen & ~full

    def listed(chosen: Tensor) -> tuple[Tensor, Tensor]:  # per row: how many, then their indices first, in order
        order = torch.argsort((~chosen).to(torch.int8), dim=1, stable=True)
        return chosen.sum(dim=1).to(torch.int32)[None, None], order.to(torch.int32)[None, None].contiguous()

    partial_counts, partial_indices = listed(partial)
    full_counts, full_indices = listed(full)
    return BlockMask.from_kv_blocks(
        partial_counts,
        partial_indices,
        full_counts,
        full_indices,
        BLOCK_SIZE=BLOCK,
        mask_mod=windowed(window),
        seq_lengths=(length, length),
    )


def _build(length: int, window: int | None, device: str) -> BlockMask:
    if window is None or window >= length:  # a window as long as the sequence hides nothing
        return build_causal_block_mask(length, device)
    return build_window_block_mask(length, window, device)


_cached_block_mask = functools.lru_cache(maxsize=32)(_build)


def causal_block_mask(length: int, device: str, window: int | None = None) -> BlockMask:
    """Causal (or local) block mask for one length: built once per length, or traced cheaply into a compiled graph."""
    if torch.compiler.is_compiling():  # dynamo would trace through the cache anyway, and warn about it
        return _build(length, window, device)
    return _cached_block_mask(length, window, device)


RECOMPILE_LIMIT = 256  # per compiled function: far above what one process needs (see forbid_recompile_fallback)
FALLBACK_WARNING = "flex_attention called without torch.compile"  # torch's warning when it runs the unfused path


def forbid_recompile_fallback() -> None:
    """Make dynamo raise, rather than silently run eagerly, when a compiled function passes its recompile limit.

    Past the limit, dynamo runs a frame uncompiled for the rest of the process and says so once in a log line;
    for FlexAttention that is the unfused path that materialises B × H × L² scores (an OOM or a 100× slowdown
    hours into a run). The limits are sized so that a correct run stays far below them: one graph per score_mod
    code, dtype, grad mode and static shape (training, validation, each evaluation shape), for every scheme one
    process compares.
    """
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    torch._dynamo.config.accumulated_recompile_limit = max(
        torch._dynamo.config.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT
    )
    torch._dynamo.config.fail_on_recompile_limit_hit = True


@functools.cache
def compiled_flex_attention():  # noqa: ANN201 - returns torch.compile's wrapper
    """flex_attention compiled once per process (compiling per call would dominate the runtime), static shapes.

    ``dynamic=False``: every (batch, length) gets its own kernel. Automatic dynamic shapes (a symbolic length after
    the first new one) crashed on an H100 with torch 2.11 (a garbage shape from aot_autograd's
    ``gen_alias_from_base``, as in pytorch/pytorch#185630), and static kernels are what ran there without a crash.
    Outside a compiled model (evaluation, the benchmark) this costs one compilation per evaluation shape and
    score_mod, a few seconds each; inside a compiled block the call is traced into the block's own graph.

    Used on CUDA only, so from then on torch's warning that flex_attention ran uncompiled (the unfused path) is an
    error in this process, and the recompile limit raises (``forbid_recompile_fallback``).
    """
    forbid_recompile_fallback()
    warnings.filterwarnings("error", message=FALLBACK_WARNING, category=UserWarning)
    return torch.compile(flex_attention, dynamic=False)


def flex_kernel(q: Tensor) -> Callable[..., Any]:
    """The flex_attention to call for ``q``: traced into the caller's graph, compiled once, or eager.

    Inside a compiled block (dynamo tracing) the plain ``flex_attention`` is traced into the block's own graph and
    fused there; calling the process-wide compiled wrapper from inside would split the block into several graphs at
    its ``functools.cache`` and ``warnings`` calls. Outside compilation, the CUDA path uses the one compiled wrapper
    (``compiled_flex_attention``), and CPU the eager forward.
    """
    if torch.compiler.is_compiling():
        return flex_attention
    return compiled_flex_attention() if cuda_path(q) else flex_attention


# Tiles for score_mods that gather from a table: the default H100 forward tile (128 × 128, 3 stages, bf16, head
# dim 64) needs 240 KiB of shared memory once the gathered bias is laid out, above Hopper's 227 KiB, and inductor
# then finds no valid config. Half-size tiles and two stages need well under half of that (an estimate from the
# tile sizes: K and V stages, the Q tile and the score tile; not yet measured on a GPU). All divide the block
# mask's 128, as FlexAttention requires, and the backward's pairs divide each other.
# ``BACKEND: TRITON`` keeps FlexAttention's main kernel at every length: for queries shorter than 128 torch would
# otherwise take its decoding kernel, which decides whether its query block needs boundary masks from its own
# block size (the query length rounded up to a power of 2) and only then applies ``fwd_BLOCK_M``: at L = 16 or 32
# it would load and store 64-row blocks unmasked (torch 2.11, ``flex_decoding.py``). The main kernel derives its
# masking from the 128 mask block, which every tile here divides.
TABLE_KERNEL_OPTIONS: dict[str, int | str] = {
    "BACKEND": "TRITON",
    "fwd_BLOCK_M": 64,
    "fwd_BLOCK_N": 64,
    "fwd_num_stages": 2,
    "fwd_num_warps": 4,
    "bwd_BLOCK_M1": 32,
    "bwd_BLOCK_N1": 64,
    "bwd_BLOCK_M2": 64,
    "bwd_BLOCK_N2": 32,
    "bwd_num_stages": 2,
    "bwd_num_warps": 4,
}


# Tiles for fp32 queries: with torch's defaults (and with the table tiles above) fp32 kernels spill up to 115 KB of
# registers per thread (T5's backward at head dim 128 on an A100), and at head dim 128 ask an L4 or RTX 4090 (sm_89,
# 99 KB) for 131-148 KB of shared memory, where inductor then finds no valid config. Quarter-size tiles fit every
# device with few or no spills (the figures: ``python -m posenc.lane``, docs/gpu.md); their speed is for a GPU to
# time. Training on a GPU runs bf16-mixed, where the tiles above apply.
FP32_KERNEL_OPTIONS: dict[str, int | str] = {
    "BACKEND": "TRITON",
    "fwd_BLOCK_M": 32,
    "fwd_BLOCK_N": 32,
    "fwd_num_stages": 2,
    "fwd_num_warps": 4,
    "bwd_BLOCK_M1": 16,
    "bwd_BLOCK_N1": 32,
    "bwd_BLOCK_M2": 32,
    "bwd_BLOCK_N2": 16,
    "bwd_num_stages": 2,
    "bwd_num_warps": 4,
}


def kernel_options(encoding: PositionalEncoding, q: Tensor | None = None) -> dict[str, int | str] | None:
    """FlexAttention kernel options for this scheme and these queries: torch's defaults (``None``) where they serve.

    Quarter-size tiles for fp32 queries, smaller tiles when the kernel reads a table: a distance-only bias, which
    every backend reads from its distance table (``tables.reads_table``), or a member whose own score_mod gathers
    from one (``score_mod_reads_table``); only the scheme's declarations and the queries' dtype decide, and each
    choice serves the H100, the A100 and the L4 alike (``python -m posenc.lane`` compiles every one for each).
    """
    if q is not None and q.element_size() >= 4:
        return dict(FP32_KERNEL_OPTIONS)
    table = reads_table(encoding) or any(member.score_mod_reads_table for member in encoding.members)
    return dict(TABLE_KERNEL_OPTIONS) if table else None


def bias_score_mod(encoding: PositionalEncoding, q: Tensor, pos: Tensor, detached: bool = False) -> ScoreMod | None:
    """The scheme's bias as the kernel reads it over the window of ``q`` at positions ``pos``; ``None`` without one.

    A distance-only bias is read from its (H, L) table (``tables.table_score_mod``): one load per score, and no
    position offset, since a distance does not depend on where the window starts. Any other bias is the scheme's own
    score_mod at absolute positions. ``detached``: the bias as a constant (its parameters get no gradient here).
    """
    if reads_table(encoding):
        return table_score_mod(distance_table(encoding, q.shape[-2], detached=detached))
    mod = encoding.score_mod(detached=detached, num_distances=q.shape[-2])
    return shifted(mod, pos[0]) if mod is not None else None


def shifted(mod: ScoreMod, offset: Tensor) -> ScoreMod:
    """The mod seen from absolute positions: kernel indices plus the window's first position."""

    def at_positions(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return mod(score, b, h, q_idx + offset, kv_idx + offset)

    return at_positions


def flex_run(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    score_mod: ScoreMod | None,
    return_lse: bool = False,
    options: dict[str, int | str] | None = None,
    window: int | None = None,
) -> Any:
    """Causal FlexAttention with the cached block mask: ``out``, or ``(out, lse)`` with the fp32 natural-log lse.

    ``options`` are the kernel options (``kernel_options(encoding, q)``); which kernel runs is ``flex_kernel``'s choice.
    ``window``: a local layer's (``posenc/attention/window.py``), in the block mask.
    """
    length = q.shape[-2]
    block_mask = causal_block_mask(length, str(q.device), window)
    kernel = flex_kernel(q)
    if not q.is_cuda and not torch.is_grad_enabled():  # torch refuses CPU inputs that require grad, even here
        q, k, v = q.detach(), k.detach(), v.detach()
    if not return_lse:
        return kernel(q, k, v, score_mod=score_mod, block_mask=block_mask, kernel_options=options)
    out, aux = kernel(
        q, k, v, score_mod=score_mod, block_mask=block_mask, kernel_options=options, return_aux=AuxRequest(lse=True)
    )
    return out, aux.lse


def check_self_attention(q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> None:
    if q.shape[-2] != k.shape[-2] or (q_pos is not k_pos and not torch.equal(q_pos, k_pos)):
        raise ValueError("the flex backend handles self-attention over one window (q_pos == k_pos); use eager or sdpa")


@register_backend("flex", refuses=(refuse_supplied_attention, refuse_content_bias))
def flex_backend(
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
    refuse(encoding, "flex")
    check_self_attention(q, k, q_pos, k_pos)
    if not cuda_path(q) and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise RuntimeError(
            "attention=flex cannot train on CPU: torch's FlexAttention has no CPU backward. "
            "Use attention=sdpa (or attention=auto) on CPU; flex trains on CUDA."
        )
    if torch.is_grad_enabled() and encoding.learnable_bias and not encoding.score_mod_differentiable:
        raise ValueError(
            f"attention=flex cannot train {encoding.label}'s bias: FlexAttention cannot differentiate its score_mod "
            "on a GPU (Inductor does not lower its backward). Train with attention=auto or attention=sdpa; flex "
            "evaluates it"
        )
    mod, options = bias_score_mod(encoding, q, q_pos), kernel_options(encoding, q)
    if sink is None:
        return flex_run(q, k, v, mod, options=options, window=window)
    out, lse = flex_run(q, k, v, mod, return_lse=True, options=options, window=window)
    return sink.merge(out, lse, q, encoding, q_pos)
