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

from posenc.data.heldout import heldout_sample
from posenc.evaluate.perplexity import LengthResult, evaluate_lengths


def heldout_perplexity(
    model: nn.Module, stream: np.ndarray, lengths: Sequence[int], eval_cfg: Mapping[str, Any], tokens_per_batch: int
) -> tuple[list[LengthResult], dict[str, Any]]:
    """Perplexity rows at the lengths the sample can fill, and the record of the documents they scored."""
    held = heldout_sample(
        stream, eval_cfg.get("max_tokens"), eval_cfg.get("sample") or "head", int(eval_cfg.get("seed", 1234))
    )
    available = [length for length in lengths if length < len(held.tokens)]
    rows = evaluate_lengths(
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
    record = held.describe(rows[0].tokens)
    for row in rows:
        if row.document_loss is not None:
            row.document_loss = [row.document_loss[i] for i in record["documents"]]
    return rows, record
