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
- **assoc**: multi-query associative recall (MQAR, Arora et al., 2024, "Zoology"), byte-sized. A block of
  ``num_pairs`` pairs ``kv`` (a one-byte key, a lowercase letter, distinct; a value of ``value_len`` digits), a gap
  of random digits, then ``num_queries`` queries ``kv`` for distinct keys of the block: each query repeats a key
  and its value is the answer. One-byte keys make the lookup a single induction step, and every query answers, so a
  window supervises ``num_queries × value_len`` bytes. The number of pairs is the same at every length: a longer window
  only widens the gap, so the query–key distance is the variable a length changes (at length N every query is
  N − 2 · num_pairs · (value_len + 1) to N − 2 positions after its key, value_len 1 and num_queries = num_pairs).

``train_queries`` (assoc and multikey, training windows only) shapes training windows as Zoology's MQAR does: that
many questions spread over the window, keys drawn with replacement. Evaluation windows keep the layout above.

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

# Filler drawn from the values' own alphabet: a guess among the window's digits is then a uniform guess, so the only
# way above chance is to tell values from filler and then which value is whose. With a filler of spaces (or of
# letters only) every digit in the window is a value, and a small model settles on the block's values as a bag, a
# solution that delayed the key lookup past 9,000 steps on every seed but one of those tried; with digit filler the
# lookup formed within 1,000 steps (docs: the retrieval section of the README).
ASSOC_FILLER = DIGITS
MULTIKEY_FILLER = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz0123456789", dtype=np.uint8)
CAPITALS = np.frombuffer(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ", dtype=np.uint8)
LOWERCASE = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)


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
    repeats a needle's key and its value is the answer: one induction step, as in ``assoc``, with the facts at any
    depth among filler instead of in a block. The needles not asked are RULER's distractors. ``train_queries``
    (training windows only) spreads that many questions over the window among the needles instead, each asking a
    needle placed before it (keys with replacement), for the reason ``assoc_sample`` gives.
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


def assoc_sample(
    length: int,
    rng: np.random.Generator,
    num_pairs: int = 8,
    num_queries: int = 8,
    value_len: int = 1,
    train_queries: int | None = None,
) -> Sample:
    """MQAR: ``num_pairs`` pairs ``kv``, a gap of random digits, then ``num_queries`` queries ``kv``, each value scored.

    ``train_queries`` (training windows only; evaluation drops it, ``TRAINING_ONLY_OPTIONS``) shapes a window the
    way Zoology's MQAR does: that many queries, keys drawn *with* replacement, each after a random share of the gap
    that follows the block. Evaluation's layout (distinct keys, all queries after the gap) teaches a small model
    to answer the last query by elimination (the one value not yet given) long before any lookup; queries spread
    over the whole window carry loss at every distance from the block up to the window, and keys drawn with
    replacement leave nothing to eliminate. The gap's digits (``ASSOC_FILLER``) take away the other shortcut.
    """
    _check_sizes("assoc", ("num_pairs", num_pairs, len(LOWERCASE)), num_queries, value_len, train_queries)
    keys = rng.choice(LOWERCASE, size=num_pairs, replace=False)
    values = rng.choice(DIGITS, size=(num_pairs, value_len))
    block = [piece for i in range(num_pairs) for piece in _pair(keys[i], values[i], asked=False)]
    if train_queries is None:
        asked = rng.choice(num_pairs, size=num_queries, replace=False)
    else:
        asked = rng.choice(num_pairs, size=train_queries, replace=True)
    queries = [_pair(keys[i], values[i], asked=True) for i in asked]
    gap = rng.choice(ASSOC_FILLER, size=_check_room("assoc", (num_pairs + len(asked)) * (1 + value_len), length))
    if train_queries is None:  # every query after the gap: the distance to the block is what a length changes
        return _masked_sample([*block, (gap, False), *(piece for query in queries for piece in query)])
    return _masked_sample([*block, *_spread(queries, gap, rng)])


def chance_rates(task: str, options: Mapping[str, Any] | None = None) -> tuple[float, float]:
    """(first answer byte, whole answer) accuracy of a uniform guess over the answer's alphabet."""
    options = dict(options or {})
    if task == "vartrack":
        first, answer_len = 1 / len(CAPITALS), options.get("hops", 2) + 1
    else:  # assoc and multikey: value_len digits
        first, answer_len = 1 / len(DIGITS), options.get("value_len", 1)
    return first, first**answer_len


def _keyless_choices(task: str, text: bytes, options: Mapping[str, Any]) -> list[tuple[bytes, list[bytes]]]:
    """(answer, candidates) for every answer of one sample (``text``: its inputs and last target).

    The candidates are what a solver that never ties a key to its fact cannot tell apart: every fact's answer,
    less those the sample has already given.
    """
    if task == "vartrack":
        chains: dict[bytes, list[bytes]] = {}
        for name, source in re.findall(rb"#([A-Z])=(\d+|[A-Z])#", text):
            root = next((value for value, chain in chains.items() if chain[-1] == source), source)
            chains.setdefault(root, []).append(name)
        answers = [b"".join(chain) for chain in chains.values()]
        return [(text[-len(answers[0]) :], answers)]
    # assoc and multikey: every key-value item in order, the facts first and the questions last
    facts, key = (
        (options.get("num_keys", 4), rb"[A-Z]") if task == "multikey" else (options.get("num_pairs", 8), rb"[a-z]")
    )
    queries = options.get("num_queries", 1 if task == "multikey" else 8)
    items = re.findall(key + rb"(\d{%d})" % options.get("value_len", 1), text)
    remaining, choices = items[:facts], []
    for answer in items[-queries:]:
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
