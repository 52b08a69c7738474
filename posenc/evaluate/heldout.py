"""Perplexity by length on the held-out tokens an evaluation chooses (``posenc/data/heldout.py``), per document too.

The scored tokens are the whole split (``eval.max_tokens=null``), its head, or by default a piece of every document
(``eval.sample=documents``); every length's row records the loss summed over each document's scored targets
(``document_loss``, in the order of ``documents.ids``), so that a report can say how much of a difference between
columns is the data rather than the seeds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from torch import nn

from posenc.data.heldout import HeldOut, heldout_sample, long_documents_sample
from posenc.evaluate.perplexity import LengthResult, evaluate_lengths


def heldout_perplexity(
    model: nn.Module, stream: np.ndarray, lengths: Sequence[int], eval_cfg: Mapping[str, Any], tokens_per_batch: int
) -> tuple[list[LengthResult], dict[str, Any]]:
    """Perplexity rows at the lengths the sample can fill, and the record of the documents they scored."""
    if eval_cfg.get("sample") == "long_documents":
        return within_documents(model, stream, lengths, eval_cfg, tokens_per_batch)
    held = heldout_sample(
        stream, eval_cfg.get("max_tokens"), eval_cfg.get("sample") or "head", int(eval_cfg.get("seed", 1234))
    )
    available = [length for length in lengths if length < len(held.tokens)]
    rows = (
        evaluate_lengths(
            model,
            held.tokens,
            available,
            mode=eval_cfg["mode"],
            stride=eval_cfg.get("stride"),
            max_tokens=eval_cfg.get("max_tokens"),
            tokens_per_batch=tokens_per_batch,
            stride_fraction=eval_cfg.get("stride_fraction"),
            documents=held.documents,
        )
        if available
        else []
    )
    record = held.describe(rows[0].tokens if rows else 0)
    for row in rows:
        if row.document_loss is not None:
            row.document_loss = [row.document_loss[i] for i in record["documents"]]
        if row.document_tokens is not None:
            row.document_tokens = [row.document_tokens[i] for i in record["documents"]]
    for length in sorted(set(lengths) - set(available)):  # a row that says why, in results.json and on the console
        rows.append(LengthResult(length, eval_cfg["mode"], None, 0, error=_too_long(len(held.tokens), eval_cfg)))
    return sorted(rows, key=lambda row: row.length), record


def _too_long(tokens: int, eval_cfg: Mapping[str, Any]) -> str:
    """Why a length longer than the held-out sample has no row of figures, and what would give it one."""
    budget = eval_cfg.get("max_tokens")
    where = f"eval.max_tokens={budget}" if budget is not None else f"the whole {eval_cfg.get('split')} split"
    more = "raise eval.max_tokens" if budget is not None else "evaluate on a longer split"
    return f"not evaluated: the sample holds {tokens} tokens ({where}), too few for one window; {more}"


def within_documents(
    model: nn.Module, stream: np.ndarray, lengths: Sequence[int], eval_cfg: Mapping[str, Any], tokens_per_batch: int
) -> tuple[list[LengthResult], dict[str, Any]]:
    """``eval.sample=long_documents``: every window inside one document, each document's piece scored on its own.

    The longest lengths no document of the split can hold get a row with that error (the table shows them as n/a);
    the others are scored on whole windows of the longest one that some document holds, so the scored tokens are the
    same at every length. Rows pool the pieces: loss over all their targets, loss by position over all their windows.
    """
    kept = sorted(lengths)
    held = long_documents_sample(stream, kept, eval_cfg.get("max_tokens"), int(eval_cfg.get("seed", 1234)))
    while len(kept) > 1 and not held.pieces:
        kept = kept[:-1]
        held = long_documents_sample(stream, kept, eval_cfg.get("max_tokens"), int(eval_cfg.get("seed", 1234)))
    held.qualifying = long_documents_sample(stream, list(lengths), 0).qualifying  # every length asked, even skipped
    parts = [_score_piece(model, held, piece, kept, eval_cfg, tokens_per_batch) for piece in held.pieces or []]
    rows = [_pool([part[index] for part in parts]) for index in range(len(kept))] if parts else []
    for length in lengths:
        if length not in kept or not parts:
            error = f"no document of the {eval_cfg.get('split', 'held-out')} split holds a window of {length} tokens"
            rows.append(LengthResult(length=length, mode=eval_cfg["mode"], stride=None, tokens=0, error=error))
    rows.sort(key=lambda row: row.length)
    record = held.describe(sum(end - start - 1 for start, end in held.pieces or []))
    for row in rows:
        if row.document_loss is not None:
            row.document_loss = [row.document_loss[i] for i in record["documents"]]
        if row.document_tokens is not None:
            row.document_tokens = [row.document_tokens[i] for i in record["documents"]]
    return rows, record


def _score_piece(
    model: nn.Module,
    held: HeldOut,
    piece: tuple[int, int],
    lengths: list[int],
    eval_cfg: Mapping[str, Any],
    tokens_per_batch: int,
) -> list[LengthResult]:
    start, end = piece
    return evaluate_lengths(
        model,
        held.tokens[start:end],
        lengths,
        mode=eval_cfg["mode"],
        stride=eval_cfg.get("stride"),
        max_tokens=None,
        tokens_per_batch=tokens_per_batch,
        stride_fraction=eval_cfg.get("stride_fraction"),
        documents=held.documents[start:end],
    )


def _pool(rows: list[LengthResult]) -> LengthResult:
    """One length's rows of several pieces as one: losses weighted by targets, positions by windows."""
    first = rows[0]
    pooled = LengthResult(first.length, first.mode, first.stride, sum(row.tokens for row in rows), error=first.error)
    pooled.stride_fraction = first.stride_fraction
    if first.error:
        return pooled
    pooled.loss = float(sum(row.loss * row.tokens for row in rows) / pooled.tokens)
    pooled.windows = sum(row.windows for row in rows)
    by_position = sum(np.asarray(row.loss_by_position) * row.windows for row in rows)
    pooled.loss_by_position = (by_position / pooled.windows).tolist()
    if all(row.document_loss is not None for row in rows):
        size = max(len(row.document_loss) for row in rows)
        pooled.document_loss = sum(np.pad(row.document_loss, (0, size - len(row.document_loss))) for row in rows)
        pooled.document_loss = pooled.document_loss.tolist()
    if all(row.document_tokens is not None for row in rows):
        size = max(len(row.document_tokens) for row in rows)
        pooled.document_tokens = sum(np.pad(row.document_tokens, (0, size - len(row.document_tokens))) for row in rows)
        pooled.document_tokens = [int(n) for n in pooled.document_tokens]
    return pooled
