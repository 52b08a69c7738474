"""MQAR as Zoology defines it: what a window holds, one generator for training and evaluation, and its scoring."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from posenc.data.datamodule import TaskDataModule
from posenc.data.mqar import answer_geometry, distance_bins, keyless_floors, mqar_sample, slot_weights
from posenc.data.retrieval import chance_rates, evaluation_options, keyless_rates
from posenc.data.tasks import IGNORE
from posenc.evaluate.effective import learned
from posenc.evaluate.mqar import evaluate_mqar

VOCAB = 257


def parse(sample) -> tuple[list[tuple[int, int, int]], list[int]]:
    """Read a window as a reader would: every (query position, key, answer), and the window's bytes."""
    tokens, targets = sample.inputs.tolist(), sample.targets.tolist()
    return [(t, tokens[t], target) for t, target in enumerate(targets) if target != IGNORE], tokens


@pytest.mark.parametrize(("length", "pairs"), [(64, 8), (64, 4), (1024, 8)])
def test_every_key_is_asked_once_and_answered_by_its_own_distinct_value(length: int, pairs: int) -> None:
    for seed in range(40):
        sample = mqar_sample(length, np.random.default_rng(seed), num_pairs=pairs)
        assert sample.inputs.shape == sample.targets.shape == (length,)
        tokens = sample.inputs.tolist()
        keys, values = tokens[0 : 2 * pairs : 2], tokens[1 : 2 * pairs : 2]
        assert len(set(keys)) == pairs and len(set(values)) == pairs  # no replacement, distinct values
        assert all(k < 128 for k in keys) and all(v >= 128 for v in values)  # disjoint halves of the bytes
        asked = [(t, target) for t, target in enumerate(sample.targets.tolist()) if target != IGNORE]
        assert sorted(tokens[t] for t, _ in asked) == sorted(keys)  # every key once
        assert all(dict(zip(keys, values, strict=True))[tokens[t]] == target for t, target in asked)
        assert all(t >= 2 * pairs and (t - 2 * pairs) % 2 == 0 for t, _ in asked)  # two-token slots after the block
        rest = [tok for t, tok in enumerate(tokens) if t >= 2 * pairs and t not in {q for q, _ in asked}]
        assert not set(rest) & set(keys)  # a window's keys occur only in the block and in their query


def test_a_window_never_shows_an_answer_after_its_query() -> None:
    shown, total = 0, 0
    for seed in range(300):
        sample = mqar_sample(64, np.random.default_rng(seed))
        for t, target in enumerate(sample.targets.tolist()):
            if target != IGNORE and t + 1 < 64:
                shown += int(sample.inputs[t + 1]) == target
                total += 1
    assert shown / total < 0.02  # only a random byte's chance (1 in 248) of equalling it


def test_query_slots_follow_zoologys_power_law() -> None:
    # one pair: its query slot is a single draw from the power law over the (64 − 2) / 2 = 31 slots
    slots = [(int((mqar_sample(64, np.random.default_rng(s), num_pairs=1).targets != IGNORE).nonzero()) - 2) // 2
             for s in range(8000)]  # fmt: skip
    frequencies = np.bincount(slots, minlength=31) / len(slots)
    expected = slot_weights(31)
    assert expected[0] / expected[1] == pytest.approx(2**0.99)  # P(i) ∝ a · i^(a − 1), a = 0.01
    assert 0.5 * np.abs(frequencies - expected).sum() < 0.03  # total variation distance


def test_query_order_says_nothing_about_block_order() -> None:
    # Zoology assigns keys to slots in draw order, which ties query order to block order (a keyless solver would
    # score 0.16 with 8 pairs); here the i-th query asks the i-th key of the block one time in 8, as chance says
    matches, total = 0, 0
    for seed in range(2000):
        sample = mqar_sample(64, np.random.default_rng(seed), num_pairs=8)
        keys = sample.inputs[0:16:2].tolist()
        asked = [int(sample.inputs[t]) for t in (sample.targets != IGNORE).nonzero().flatten().tolist()]
        matches += sum(key == keys[i] for i, key in enumerate(asked))
        total += len(asked)
    assert matches / total == pytest.approx(1 / 8, abs=0.012)


def test_longer_windows_spread_the_same_power_law_over_longer_distances() -> None:
    beyond = {length: [] for length in (64, 1024)}
    for seed in range(400):
        for length in beyond:
            sample = mqar_sample(length, np.random.default_rng(seed))
            beyond[length] += [d >= 64 for _, _, d in answer_geometry(sample.inputs, sample.targets)]
    assert not any(beyond[64])  # a training window keeps every query within the window
    assert 0.4 < np.mean(beyond[1024]) < 0.55  # about half of them past every training distance at 16×


def test_answer_geometry_reads_each_query_and_its_distance_off_the_window() -> None:
    for seed in range(20):
        sample = mqar_sample(256, np.random.default_rng(seed), num_pairs=8)
        queries, tokens = parse(sample)
        geometry = answer_geometry(sample.inputs, sample.targets)
        assert [at for at, _, _ in geometry] == [t for t, _, _ in queries]
        assert [index for _, index, _ in geometry] == list(range(8))
        assert [d for _, _, d in geometry] == [t - tokens.index(key) for t, key, _ in queries]


def test_distance_bins_split_at_the_training_length() -> None:
    assert distance_bins(64, 64) == [(1, 8), (8, 16), (16, 32), (32, 64)]
    assert distance_bins(64, 1024) == [(1, 8), (8, 16), (16, 32), (32, 64), (64, 128), (128, 256), (256, 512),
                                       (512, 1024)]  # fmt: skip


def test_floors_by_hand_and_one_generator_for_training_and_evaluation() -> None:
    assert keyless_floors(4) == pytest.approx((0.25, (1 + 1 / 2 + 1 / 3 + 1 / 4) / 4))  # 25/48 with elimination
    floors = keyless_rates("mqar", {"num_pairs": 8})
    assert floors["keyless_exact"] == 0.125 and floors["keyless_exact_elimination"] == pytest.approx(2.717857 / 8)
    assert chance_rates("mqar", {}) == (1 / 128, 1 / 128)
    options = {"num_pairs": 8, "power_a": 0.01}
    assert evaluation_options(options) == options  # nothing shapes training windows only
    data = TaskDataModule("mqar", seq_len=64, batch_size=4, num_samples=4, val_windows=4, task_options=options)
    for loader in (data.train_dataloader(), data.val_dataloader()):
        inputs, targets = next(iter(loader))
        assert ((targets != IGNORE).sum(dim=1) == 8).all() and (inputs[:, 0:16:2] < 128).all()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_pairs": 0}, "num_pairs must be in 1..128"),
        ({"power_a": 0.0}, "power_a must be in \\(0, 1\\]"),
        ({"num_pairs": 20}, "mqar needs length ≥ 80"),
        ({"vocab": 300}, "vocab must be an even number"),
    ],
)
def test_bad_options_fail_clearly(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mqar_sample(64, np.random.default_rng(0), **options)


class Lookup(nn.Module):
    """Solves MQAR by reading the block, but only for queries closer than ``reach`` to their key."""

    def __init__(self, reach: int, pairs: int = 4) -> None:
        super().__init__()
        self.reach, self.pairs = reach, pairs
        self.dummy = nn.Parameter(torch.zeros(()))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*tokens.shape, VOCAB)
        for row, seq in enumerate(tokens.tolist()):
            block = {seq[2 * i]: (2 * i, seq[2 * i + 1]) for i in range(self.pairs)}
            for t in range(2 * self.pairs, len(seq)):
                if seq[t] in block:
                    at, value = block[seq[t]]
                    logits[row, t, value if t - at < self.reach else (value + 1) % 256] = 1.0
        return logits


def test_scoring_by_length_distance_and_query() -> None:
    results = evaluate_mqar(Lookup(reach=64), [64, 256], train_len=64, samples=24, seed=3)
    by_length, by_distance, by_query = results["mqar"], results["mqar_by_distance"], results["mqar_by_query"]
    assert by_length[0]["accuracy"] == 1.0 and by_length[0]["training_format"]
    assert by_length[0]["answers"] == 24 * 4 and by_length[0]["low"] > 0.96 and by_length[0]["high"] == 1.0
    for row in by_distance:  # right exactly where the distance is within its reach
        assert row["accuracy"] == (1.0 if row["distance_high"] <= 64 else 0.0)
        assert 0.0 <= row["low"] <= row["accuracy"] <= row["high"] <= 1.0
    long = by_length[1]
    assert long["accuracy"] == pytest.approx(1 - long["beyond_train_len"])  # wrong on just the queries past 64
    assert sum(r["answers"] for r in by_distance if r["length"] == 256) == long["answers"]
    assert [r["query"] for r in by_query if r["length"] == 64] == list(range(1, 5))
    assert {r["keyless_exact"] for r in by_length} == {0.25} and by_length[0]["chance_exact"] == 1 / 128
    assert learned(by_length, 64) is True
    assert learned(evaluate_mqar(Lookup(reach=0), [64], 64, 24, 3)["mqar"], 64) is False
