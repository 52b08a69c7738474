"""A local layer's window: which keys a query sees when its layer attends over the last W positions only.

Deployed long-context models mix global layers (every earlier key) with local, sliding-window ones (Gemma 3, Command
R7B, SWAN-GPT). A query at position i of a local layer with window W sees the keys at j with i − W < j ≤ i: W keys,
itself included, and never more however long the sequence grows, so the window does not widen at evaluation
lengths. A sink's columns (``posenc/attention/sink.py``) are not keys of the sequence and stay visible to every query,
as StreamingLLM keeps its sink tokens beside a rolling window.

Every backend takes ``window`` (``None``: a global layer) and applies it where it applies causality, before the
softmax: ``eager`` and ``sdpa`` in their masks, with a query chunk's keys cut to those its window reaches, ``flex``
in its block mask, whose blocks wholly outside the window are skipped, ``triton``'s table kernel in its tiles' mask and
loop bounds. A backend that cannot honour a window refuses it in one line (``refuse_window``) rather than attend
globally: ``flex_learnable``, and the schemes' own attentions (``scheme``, stick-breaking's kernel).
"""

from __future__ import annotations

from torch import Tensor


def check_window(window: int | None) -> None:
    """Raise (ValueError, one line) unless ``window`` is ``None`` or a positive number of keys."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"a local layer's window counts keys and must be an integer ≥ 1, got {window!r}")


def visible(q_pos: Tensor, k_pos: Tensor, window: int | None, pinned: int = 0) -> Tensor:
    """(Lq, Lk) bool: key j is visible to query i (causal, and within the window when there is one).

    ``pinned``: the first keys are sink tokens put in front of the sequence's (``SinkColumns.prepend``), at the window's
    first position and causal to every query, which no window hides.
    """
    distance = q_pos[:, None] - k_pos[None, :]
    seen = distance >= 0
    if window is None:
        return seen
    seen = seen & (distance < window)
    if pinned:
        seen[:, :pinned] = True
    return seen


def key_span(q_pos: Tensor, k_pos: Tensor, start: int, end: int, window: int | None, pinned: int = 0) -> slice:
    """The keys a query chunk [start, end) may see when queries and keys share positions (self-attention).

    Keys after the chunk's last query are all masked, and with a window so are those before its first query's
    window: a chunk attends over at most ``end − start + W − 1`` keys, whatever the sequence's length. With
    ``pinned`` keys in front (sink tokens), the chunk's keys start at the first: the window masks the rest.
    """
    if q_pos is not k_pos:
        return slice(None)
    first = 0 if window is None or pinned else max(0, start - window + 1)
    return slice(first, end)


# Queries per chunk of a local layer at least: below it, per-call overhead outweighs the keys a chunk leaves out.
MIN_LOCAL_ROWS = 128


def local_rows(rows: int, window: int | None, self_attention: bool) -> int:
    """Query rows per chunk for a local layer: about half its window, so each chunk reads ~1.5 W keys, not all.

    SDPA's CPU kernels take no sparsity from a mask: one dense (L × L) mask of a window of 1,024 at L = 2,048 cost a
    forward and backward 1.8× the causal kernel's (1 thread, batch 8, 4 heads of 32), and chunks of W/2 queries over
    the keys their windows reach 1.2×; at W = 256, 0.5× (W/2 rows) against 1.8× for one mask.
    """
    if window is None or not self_attention:
        return rows
    return max(1, min(rows, max(MIN_LOCAL_ROWS, window // 2)))


def refuse_window(backend: str, window: int | None, instead: str = "attention=sdpa, flex or eager") -> None:
    """Raise (ValueError, one line) for a backend that cannot restrict its rows to a window."""
    if window is not None:
        raise ValueError(f"attention={backend} cannot run a local (sliding-window) layer; use {instead}")
