"""Which held-out tokens an evaluation scores: the whole split, its head, or a piece of every document.

A held-out split is one token stream, each document followed by the end-of-document token. Scoring its first N
tokens scores the first few documents in file order only (for the standard library at 65,536 tokens: six files), so
both the figure and any interval around it speak for those files. ``sample="documents"`` takes a contiguous piece
of **every** document instead, each piece at most ``cap`` tokens, ``cap`` the smallest that fills the budget (long
documents give ``cap`` tokens, short ones all of theirs), at an offset drawn from ``seed``; the pieces keep their
documents' order and each ends with the end-of-document token. Every scored token is tagged with its document, so
that a report can cross seeds with documents (``posenc/evaluate/crossed.py``).

Pieces are contiguous, so a window inside one sees real context; a window longer than a piece spans the pieces of
several documents, as a window of the whole stream spans several short files.

``sample="long_documents"`` keeps every window inside one document at every length, the longest included, so that
whether longer context helps is measured rather than assumed. Only documents of at least ``window`` + 1 tokens take
part (``window``: the longest evaluation length, a multiple of every other); each gives ``pieces`` (one piece a
document), each piece a whole number of longest windows plus the first input, at most ``cap`` tokens, ``cap`` the
smallest that fills the budget (a budget of fewer windows than such documents takes one window from each of a
seeded choice of them); the evaluation scores each piece on its own (``posenc/evaluate/heldout.py``). The
record says how many documents of the split could hold a window of each evaluated length and how many were too short
for the longest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from posenc.data.tokenizer import ByteTokenizer

SAMPLES = ("documents", "head", "long_documents")


@dataclass
class HeldOut:
    """The token stream an evaluation scores, the document of every token, and how it was chosen."""

    tokens: np.ndarray  # (N,) token ids
    documents: np.ndarray  # (N,) the index of each token's document in the split
    sample: str  # "split" (all of it), "documents", "head" or "long_documents"
    cap: int | None  # the longest piece taken from one document ("documents", "long_documents")
    pieces: list[tuple[int, int]] | None = None  # (start, end) in ``tokens`` of each piece scored on its own
    qualifying: dict[int, int] | None = None  # {length: documents of the split with a window of that length}
    split_documents: int | None = None  # how many documents the split holds

    def describe(self, scored: int) -> dict[str, object]:
        """What results.json records: the sample, and the documents and tokens behind the first ``scored`` targets.

        Pieces scored on their own (``long_documents``) each score every token but their first: ``scored`` is then
        their total.
        """
        documents = self.documents[1 : scored + 1]
        if self.pieces is not None:
            documents = np.concatenate([self.documents[start + 1 : end] for start, end in self.pieces] or [documents])
        ids, counts = np.unique(documents, return_counts=True)
        record: dict[str, object] = {
            "sample": self.sample,
            "piece_cap": self.cap,
            "documents": [int(i) for i in ids],
            "tokens": [int(c) for c in counts],
        }
        if self.qualifying is not None:
            longest = max(self.qualifying)
            record["qualifying"] = {str(length): count for length, count in sorted(self.qualifying.items())}
            record["split_documents"] = self.split_documents
            record["too_short"] = (self.split_documents or 0) - self.qualifying[longest]
        return record


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
    if sample not in SAMPLES or sample == "long_documents":  # that one needs the lengths: long_documents_sample
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


def long_documents_sample(
    stream: np.ndarray, lengths: list[int], max_tokens: int | None, seed: int = 0, eod: int = ByteTokenizer.eod
) -> HeldOut:
    """Pieces of the documents that hold a window of the longest length, each scored on its own (module docstring).

    ``lengths`` are the evaluation lengths; the window is their least common multiple (the longest, for multiples
    that are powers of two). ``max_tokens`` bounds the scored targets (``None``: every whole window of every
    qualifying document). No qualifying document gives an empty sample, which the evaluation reports per length.
    """
    stream = np.asarray(stream)
    bounds = document_bounds(stream, eod)
    contents = [int(end - start - (stream[end - 1] == eod)) for start, end in bounds]  # without the end token
    window = math.lcm(*lengths)
    qualifying = {length: sum(size >= length + 1 for size in contents) for length in sorted(set(lengths))}
    windows = {index: (size - 1) // window for index, size in enumerate(contents) if size >= window + 1}
    if not windows:
        empty = np.zeros(0, dtype=stream.dtype)
        return HeldOut(empty, np.zeros(0, dtype=np.int64), "long_documents", None, [], qualifying, len(bounds))
    budget = sum(windows.values()) if max_tokens is None else max(1, max_tokens // window)
    rng = np.random.default_rng([seed, len(stream)])
    if budget < len(windows):  # fewer windows than documents: a seeded choice of documents, one window each
        chosen = sorted(rng.choice(sorted(windows), size=budget, replace=False).tolist())
        windows = {index: windows[index] for index in chosen}
    most = piece_cap(list(windows.values()), budget)  # windows from one document, at most
    pieces, owners, spans, at = [], [], [], 0
    for index, count in windows.items():
        start, size = bounds[index][0], contents[index]
        taken = min(count, most) * window + 1
        offset = start + int(rng.integers(0, size - taken + 1))
        pieces.append(stream[offset : offset + taken])
        owners.append(np.full(taken, index))
        spans.append((at, at + taken))
        at += taken
    cap = most * window + 1
    tokens, documents = np.concatenate(pieces), np.concatenate(owners)
    return HeldOut(tokens, documents, "long_documents", cap, spans, qualifying, len(bounds))
