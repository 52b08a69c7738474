"""Synthetic extrapolation tasks on bytes, generated on the fly from a seed: passkey retrieval and copying.

Perplexity hides retrieval failures (a model can predict local text well while unable to look far back), so
these tasks ask for exact recall across the whole window:

- **passkey** (after Mohtashami & Jaggi, 2023): random filler text with ``#<digits>#`` hidden at a chosen depth;
  the window ends with ``?`` and the model must produce the digits. Scored as exact match of every digit.
- **copy**: a random string, ``|``, then the same string again; scored per token and per sequence.

Generation lives here, with the data; scoring (``posenc.evaluate.tasks``) builds on it. Each sample is (inputs,
targets) like language modelling, but targets are ``IGNORE`` (-100, skipped by cross-entropy) except on the
answer, so a model trained on the task learns only the retrieval.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
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
