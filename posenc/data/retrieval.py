"""Retrieval tasks beside passkey, after RULER's synthetic tasks (Hsieh et al., 2024), sized for byte tokens.

Each generator fills a window of ``length`` inputs with random filler (lowercase letters and spaces) and places
its facts in it with delimiters the filler never uses, so nothing but the facts can answer the question:

- **multikey** (RULER's multi-key needle-in-a-haystack): ``num_keys`` needles ``#KK=dddd#`` (two capital
  letters, four digits) at random depths; the window ends ``?KK=`` for one of them and the answer is its digits.
  The other needles are distractors with the same shape.
- **vartrack** (RULER's variable tracking): ``num_chains`` chains ``#A=ddd#``, ``#B=A#``, ``#C=B#`` … of
  ``hops`` + 1 capital-letter variables, statements in order at random depths; the window ends ``?ddd:`` with one
  chain's value and the answer is every variable of that chain, in assignment order.
- **assoc**: multi-query associative recall (MQAR, Arora et al., 2024, "Zoology"), byte-sized. A block of
  ``num_pairs`` pairs ``kv`` (a one-byte key, a lowercase letter, distinct; a value of ``value_len`` digits), a gap
  of spaces, then ``num_queries`` queries ``kv`` for distinct keys of the block: each query repeats a key and its
  value is the answer. One-byte keys make the lookup a single induction step, and every query answers, so a window
  supervises ``num_queries × value_len`` bytes. The number of pairs is the same at every length: a longer window
  only widens the gap, so the query–key distance is the variable a length changes (at length N every query is
  N − 2 · num_pairs · (value_len + 1) to N − 2 positions after its key, value_len 1 and num_queries = num_pairs).
  Training windows (``random_lead``) put a random share of the spaces before the block instead, so training sees
  every distance from 2 up to the window, and ``train_queries`` asks more queries than there are pairs, keys
  drawn with replacement, so that no answer follows by elimination from the answers already given.

Samples are (inputs, targets) like passkey's: targets are ``IGNORE`` except on answer bytes, so a model trained on
a task learns only the retrieval. Every sample is generated from a seeded generator: reproducible and endless.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from posenc.data.tasks import DIGITS, FILLER_ALPHABET, IGNORE, Sample, TaskDataset

GAP = ord(" ")  # assoc's filler: a byte no key or value uses
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


def assoc_sample(
    length: int,
    rng: np.random.Generator,
    num_pairs: int = 8,
    num_queries: int = 8,
    value_len: int = 1,
    random_lead: bool = False,
    train_queries: int | None = None,
) -> Sample:
    """MQAR: ``num_pairs`` pairs ``kv``, spaces, then ``num_queries`` queries ``kv``, each value scored.

    ``train_queries`` (training windows only; evaluation drops it, ``TRAINING_ONLY_OPTIONS``) asks that many
    queries, keys drawn *with* replacement. Distinct keys let the last queries be answered by elimination (the one
    value of the block not yet given), a shortcut a small model finds long before it learns to match keys; with
    replacement no elimination works, and a window can hold many more answers than it has pairs.
    """
    if not 1 <= num_pairs <= len(LOWERCASE):
        raise ValueError(f"assoc num_pairs must be in 1..{len(LOWERCASE)} (one-byte keys), got {num_pairs}")
    if not 1 <= num_queries <= num_pairs:
        raise ValueError(
            f"assoc num_queries must be in 1..num_pairs={num_pairs} (each key asked once), got {num_queries}"
        )
    if value_len < 1:
        raise ValueError(f"assoc value_len must be ≥ 1, got {value_len}")
    keys = rng.choice(LOWERCASE, size=num_pairs, replace=False)
    values = rng.choice(DIGITS, size=(num_pairs, value_len))
    block = np.concatenate([np.concatenate([[key], value]) for key, value in zip(keys, values, strict=True)])
    if train_queries is not None and train_queries < 1:
        raise ValueError(f"assoc train_queries must be ≥ 1 or null, got {train_queries}")
    if train_queries is None:
        asked = rng.choice(num_pairs, size=num_queries, replace=False)
    else:
        asked = rng.choice(num_pairs, size=train_queries, replace=True)
    num_queries = len(asked)
    filler_len = _check_room("assoc", len(block) + num_queries * (1 + value_len), length)
    lead = int(rng.integers(filler_len + 1)) if random_lead else 0
    pieces = [(np.full(lead, GAP), False), (block, False), (np.full(filler_len - lead, GAP), False)]
    for index in asked:
        pieces += [(keys[index : index + 1], False), (values[index], True)]
    return _masked_sample([(p.astype(np.uint8), flag) for p, flag in pieces])


def chance_rates(task: str, options: Mapping[str, Any] | None = None) -> tuple[float, float]:
    """(first answer byte, whole answer) accuracy of a uniform guess over the answer's alphabet."""
    options = dict(options or {})
    if task == "multikey":
        first, answer_len = 1 / len(DIGITS), options.get("value_digits", 4)
    elif task == "vartrack":
        first, answer_len = 1 / len(CAPITALS), options.get("hops", 2) + 1
    else:
        first, answer_len = 1 / len(DIGITS), options.get("value_len", 1)
    return first, first**answer_len


def _keyless_choices(task: str, text: bytes, options: Mapping[str, Any]) -> list[tuple[bytes, list[bytes]]]:
    """(answer, candidates) for every answer of one sample (``text``: its inputs and last target).

    The candidates are what a solver that never ties a key to its fact cannot tell apart: every fact's answer,
    less those the sample has already given.
    """
    if task == "multikey":
        values = re.findall(rb"#[A-Z]{2}=(\d+)#", text)
        return [(text[-len(values[0]) :], values)]
    if task == "vartrack":
        chains: dict[bytes, list[bytes]] = {}
        for name, source in re.findall(rb"#([A-Z])=(\d+|[A-Z])#", text):
            root = next((value for value, chain in chains.items() if chain[-1] == source), source)
            chains.setdefault(root, []).append(name)
        answers = [b"".join(chain) for chain in chains.values()]
        return [(text[-len(answers[0]) :], answers)]
    pairs, queries = options.get("num_pairs", 8), options.get("num_queries", 8)
    stride = 1 + options.get("value_len", 1)
    start = len(text) - len(text.lstrip(b" "))
    remaining = [text[start + i * stride + 1 : start + (i + 1) * stride] for i in range(pairs)]
    choices = []
    for q in range(len(text) - queries * stride, len(text), stride):
        answer = text[q + 1 : q + stride]
        choices.append((answer, list(remaining)))
        remaining.remove(answer)  # answered: the same value cannot answer a later (distinct) key
    return choices


def keyless_rates(
    task: str, options: Mapping[str, Any] | None = None, samples: int = 1000, length: int = 1024
) -> tuple[float, float]:
    """(first answer byte, whole answer) accuracy of the best solver blind to which key goes with which fact.

    It reads everything else and guesses the commonest answer among the window's facts, less those given already.

    This, not a uniform guess, is the floor a model must clear before it can be said to retrieve anything: a
    small model learns it early (on ``assoc`` with distinct queries the last answer follows by elimination), and
    a uniform-guess chance rate far below it would make that look like recall. Estimated over ``samples`` windows
    of the evaluation's options (seeded, so every run records the same figure).
    """
    options = evaluation_options(options)
    rng = np.random.default_rng(0)
    first, exact, count = 0.0, 0.0, 0
    for _ in range(samples):
        sample = RETRIEVAL_TASKS[task](length, rng, **options)
        text = bytes([*sample.inputs.tolist(), int(sample.targets[-1])])
        for _answer, candidates in _keyless_choices(task, text, options):
            exact += max(candidates.count(c) for c in candidates) / len(candidates)
            heads = [c[:1] for c in candidates]
            first += max(heads.count(h) for h in heads) / len(heads)
            count += 1
    return first / count, exact / count


RETRIEVAL_TASKS: dict[str, Callable[..., Sample]] = {  # generate(length, rng, **task_options)
    "multikey": multikey_sample,
    "vartrack": vartrack_sample,
    "assoc": assoc_sample,
}
# Options that shape training windows; evaluation never uses them.
TRAINING_ONLY_OPTIONS = ("random_lead", "train_queries")


class RetrievalDataset(Dataset):
    """``num_samples`` samples of one retrieval task and length, each generated from (seed, index).

    ``options`` are the generator's keyword arguments (the data config's ``task_options``), checked once here so
    that a wrong name or size fails before training starts.
    """

    def __init__(
        self,
        task: str,
        length: int,
        num_samples: int,
        seed: int,
        start: int = 0,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        if task not in RETRIEVAL_TASKS:
            raise ValueError(f"unknown retrieval task {task!r}; available: {', '.join(RETRIEVAL_TASKS)}")
        self.generate = RETRIEVAL_TASKS[task]
        self.options = dict(options or {})
        self.length, self.num_samples, self.seed, self.start = length, num_samples, seed, start
        try:
            self.generate(length, np.random.default_rng(0), **self.options)
        except TypeError as err:
            raise ValueError(f"data.task_options {sorted(self.options)} do not fit {task}: {err}") from None

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        sample = self.generate(self.length, np.random.default_rng([self.seed, self.start + index]), **self.options)
        return sample.inputs, sample.targets


def evaluation_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The task options an evaluation generates with: the training ones minus those that shape training only."""
    return {key: value for key, value in (options or {}).items() if key not in TRAINING_ONLY_OPTIONS}


def task_dataset(
    task: str,
    length: int,
    num_samples: int,
    seed: int,
    start: int = 0,
    options: Mapping[str, Any] | None = None,
) -> Dataset:
    """The generated dataset of any synthetic task: a retrieval task here (with its options), or passkey / copy."""
    if task in RETRIEVAL_TASKS:
        return RetrievalDataset(task, length, num_samples, seed, start, options)
    if options:
        raise ValueError(f"data.task_options are for the retrieval tasks ({', '.join(RETRIEVAL_TASKS)}), not {task}")
    return TaskDataset(task, length, num_samples, seed, start)
