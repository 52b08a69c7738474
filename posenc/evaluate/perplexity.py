"""Perplexity at multiples of the training length, scoring the *same* tokens at every length.

Two ways to cut a held-out stream into windows (the ALiBi paper, Section 4 and Appendix B):

- ``nonoverlap``: disjoint windows of length L; token t is predicted from the tokens since its window began,
  so early tokens of each window have little context. This is what the ALiBi paper's Table 2 reports.
- ``sliding`` with ``stride`` s: windows of length L advance by s and only their last s targets are scored, so
  every scored token sees L - s .. L - 1 tokens of context. The first ``context`` targets of the stream are never
  scored, at any length: they are context only, ``context`` being the most any evaluated length needs (L - s at
  the longest), so that the first window of a stream scores only its last s targets too and every scored token,
  the longest length's included, sees at least L - s tokens; the scored targets stay the same at every length. (A
  first window scored whole would make the two protocols score one and the same window wherever the stream holds
  a single window of the longest length.) When s does not divide what is left, one last window ends exactly at N
  and scores the targets left over.

Every window of a length has that length, and windows go in batches of one size plus at most one smaller batch:
at most two input shapes per length, whatever the stride. A stride may also be a fraction of each evaluation length
(``stride_fraction``: 0.5 slides windows of N by N/2), so that every scored token past the first window sees at least
(1 − fraction) · N tokens of context at every length, at a cost of 1 / fraction times the nonoverlapping one.

The scored span is the first ``N`` targets of the stream, with N a multiple of every length, so each length's
number is an average over identical tokens and lengths are directly comparable. Every figure states N. Given the
document of every token (``documents``), each length also records the loss summed over each document's scored
targets, from which a report bootstraps over documents.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LengthResult:
    """Loss over ``tokens`` scored targets at one evaluation ``length`` (``error`` if the model refused it)."""

    length: int
    mode: str
    stride: int | None
    tokens: int
    loss: float = float("nan")
    error: str | None = None
    loss_by_position: list[float] = field(default_factory=list)
    document_loss: list[float] | None = None  # summed loss of each document's scored targets (``documents`` order)
    document_tokens: list[int] | None = None  # how many of each document's targets were scored
    stride_fraction: float | None = None
    windows: int = 0  # how many windows ``loss_by_position`` averages over

    @property
    def ppl(self) -> float:
        if not math.isfinite(self.loss):
            return float("nan")
        return math.exp(self.loss) if self.loss < 709.0 else float("inf")  # exp overflows a double past ~709.78

    @property
    def bpb(self) -> float:
        """Bits per byte: the loss in bits, since every token of the byte tokenizer is one byte."""
        return self.loss / math.log(2)

    def as_dict(self) -> dict:
        return {
            "length": self.length,
            "mode": self.mode,
            "stride": self.stride,
            "tokens": self.tokens,
            "loss": self.loss,
            "ppl": self.ppl,
            "bpb": self.bpb,
            "error": self.error,
            "loss_by_position": self.loss_by_position,
            "document_loss": self.document_loss,
            "document_tokens": self.document_tokens,
            "stride_fraction": self.stride_fraction,
        }


def scored_span(available: int, lengths: Sequence[int], max_tokens: int | None) -> int:
    """Largest N ≤ min(available - 1, max_tokens) that is a multiple of every length."""
    step = math.lcm(*lengths)
    limit = available - 1 if max_tokens is None else min(available - 1, max_tokens)
    span = limit // step * step
    if span == 0:
        raise ValueError(
            f"the held-out stream has {available} tokens, too few for one window of {max(lengths)} "
            f"(the lengths' common multiple is {step}); evaluate at shorter lengths or on more data"
        )
    return span


def _stride(length: int, stride: int | None, fraction: float | None) -> int:
    """The stride at one evaluation length: ``stride`` tokens, or ``fraction`` of the length (at least 1)."""
    return int(stride) if fraction is None else max(1, round(fraction * length))


def _windows(span: int, length: int, stride: int, context: int = 0) -> list[tuple[int, int, int]]:
    """(input start, input end, first scored target index within the window) covering targets context+1..span once.

    Every window is ``length`` long (``span`` is a multiple of ``length``); the first ``context`` targets are context
    only, which needs ``context`` ≥ length − stride (a window never starts before the stream); see the module
    docstring. Nonoverlapping windows are ``stride = length`` with no context.
    """
    if context < length - stride:
        raise ValueError(f"{context} context tokens are too few for windows of {length} advancing by {stride}")
    out = []
    scored = context  # targets 1..scored are done (or context only)
    while scored < span:
        end = min(scored + stride, span)
        out.append((end - length, end, length - (end - scored)))
        scored = end
    return out


def context_targets(lengths: Sequence[int], mode: str, stride: int | None, fraction: float | None) -> int:
    """How many leading targets of a stream are context only (module docstring).

    None for nonoverlapping windows; for sliding ones the most any length's windows need, L − s.
    """
    if mode != "sliding":
        return 0
    return max(length - min(_stride(length, stride, fraction), length) for length in lengths)


@torch.no_grad()
def evaluate_lengths(
    model: nn.Module,
    tokens: np.ndarray,
    lengths: Sequence[int],
    mode: str = "nonoverlap",
    stride: int | None = None,
    max_tokens: int | None = 65536,
    tokens_per_batch: int = 16384,
    device: torch.device | str | None = None,
    stride_fraction: float | None = None,
    documents: np.ndarray | None = None,
) -> list[LengthResult]:
    """Loss, perplexity and bits per byte of ``model`` at each length over the same scored span of ``tokens``.

    ``model`` maps tokens (B, L) to logits (B, L, V). A length the model cannot handle (a learned table too
    short) is reported with its error instead of stopping the others. ``tokens_per_batch`` bounds memory: long
    windows run at batch size 1. ``documents`` (one document index per token, from 0) adds each document's
    summed loss to every length's result.
    """
    if mode not in ("nonoverlap", "sliding"):
        raise ValueError(f"eval mode must be 'nonoverlap' or 'sliding', got {mode!r}")
    if mode == "sliding" and (stride is None) == (stride_fraction is None):
        raise ValueError(
            "eval mode 'sliding' needs one stride: eval.stride (tokens) or eval.stride_fraction (of each length)"
        )
    device = device or next(model.parameters()).device
    span = scored_span(len(tokens), lengths, max_tokens)
    context = context_targets(lengths, mode, stride, stride_fraction)
    if context >= span:
        raise ValueError(
            f"sliding windows keep the first {context} targets as context, and only {span} are scored: evaluate "
            "more tokens (eval.max_tokens) or at shorter lengths"
        )
    stream = torch.from_numpy(np.asarray(tokens[: span + 1]).astype(np.int64))
    owners = None if documents is None else np.asarray(documents[1 : span + 1], dtype=np.int64)
    was_training = model.training
    model.eval()
    results = []
    try:
        for length in lengths:
            step = length if mode == "nonoverlap" else min(_stride(length, stride, stride_fraction), length)
            scored = span - context
            result = LengthResult(
                length=length, mode=mode, stride=None if mode == "nonoverlap" else step, tokens=scored
            )
            result.stride_fraction = stride_fraction if mode == "sliding" else None
            limit = getattr(model, "max_positions", None)
            if limit is not None and length > limit:
                result.error = f"max_positions={limit} < {length}"
                results.append(result)
                continue
            total = torch.zeros((), dtype=torch.float64)
            by_position = torch.zeros(length, dtype=torch.float64)
            per_target = torch.zeros(span + 1, dtype=torch.float64)  # the loss of target t at index t (1..span)
            windows = _windows(span, length, step, context)
            batch = max(1, tokens_per_batch // length)
            for group in (windows[i : i + batch] for i in range(0, len(windows), batch)):
                inputs = torch.stack([stream[s:e] for s, e, _ in group]).to(device)
                targets = torch.stack([stream[s + 1 : e + 1] for s, e, _ in group]).to(device)
                logits = model(inputs)
                losses = F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none").double().cpu()
                for row, (start, end, first) in enumerate(group):
                    total += losses[row, first:].sum()
                    by_position += losses[row]
                    per_target[start + 1 + first : end + 1] = losses[row, first:]
            result.loss = float(total / scored)
            result.loss_by_position = (by_position / len(windows)).tolist()
            result.windows = len(windows)
            if owners is not None:
                result.document_loss = np.bincount(owners, weights=per_target[1:].numpy()).tolist()
                result.document_tokens = np.bincount(owners[context:], minlength=len(result.document_loss)).tolist()
            results.append(result)
    finally:
        model.train(was_training)
    return results
