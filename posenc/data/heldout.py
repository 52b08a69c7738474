"""Which held-out tokens an evaluation scores: the whole split, its head, or a piece of every document.

A held-out split is one token stream, each document followed by the end-of-document token. Scoring its first N
tokens scores the first few documents in file order only (for the standard library at 65,536 tokens: six files), so
both the figure and any interval around it speak for those files. ``sample="documents"`` takes a contiguous piece
of **every** document instead, each piece at most ``cap`` tokens, ``cap`` the smallest that fills the budget (long
documents give ``cap`` tokens, short ones all of theirs), at an offset drawn from ``seed``; the pieces keep their
documents' order and each ends with the end-of-document token. Every scored token is tagged with its document, so
that a report can bootstrap over documents (``posenc.evaluate.stats.document_bootstrap``).

Pieces are contiguous, so a window inside one sees real context; a window longer than a piece spans the pieces of
several documents, as a window of the whole stream spans several short files.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from posenc.data.tokenizer import ByteTokenizer

SAMPLES = ("documents", "head")


@dataclass
class HeldOut:
    """The token stream an evaluation scores, the document of every token, and how it was chosen."""

    tokens: np.ndarray  # (N,) token ids
    documents: np.ndarray  # (N,) the index of each token's document in the split
    sample: str  # "split" (all of it), "documents" or "head"
    cap: int | None  # the longest piece taken from one document ("documents" only)

    def describe(self, scored: int) -> dict[str, object]:
        """What results.json records: the sample, and the documents and tokens behind the first ``scored`` targets."""
        documents = self.documents[1 : scored + 1]
        ids, counts = np.unique(documents, return_counts=True)
        return {
            "sample": self.sample,
            "piece_cap": self.cap,
            "documents": [int(i) for i in ids],
            "tokens": [int(c) for c in counts],
        }


def document_bounds(stream: np.ndarray, eod: int = ByteTokenizer.eod) -> list[tuple[int, int]]:
    """(start, end) of every document of a stream, its end-of-document token included (a tail without one too)."""
    ends = (np.flatnonzero(np.asarray(stream) == eod) + 1).tolist()
    bounds = list(zip([0, *ends[:-1]], ends, strict=True)) if ends else []
    tail = bounds[-1][1] if bounds else 0
    if tail < len(stream):
        bounds.append((tail, len(stream)))
    return bounds


def piece_cap(sizes: list[int], budget: int) -> int:
    """The smallest cap c with Σ min(size, c) ≥ ``budget`` (the largest size when even that is short)."""
    low, high = 1, max(sizes)
    if sum(sizes) <= budget:
        return high
    while low < high:
        middle = (low + high) // 2
        if sum(min(size, middle) for size in sizes) >= budget:
            high = middle
        else:
            low = middle + 1
    return low


def heldout_sample(
    stream: np.ndarray, max_tokens: int | None, sample: str = "documents", seed: int = 0, eod: int = ByteTokenizer.eod
) -> HeldOut:
    """The tokens to score: ``max_tokens`` targets (plus one input) chosen by ``sample``, or the whole split."""
    if sample not in SAMPLES:
        raise ValueError(f"eval.sample must be one of {', '.join(SAMPLES)}, got {sample!r}")
    stream = np.asarray(stream)
    bounds = document_bounds(stream, eod)
    documents = np.concatenate([np.full(end - start, index) for index, (start, end) in enumerate(bounds)])
    if max_tokens is None or max_tokens + 1 >= len(stream):
        return HeldOut(stream, documents, "split", None)
    if sample == "head":
        return HeldOut(stream[: max_tokens + 1], documents[: max_tokens + 1], "head", None)
    contents = [end - start - (stream[end - 1] == eod) for start, end in bounds]  # without the end token
    cap = piece_cap(contents, max_tokens + 1 - len(bounds))
    rng = np.random.default_rng([seed, len(stream)])
    pieces, owners = [], []
    for index, ((start, _), size) in enumerate(zip(bounds, contents, strict=True)):
        taken = min(size, cap)
        offset = start + int(rng.integers(0, size - taken + 1))
        pieces += [stream[offset : offset + taken], np.array([eod], dtype=stream.dtype)]
        owners.append(np.full(taken + 1, index))
    return HeldOut(np.concatenate(pieces), np.concatenate(owners), "documents", cap)
