"""Retrieval tasks beside passkey, after RULER's synthetic tasks (Hsieh et al., 2024), sized for byte tokens.

Each generator fills a window of ``length`` inputs with random filler and places its facts in it, keyed by bytes
the filler never uses, so nothing but the facts can answer the question:

- **multikey** (RULER's multi-key needle-in-a-haystack, with MQAR's one-byte keys): ``num_keys`` needles ``Kv``
  (a capital-letter key, distinct; ``value_len`` digits) at random depths of letter-and-digit filler, then
  ``num_queries`` of them asked again (``Kv``: the key repeated, its value the answer). The needles not asked are
  distractors; a longer window spreads the needles over more filler, so a question's distance to its needle is
  anything up to the window.
- **vartrack** (RULER's variable tracking): ``num_chains`` chains ``#A=ddd#``, ``#B=A#``, ``#C=B#`` … of
  ``hops`` + 1 capital-letter variables, statements in order at random depths; the window ends ``?ddd:`` with one
  chain's value and the answer is every variable of that chain, in assignment order.
- **mqar**: multi-query associative recall as Zoology defines it (``posenc/data/mqar.py``): one generator for
  training and evaluation windows.

``train_queries`` (multikey, training windows only) spreads that many questions over a training window, keys drawn
with replacement; evaluation windows keep the layout above, so multikey's training and evaluation windows differ.

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

from posenc.data import mqar
from posenc.data.tasks import DIGITS, FILLER_ALPHABET, IGNORE, Sample, TaskDataset

MULTIKEY_FILLER = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz0123456789", dtype=np.uint8)
CAPITALS = np.frombuffer(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ", dtype=np.uint8)


def _bytes(text: str) -> np.ndarray:
    return np.frombuffer(text.encode(), dtype=np.uint8)


Piece = tuple[np.ndarray, bool]  # bytes, and whether they are answer bytes (scored)


def _masked_sample(pieces: list[Piece]) -> Sample:
    """Concatenate (bytes, is_answer) pieces into a sample scored only where ``is_answer``."""
    sequence = torch.from_numpy(np.concatenate([p for p, _ in pieces]).astype(np.int64))
    answer = torch.from_numpy(np.concatenate([np.full(len(p), flag) for p, flag in pieces]))
    targets = sequence[1:].masked_fill(~answer[1:], IGNORE)
    return Sample(sequence[:-1], targets)


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


def _spread(items: list[list[Piece]], filler: np.ndarray, rng: np.random.Generator) -> list[Piece]:
    """``items`` (each a list of (bytes, is_answer) pieces) in order, each after a random share of ``filler``."""
    cuts = np.sort(rng.integers(0, len(filler) + 1, size=len(items)))
    pieces, previous = [], 0
    for cut, item in zip(cuts, items, strict=True):
        pieces += [(filler[previous:cut], False), *item]
        previous = cut
    return [*pieces, (filler[previous:], False)]


def _pair(key: np.ndarray, value: np.ndarray, asked: bool) -> list[Piece]:
    """A one-byte key and its value; when ``asked`` the value is an answer (scored), else a fact."""
    return [(key.reshape(1), False), (value, asked)]


def _check_sizes(
    task: str, facts: tuple[str, int, int], num_queries: int, value_len: int, train_queries: int | None
) -> None:
    """One clear line for a size a generator cannot honour."""
    name, count, most = facts
    if not 1 <= count <= most:
        raise ValueError(f"{task} {name} must be in 1..{most} (one-byte keys), got {count}")
    if not 1 <= num_queries <= count:
        raise ValueError(f"{task} num_queries must be in 1..{name}={count} (each key asked once), got {num_queries}")
    if value_len < 1:
        raise ValueError(f"{task} value_len must be ≥ 1, got {value_len}")
    if train_queries is not None and train_queries < 1:
        raise ValueError(f"{task} train_queries must be ≥ 1 or null, got {train_queries}")


def multikey_sample(
    length: int,
    rng: np.random.Generator,
    num_keys: int = 4,
    num_queries: int = 1,
    value_len: int = 1,
    train_queries: int | None = None,
) -> Sample:
    """``num_keys`` needles ``Kv`` at random depths of filler, then ``num_queries`` of them asked again.

    A needle is a capital-letter key (distinct; the filler has no capitals) and ``value_len`` digits; a question
    repeats a needle's key and its value is the answer: one induction step, as in ``mqar``, with the facts at any
    depth among filler instead of in a block. The needles not asked are RULER's distractors. ``train_queries``
    (training windows only) spreads that many questions over the window among the needles instead, each asking a
    needle placed before it (keys with replacement), so that questions at every distance carry loss.
    """
    _check_sizes("multikey", ("num_keys", num_keys, len(CAPITALS)), num_queries, value_len, train_queries)
    keys = rng.choice(CAPITALS, size=num_keys, replace=False)
    values = rng.choice(DIGITS, size=(num_keys, value_len))
    needles = [_pair(keys[i], values[i], asked=False) for i in range(num_keys)]
    if train_queries is None:
        asked = rng.choice(num_keys, size=num_queries, replace=False)
        items_len = (num_keys + num_queries) * (1 + value_len)
        filler = rng.choice(MULTIKEY_FILLER, size=_check_room("multikey", items_len, length))
        questions = [piece for i in asked for piece in _pair(keys[i], values[i], asked=True)]
        return _masked_sample([*_spread(needles, filler, rng), *questions])
    items_len = (num_keys + train_queries) * (1 + value_len)
    filler = rng.choice(MULTIKEY_FILLER, size=_check_room("multikey", items_len, length))
    kinds = rng.permutation(num_keys + train_queries) < num_keys  # True: the next needle, False: a question
    kinds[[0, int(np.argmax(kinds))]] = True, kinds[0]  # a needle comes first: every question has one to ask
    items, placed = [], 0
    for is_needle in kinds:
        if is_needle:
            items.append(needles[placed])
            placed += 1
        else:
            asked = int(rng.integers(placed))
            items.append(_pair(keys[asked], values[asked], asked=True))
    return _masked_sample(_spread(items, filler, rng))


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
    filler = rng.choice(FILLER_ALPHABET, size=_check_room("vartrack", needed, length))
    return _masked_sample(
        [*_spread([[(fact, False)] for fact in facts], filler, rng), (question, False), (answer, True)]
    )


def chance_rates(task: str, options: Mapping[str, Any] | None = None) -> tuple[float, float]:
    """(first answer byte, whole answer) accuracy of a uniform guess over the answer's alphabet."""
    options = dict(options or {})
    if task == "mqar":
        chance = mqar.chance_rate(int(options.get("vocab", mqar.VOCAB)))
        return chance, chance
    if task == "vartrack":
        first, answer_len = 1 / len(CAPITALS), options.get("hops", 2) + 1
    else:  # multikey: value_len digits
        first, answer_len = 1 / len(DIGITS), options.get("value_len", 1)
    return first, first**answer_len


def _keyless_choices(task: str, text: bytes, options: Mapping[str, Any]) -> list[tuple[list[bytes], list[bytes]]]:
    """(every fact's answer, the answers given before this one) for every answer of one sample.

    ``text`` is the sample's inputs and last target. A solver that never ties a key to its fact cannot tell the
    facts' answers apart; one that also strikes out the answers the window has already shown eliminates.
    """
    if task == "vartrack":
        chains: dict[bytes, list[bytes]] = {}
        for name, source in re.findall(rb"#([A-Z])=(\d+|[A-Z])#", text):
            root = next((value for value, chain in chains.items() if chain[-1] == source), source)
            chains.setdefault(root, []).append(name)
        return [([b"".join(chain) for chain in chains.values()], [])]
    # multikey: every needle in order, then the questions (each shows its answer after it)
    facts, queries = options.get("num_keys", 4), options.get("num_queries", 1)
    items = re.findall(rb"[A-Z](\d{%d})" % options.get("value_len", 1), text)
    return [(items[:facts], items[facts : facts + index]) for index in range(queries)]


def _best_guess(candidates: list[bytes]) -> float:
    """Probability that guessing the commonest candidate is right, when the answer is any one of them."""
    return max(candidates.count(c) for c in candidates) / len(candidates) if candidates else 0.0


def keyless_rates(
    task: str, options: Mapping[str, Any] | None = None, samples: int = 1000, length: int = 1024
) -> dict[str, float]:
    """Accuracy of the best solver blind to which key goes with which fact: the floor recall has to clear.

    ``keyless_exact`` / ``keyless_first_byte``: it guesses the commonest answer among the window's facts;
    ``keyless_exact_elimination`` / ``keyless_first_byte_elimination``: it also strikes out the answers given
    earlier in the window. A uniform-guess chance rate far below these would make such guessing look like recall.
    MQAR's floors are exact (``mqar.keyless_floors``); the others are estimated over ``samples`` windows of the
    evaluation's options (seeded, so every run records the same figures).
    """
    options = evaluation_options(options)
    if task == "mqar":
        blind, eliminating = mqar.keyless_floors(int(options.get("num_pairs", mqar.NUM_PAIRS)))
        return {
            "keyless_exact": blind,
            "keyless_first_byte": blind,
            "keyless_exact_elimination": eliminating,
            "keyless_first_byte_elimination": eliminating,
        }
    rng = np.random.default_rng(0)
    totals = dict.fromkeys(("exact", "first_byte", "exact_elimination", "first_byte_elimination"), 0.0)
    count = 0
    for _ in range(samples):
        sample = RETRIEVAL_TASKS[task](length, rng, **options)
        text = bytes([*sample.inputs.tolist(), int(sample.targets[-1])])
        for facts, given in _keyless_choices(task, text, options):
            remaining = list(facts)
            for answer in given:
                remaining.remove(answer)  # answered: the same value cannot answer a later (distinct) key
            for suffix, candidates in (("", facts), ("_elimination", remaining)):
                totals[f"exact{suffix}"] += _best_guess(candidates)
                totals[f"first_byte{suffix}"] += _best_guess([c[:1] for c in candidates])
            count += 1
    return {f"keyless_{key}": total / count for key, total in totals.items()}


RETRIEVAL_TASKS: dict[str, Callable[..., Sample]] = {  # generate(length, rng, **task_options)
    "multikey": multikey_sample,
    "vartrack": vartrack_sample,
    "mqar": mqar.mqar_sample,
}
# Options that shape training windows; evaluation never uses them.
TRAINING_ONLY_OPTIONS = ("train_queries",)


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
