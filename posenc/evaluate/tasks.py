"""Synthetic extrapolation tasks on bytes, generated on the fly from a seed: passkey retrieval and copying.

Perplexity hides retrieval failures (a model can predict local text well while unable to look far back), so
these tasks ask for exact recall across the whole window:

- **passkey** (after Mohtashami & Jaggi, 2023): random filler text with ``#<digits>#`` hidden at a chosen depth;
  the window ends with ``?`` and the model must produce the digits. Scored as exact match of every digit.
- **copy**: a random string, ``|``, then the same string again; scored per token and per sequence.

Each sample is (inputs, targets) like language modelling, but targets are ``IGNORE`` (-100, skipped by
cross-entropy) except on the answer, so a model trained on the task learns only the retrieval. Accuracy is
teacher-forced argmax on the answer positions: a sample counts as solved only if *every* answer token is the
argmax, which is exactly when greedy decoding would produce the whole answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

IGNORE = -100
FILLER_ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", dtype=np.uint8)
DIGITS = np.frombuffer(b"0123456789", dtype=np.uint8)
COPY_ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)


@dataclass
class Sample:
    inputs: Tensor  # (L,) int64
    targets: Tensor  # (L,) int64, IGNORE except on answer positions


def _sample(sequence: np.ndarray, answer_start: int) -> Sample:
    """Inputs are sequence[:-1]; only targets from ``answer_start`` (an index into the sequence) are scored."""
    seq = torch.from_numpy(sequence.astype(np.int64))
    targets = seq[1:].clone()
    targets[: answer_start - 1] = IGNORE
    return Sample(seq[:-1], targets)


def passkey_sample(length: int, depth: float, rng: np.random.Generator, key_digits: int = 5) -> Sample:
    """A window of ``length`` inputs with the key at relative ``depth`` ∈ [0, 1] of the filler.

    Layout: filler[:p] ``#`` key ``#`` filler[p:] ``?`` key, with p = round(depth · filler length).
    """
    key = rng.choice(DIGITS, size=key_digits)
    overhead = (key_digits + 2) + 1 + key_digits  # "#key#" + "?" + answer
    filler_len = length + 1 - overhead
    if filler_len < 0:
        raise ValueError(f"passkey needs length ≥ {overhead - 1} for {key_digits} digits, got {length}")
    filler = rng.choice(FILLER_ALPHABET, size=filler_len)
    at = round(min(max(depth, 0.0), 1.0) * filler_len)
    sequence = np.concatenate([filler[:at], [ord("#")], key, [ord("#")], filler[at:], [ord("?")], key]).astype(np.uint8)
    return _sample(sequence, answer_start=len(sequence) - key_digits)


def passkey_depth(sample: Sample, key_digits: int = 5) -> float:
    """Where the key sits in a passkey sample, as a fraction of the filler (for tests and checks)."""
    inputs = [*sample.inputs.tolist(), int(sample.targets[-1])]
    start = inputs.index(ord("#"))
    filler_len = len(inputs) - (2 * key_digits + 3)
    return start / filler_len if filler_len else 0.0


def copy_sample(length: int, rng: np.random.Generator) -> Sample:
    """A random string of n = length // 2 letters, ``|``, then the string again (the answer)."""
    n = length // 2
    if n < 1:
        raise ValueError(f"copy needs length ≥ 2, got {length}")
    text = rng.choice(COPY_ALPHABET, size=n)
    pad = rng.choice(COPY_ALPHABET, size=length + 1 - (2 * n + 1))  # odd lengths: leading filler
    sequence = np.concatenate([pad, text, [ord("|")], text]).astype(np.uint8)
    return _sample(sequence, answer_start=len(sequence) - n)


TASKS = {"passkey": passkey_sample, "copy": copy_sample}


class TaskDataset(Dataset):
    """``num_samples`` task samples of one length, each generated from (seed, index): reproducible, endless."""

    def __init__(self, task: str, length: int, num_samples: int, seed: int, start: int = 0) -> None:
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; available: {', '.join(TASKS)}")
        self.task, self.length, self.num_samples, self.seed, self.start = task, length, num_samples, seed, start

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        rng = np.random.default_rng([self.seed, self.start + index])
        if self.task == "passkey":
            sample = passkey_sample(self.length, float(rng.random()), rng)
        else:
            sample = copy_sample(self.length, rng)
        return sample.inputs, sample.targets


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
    """Passkey exact-match accuracy for every (length, depth), ``samples`` keys each (same keys per length)."""
    device = device or next(model.parameters()).device
    rows = []
    for length in lengths:
        for depth in depths:
            rng = np.random.default_rng([seed, length, int(depth * 1000)])
            batch = [passkey_sample(length, depth, rng) for _ in range(samples)]
            exact = _score_in_batches(model, batch, length, tokens_per_batch, device)[0]
            rows.append({"task": "passkey", "length": length, "depth": depth, "samples": samples, "accuracy": exact})
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
