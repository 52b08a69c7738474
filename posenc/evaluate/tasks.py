"""Scoring the synthetic tasks (``posenc.data.tasks`` generates them): exact-match accuracy by length and depth.

Accuracy is teacher-forced argmax on the answer positions: a sample counts as solved only if *every* answer token
is the argmax, which is exactly when greedy decoding would produce the whole answer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor, nn

from posenc.data import mqar
from posenc.data.retrieval import CAPITALS
from posenc.data.tasks import (
    COPY_ALPHABET,
    DIGITS,
    IGNORE,
    Sample,
    TaskDataset,
    copy_sample,
    passkey_depth,
    passkey_sample,
)

# Per-byte accuracy of guessing each answer byte uniformly from the alphabet it is drawn from: the floor a table of
# per-byte accuracies is read against (the chance of an exact match is this to the power of the answer's length).
CHANCE_PER_BYTE = {
    "passkey": 1 / len(DIGITS),
    "copy": 1 / len(COPY_ALPHABET),
    "multikey": 1 / len(DIGITS),
    "vartrack": 1 / len(CAPITALS),
    "mqar": mqar.chance_rate(),
}

__all__ = [
    "CHANCE_PER_BYTE",
    "IGNORE",
    "TaskDataset",
    "copy_sample",
    "evaluate_copy",
    "evaluate_passkey",
    "passkey_depth",
    "passkey_sample",
]


@torch.no_grad()
def answer_accuracy(model: nn.Module, inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Per sample: (all answer tokens correct, fraction of answer tokens correct), by teacher-forced argmax."""
    predictions = model(inputs).argmax(dim=-1)
    scored = targets != IGNORE
    correct = (predictions == targets) & scored
    exact = (correct | ~scored).all(dim=-1)
    fraction = correct.sum(-1).float() / scored.sum(-1).clamp(min=1).float()
    return exact, fraction


@torch.no_grad()
def evaluate_passkey(
    model: nn.Module,
    lengths: Sequence[int],
    depths: Sequence[float],
    samples: int,
    seed: int,
    tokens_per_batch: int = 16384,
    device: torch.device | str | None = None,
) -> list[dict]:
    """Passkey exact-match and per-byte accuracy for every (length, depth), ``samples`` keys each."""
    device = device or next(model.parameters()).device
    rows = []
    for length in lengths:
        for depth in depths:
            rng = np.random.default_rng([seed, length, int(depth * 1000)])
            batch = [passkey_sample(length, depth, rng) for _ in range(samples)]
            exact, token = _score_in_batches(model, batch, length, tokens_per_batch, device)
            rows.append(
                {
                    "task": "passkey",
                    "length": length,
                    "depth": depth,
                    "samples": samples,
                    "accuracy": exact,
                    "token_accuracy": token,
                }
            )
    return rows


@torch.no_grad()
def evaluate_copy(
    model: nn.Module,
    lengths: Sequence[int],
    samples: int,
    seed: int,
    tokens_per_batch: int = 16384,
    device: torch.device | str | None = None,
) -> list[dict]:
    """Copy accuracy by length: exact sequences and per-token."""
    device = device or next(model.parameters()).device
    rows = []
    for length in lengths:
        rng = np.random.default_rng([seed, length])
        batch = [copy_sample(length, rng) for _ in range(samples)]
        exact, token = _score_in_batches(model, batch, length, tokens_per_batch, device)
        rows.append({"task": "copy", "length": length, "samples": samples, "accuracy": exact, "token_accuracy": token})
    return rows


def _score_in_batches(
    model: nn.Module, batch: list[Sample], length: int, tokens_per_batch: int, device: torch.device | str
) -> tuple[float, float]:
    was_training = model.training
    model.eval()
    size = max(1, tokens_per_batch // length)
    exact_total, token_total = 0.0, 0.0
    try:
        for start in range(0, len(batch), size):
            chunk = batch[start : start + size]
            inputs = torch.stack([s.inputs for s in chunk]).to(device)
            targets = torch.stack([s.targets for s in chunk]).to(device)
            exact, fraction = answer_accuracy(model, inputs, targets)
            exact_total += float(exact.float().sum())
            token_total += float(fraction.sum())
    finally:
        model.train(was_training)
    return exact_total / len(batch), token_total / len(batch)
