"""Retrieval tasks beside passkey, after RULER's synthetic tasks (Hsieh et al., 2024), sized for byte tokens.

Each generator fills a window of ``length`` inputs with random filler (lowercase letters and spaces) and places
its facts in it with delimiters the filler never uses, so nothing but the facts can answer the question:

- **multikey** (RULER's multi-key needle-in-a-haystack): ``num_keys`` needles ``#KK=dddd#`` (two capital
  letters, four digits) at random depths; the window ends ``?KK=`` for one of them and the answer is its digits.
  The other needles are distractors with the same shape.
- **vartrack** (RULER's variable tracking): ``num_chains`` chains ``#A=ddd#``, ``#B=A#``, ``#C=B#`` … of
  ``hops`` + 1 capital-letter variables, statements in order at random depths; the window ends ``?ddd:`` with one
  chain's value and the answer is every variable of that chain, in assignment order.
- **assoc** (associative recall, as in the Zoology/MQAR benchmark): ``kk:vv,`` pairs (two lowercase letters, two
  digits, distinct keys) fill the whole window, so longer windows hold more pairs; it ends with ``queries``
  questions ``?kk:vv`` about keys from anywhere in the window, every answer scored.

Samples are (inputs, targets) like passkey's: targets are ``IGNORE`` except on answer bytes, so a model trained on
a task learns only the retrieval. Every sample is generated from a seeded generator: reproducible and endless.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from posenc.data.tasks import DIGITS, FILLER_ALPHABET, IGNORE, Sample, TaskDataset

CAPITALS = np.frombuffer(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ", dtype=np.uint8)
LOWERCASE = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)


def _bytes(text: str) -> np.ndarray:
    return np.frombuffer(text.encode(), dtype=np.uint8)


def _masked_sample(pieces: list[tuple[np.ndarray, bool]]) -> Sample:
    """Concatenate (bytes, is_answer) pieces into a sample scored only where ``is_answer``."""
    sequence = torch.from_numpy(np.concatenate([p for p, _ in pieces]).astype(np.int64))
    answer = torch.from_numpy(np.concatenate([np.full(len(p), flag) for p, flag in pieces]))
    targets = sequence[1:].masked_fill(~answer[1:], IGNORE)
    return Sample(sequence[:-1], targets)


def _scatter(facts: list[np.ndarray], filler_len: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Filler of ``filler_len`` bytes with ``facts`` inserted, in order, at sorted random depths."""
    filler = rng.choice(FILLER_ALPHABET, size=filler_len)
    cuts = np.sort(rng.integers(0, filler_len + 1, size=len(facts)))
    pieces, previous = [], 0
    for cut, fact in zip(cuts, facts, strict=True):
        pieces += [filler[previous:cut], fact]
        previous = cut
    return [*pieces, filler[previous:]]


def _check_room(task: str, needed: int, length: int) -> int:
    """Filler length for a window of ``length`` inputs (length + 1 bytes) holding ``needed`` fixed bytes."""
    filler_len = length + 1 - needed
    if filler_len < 0:
        raise ValueError(f"{task} needs length ≥ {needed - 1} with these options, got {length}")
    return filler_len


def _distinct(alphabet: np.ndarray, width: int, count: int, rng: np.random.Generator) -> list[str]:
    """``count`` distinct random strings of ``width`` letters from ``alphabet``."""
    letters = bytes(alphabet).decode()
    if count > len(letters) ** width:
        raise ValueError(f"cannot draw {count} distinct names of {width} letter(s) from {len(letters)} letters")
    chosen: dict[str, None] = {}
    while len(chosen) < count:
        chosen["".join(rng.choice(list(letters), size=width))] = None
    return list(chosen)


def multikey_sample(length: int, rng: np.random.Generator, num_keys: int = 4, value_digits: int = 4) -> Sample:
    """``num_keys`` needles ``#KK=value#`` in filler; the window asks ``?KK=`` for one and answers its value."""
    keys = _distinct(CAPITALS, 2, num_keys, rng)
    values = [bytes(rng.choice(DIGITS, size=value_digits)).decode() for _ in keys]
    needles = [_bytes(f"#{key}={value}#") for key, value in zip(keys, values, strict=True)]
    asked = int(rng.integers(num_keys))
    question = _bytes(f"?{keys[asked]}=")
    needed = sum(len(n) for n in needles) + len(question) + value_digits
    pieces = _scatter(needles, _check_room("multikey", needed, length), rng)
    return _masked_sample([(p, False) for p in pieces] + [(question, False), (_bytes(values[asked]), True)])


def vartrack_sample(
    length: int, rng: np.random.Generator, num_chains: int = 2, hops: int = 2, value_digits: int = 3
) -> Sample:
    """Chains ``#A=value#``, ``#B=A#`` …; the window asks ``?value:`` and answers that chain's variables in order."""
    names = _distinct(CAPITALS, 1, num_chains * (hops + 1), rng)
    chains = [names[i * (hops + 1) : (i + 1) * (hops + 1)] for i in range(num_chains)]
    values = _distinct(DIGITS, value_digits, num_chains, rng)
    statements = [
        [_bytes(f"#{chain[0]}={value}#")] + [_bytes(f"#{new}={old}#") for old, new in itertools.pairwise(chain)]
        for chain, value in zip(chains, values, strict=True)
    ]
    order = rng.permutation(np.repeat(np.arange(num_chains), hops + 1))  # interleave chains, keep each in order
    cursors = [0] * num_chains
    facts = []
    for chain in order:
        facts.append(statements[chain][cursors[chain]])
        cursors[chain] += 1
    asked = int(rng.integers(num_chains))
    question, answer = _bytes(f"?{values[asked]}:"), _bytes("".join(chains[asked]))
    needed = sum(len(f) for f in facts) + len(question) + len(answer)
    pieces = _scatter(facts, _check_room("vartrack", needed, length), rng)
    return _masked_sample([(p, False) for p in pieces] + [(question, False), (answer, True)])


def assoc_sample(length: int, rng: np.random.Generator, queries: int = 2) -> Sample:
    """``kk:vv,`` pairs filling the window, then ``queries`` questions ``?kk:vv`` about keys anywhere in it."""
    pair_len, question_len = 6, 6  # "kk:vv," and "?kk:vv"
    num_pairs = (length + 1 - queries * question_len) // pair_len
    if num_pairs < queries:
        raise ValueError(f"assoc needs length ≥ {queries * (pair_len + question_len) - 1}, got {length}")
    keys = _distinct(LOWERCASE, 2, num_pairs, rng)
    values = [bytes(rng.choice(DIGITS, size=2)).decode() for _ in keys]
    pad = rng.choice(FILLER_ALPHABET, size=length + 1 - num_pairs * pair_len - queries * question_len)
    pieces = [(pad, False), (_bytes("".join(f"{k}:{v}," for k, v in zip(keys, values, strict=True))), False)]
    for asked in rng.choice(num_pairs, size=queries, replace=False):
        pieces += [(_bytes(f"?{keys[asked]}:"), False), (_bytes(values[asked]), True)]
    return _masked_sample(pieces)


RETRIEVAL_TASKS: dict[str, Callable[[int, np.random.Generator], Sample]] = {
    "multikey": multikey_sample,
    "vartrack": vartrack_sample,
    "assoc": assoc_sample,
}


class RetrievalDataset(Dataset):
    """``num_samples`` samples of one retrieval task and length, each generated from (seed, index)."""

    def __init__(self, task: str, length: int, num_samples: int, seed: int, start: int = 0) -> None:
        if task not in RETRIEVAL_TASKS:
            raise ValueError(f"unknown retrieval task {task!r}; available: {', '.join(RETRIEVAL_TASKS)}")
        self.generate = RETRIEVAL_TASKS[task]
        self.length, self.num_samples, self.seed, self.start = length, num_samples, seed, start

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        sample = self.generate(self.length, np.random.default_rng([self.seed, self.start + index]))
        return sample.inputs, sample.targets


def task_dataset(task: str, length: int, num_samples: int, seed: int, start: int = 0) -> Dataset:
    """The generated dataset of any synthetic task: a retrieval task here, or passkey / copy."""
    if task in RETRIEVAL_TASKS:
        return RetrievalDataset(task, length, num_samples, seed, start)
    return TaskDataset(task, length, num_samples, seed, start)
