"""Multi-query associative recall (MQAR) as Zoology defines it (Arora et al., 2024), on byte tokens.

One generator makes every window, for training and for evaluation:

- a block of ``num_pairs`` key–value pairs opens the window: keys distinct, drawn from the lower half of the byte
  vocabulary (0–127), values distinct, drawn from the upper half (128–255), so every value names one key;
- every key is asked once (no replacement) in the rest of the window, which Zoology cuts into two-token slots: a
  query is a key at the start of a slot, and the model must answer with its value at that position (the target of
  the query byte). The slots are drawn without replacement with Zoology's power law, P(slot i) ∝ a · i^(a − 1)
  (i = 1 … (length − 2 · num_pairs) / 2, ``power_a`` = 0.01: short gaps after the block are far likelier), so the
  query–key distances of real text's repeated bigrams are imitated;
- everything else is a random byte (Zoology's ``random_non_queries``), the answer slot after a query included:
  a window never shows an answer, so no later answer follows by elimination.

Two departures from Zoology's code, both to keep byte-sized windows honest. Filler never uses the window's own
keys: with 8,192 tokens a random key collision is rare, with 256 it would be a spurious second occurrence of a key
in most windows. And keys are assigned to the drawn slots in random order: Zoology gives the first key the first
slot drawn, which under the power law is usually the nearest, so query order follows block order and a solver
blind to keys answers 0.29 instead of 1/4 with 4 pairs (0.16 instead of 1/8 with 8).

**Where the block sits** (``kv_offset``, not part of Zoology's protocol). With ``zoology`` (the default, and
every result before the option) the block opens the window, so a query's distance from its key is its position less
0–6: "accuracy by distance" is then accuracy by position, and no answer late in a long window is near its key. With
``random`` the block starts at an offset drawn uniformly from 0 to ``length − 4 · num_pairs`` after a prefix of
filler, and the queries are drawn with the same power law over the slots left after it: distance and position come
apart (their correlation over answers is about 0.2 at 1,024 tokens with 4 pairs, against 1.0 for ``zoology``), and
short distances occur at every position. The ``zoology`` windows are the offset-0 case, drawn with exactly the
random numbers they always were.

**Length extrapolation** (not part of Zoology's protocol, which tests at the training length): the same
generator at a longer ``length``. The block and the pair count stay; the query slots spread over the longer
window with the same power law, so the query–key distances reach the new length: with 4 pairs a window of 64
puts every query within 62 tokens of its key (median 14), one of 1,024 puts 45% of them 64 or more tokens from it
(median 46, up to 1,022; 17%, 29% and 38% at 128, 256 and 512). Most queries stay near their keys at every length,
so the evaluation reports accuracy by distance, not only by window length (``answer_geometry`` reads each answer's
distance off its window), and each length's row states its distances.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from posenc.data.tasks import IGNORE, Sample

VOCAB = 256  # Zoology's vocab_size: keys are the lower half of the tokens 0 … vocab − 1, values the upper half
POWER_A = 0.01
NUM_PAIRS = 4  # Zoology's setting at 64 tokens (it doubles the pairs with the length: 128 → 8, 256 → 16)
KV_OFFSETS = ("zoology", "random")  # where the key-value block sits: the window's start, or after a random prefix


def check_options(length: int, num_pairs: int, power_a: float, vocab: int = VOCAB, kv_offset: str = "zoology") -> None:
    """One clear line for a size or layout the generator cannot honour."""
    if kv_offset not in KV_OFFSETS:
        raise ValueError(f"mqar kv_offset must be one of {', '.join(KV_OFFSETS)}, got {kv_offset!r}")
    if not 4 <= vocab <= 256 or vocab % 2:
        raise ValueError(f"mqar vocab must be an even number of byte tokens in 4..256, got {vocab}")
    if not 1 <= num_pairs <= vocab // 2:
        raise ValueError(f"mqar num_pairs must be in 1..{vocab // 2} (distinct keys and values), got {num_pairs}")
    if not 0.0 < power_a <= 1.0:
        raise ValueError(f"mqar power_a must be in (0, 1] (1 is uniform), got {power_a}")
    if length < 4 * num_pairs:
        raise ValueError(f"mqar needs length ≥ {4 * num_pairs} (a block and a slot per query), got {length}")


def slot_weights(slots: int, power_a: float = POWER_A) -> np.ndarray:
    """Zoology's power law over the query slots after the block: P(i) ∝ a · i^(a − 1), i = 1 … slots."""
    weights = power_a * np.arange(1, slots + 1, dtype=np.float64) ** (power_a - 1)
    return weights / weights.sum()


def mqar_sample(
    length: int,
    rng: np.random.Generator,
    num_pairs: int = NUM_PAIRS,
    power_a: float = POWER_A,
    vocab: int = VOCAB,
    kv_offset: str = "zoology",
) -> Sample:
    """One MQAR window of ``length`` inputs (see the module docstring); targets are the values of the queries."""
    check_options(length, num_pairs, power_a, vocab, kv_offset)
    block = 2 * num_pairs
    # Drawn first, and only for a random layout: Zoology's windows keep every random number they always had.
    offset = int(rng.integers(0, length - 2 * block + 1)) if kv_offset == "random" else 0
    keys = rng.choice(vocab // 2, size=num_pairs, replace=False)
    values = vocab // 2 + rng.choice(vocab // 2, size=num_pairs, replace=False)
    slots = (length - offset - block) // 2  # ≥ num_pairs: the offset leaves room for a slot per query
    chosen = rng.choice(slots, size=num_pairs, replace=False, p=slot_weights(slots, power_a))
    asked = rng.permutation(num_pairs)  # which key each drawn slot asks
    filler = np.setdiff1d(np.arange(vocab), keys)
    sequence = rng.choice(filler, size=length + 1)  # the prefix before the block is filler too
    sequence[offset : offset + block : 2], sequence[offset + 1 : offset + block : 2] = keys, values
    targets = np.full(length, IGNORE, dtype=np.int64)
    positions = offset + block + 2 * chosen
    sequence[positions] = keys[asked]
    targets[positions] = values[asked]
    return Sample(torch.from_numpy(sequence[:-1]), torch.from_numpy(targets))


def answer_geometry(inputs: torch.Tensor, targets: torch.Tensor) -> list[tuple[int, int, int]]:
    """(position, query index, query–key distance) of every answer of one window (L,), in window order.

    The distance is from the key in the block to its query (t − j), read off the window itself: a window's keys
    occur only in the block and in their query, so a key's first occurrence is its place in the block.
    """
    positions = (targets != IGNORE).nonzero().flatten().tolist()
    tokens = inputs.tolist()
    first: dict[int, int] = {}
    for at, token in enumerate(tokens):
        first.setdefault(token, at)
    return [(at, index, at - first[tokens[at]]) for index, at in enumerate(positions)]


def keyless_floors(num_pairs: int) -> tuple[float, float]:
    """Exact accuracy of the best solver blind to which key holds which value: (without, with elimination).

    Values are distinct, so a guess among the block's values is right one time in ``num_pairs``. A solver that also
    struck out the values of the earlier queries would reach (1/n) · Σ_{j=1..n} 1/j (H_n / n); these windows never
    show an answer, so elimination needs the lookup itself: the second floor is an upper reference, not a baseline
    a model can reach without recall.
    """
    harmonic = math.fsum(1.0 / j for j in range(1, num_pairs + 1))
    return 1.0 / num_pairs, harmonic / num_pairs


def chance_rate(vocab: int = VOCAB) -> float:
    """A uniform guess over the value alphabet (the upper half of the vocabulary)."""
    return 2.0 / vocab


def distance_bins(train_len: int, longest: int) -> list[tuple[int, int]]:
    """Query–key distance bins [low, high) in powers of two of the training length, up to ``longest``.

    Below the training length: [1, L/8), [L/8, L/4), [L/4, L/2), [L/2, L); beyond it [L, 2L), [2L, 4L), … : the
    bins at and past L hold the distances no training window had.
    """
    edges = [1] + [max(1, train_len // 2**k) for k in (3, 2, 1)] + [train_len]
    while edges[-1] < longest:
        edges.append(edges[-1] * 2)
    edges = sorted(set(edges))
    return list(itertools.pairwise(edges))
