"""MQAR that separates distance from position: the key-value block at a random offset, Zoology's layout as offset 0,
the distance × position table, and effective length from the answers past the training length only."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from posenc.data.mqar import answer_geometry, distance_bins, mqar_sample
from posenc.data.retrieval import RetrievalDataset
from posenc.data.tasks import IGNORE
from posenc.evaluate.effective import both_rules
from posenc.evaluate.mqar import distance_position_table, evaluate_mqar
from posenc.report import build_report, find_results

# sha256 over the inputs and targets of windows (3, length, i), i < 40, at lengths 16, 64 and 1,024, as the generator
# made them before it had a kv_offset: Zoology's layout must stay those exact windows.
ZOOLOGY_DIGEST = "3d6f8e7b56897e0ef2b3aaba944bf1cb697865cb3dfe7409fd188c425fb6257d"


def _digest(**options: str) -> str:
    digest = hashlib.sha256()
    for length in (16, 64, 1024):
        for index in range(40):
            sample = mqar_sample(length, np.random.default_rng([3, length, index]), **options)
            digest.update(sample.inputs.numpy().tobytes())
            digest.update(sample.targets.numpy().tobytes())
    return digest.hexdigest()


def test_zoologys_layout_is_the_offset_zero_case_bit_for_bit() -> None:
    assert _digest() == ZOOLOGY_DIGEST
    assert _digest(kv_offset="zoology") == ZOOLOGY_DIGEST


def _answers(length: int, windows: int, kv_offset: str) -> np.ndarray:
    """(position, distance) of every answer of ``windows`` windows."""
    rows = []
    for index in range(windows):
        sample = mqar_sample(length, np.random.default_rng([11, index]), kv_offset=kv_offset)
        rows += [(at, distance) for at, _, distance in answer_geometry(sample.inputs, sample.targets)]
    return np.asarray(rows)


def test_a_random_offset_separates_distance_from_position() -> None:
    zoology, shifted = _answers(1024, 1500, "zoology"), _answers(1024, 1500, "random")
    assert np.corrcoef(zoology.T)[0, 1] > 0.99  # the block at the start: distance is position less 0-6
    assert abs(np.corrcoef(shifted.T)[0, 1]) < 0.3  # about 0.2 measured over 4,000 windows
    late = shifted[:, 0] >= 512
    assert late.mean() > 0.3 and (shifted[late, 1] < 64).mean() > 0.5  # near answers late in the window
    assert not ((zoology[:, 0] >= 512) & (zoology[:, 1] < 64)).any()


@pytest.mark.parametrize("length", [24, 64, 1024])
def test_random_offset_windows_hold_a_block_and_its_queries(length: int) -> None:
    offsets = set()
    for seed in range(60):
        sample = mqar_sample(length, np.random.default_rng(seed), kv_offset="random")
        tokens, targets = sample.inputs.tolist(), sample.targets.tolist()
        asked = [t for t, target in enumerate(targets) if target != IGNORE]
        first = {}
        for at, token in enumerate(tokens):
            first.setdefault(token, at)
        keys_at = sorted(first[tokens[t]] for t in asked)  # each key's place in the block
        offset = keys_at[0]
        assert keys_at == list(range(offset, offset + 8, 2)) and 0 <= offset <= length - 16
        pairs = {tokens[offset + 2 * i]: tokens[offset + 2 * i + 1] for i in range(4)}
        assert all(pairs[tokens[t]] == targets[t] for t in asked) and all(t >= offset + 8 for t in asked)
        assert all(tokens.count(key) == 2 for key in pairs)  # in the block and in its query, nowhere else
        offsets.add(offset)
    assert len(offsets) > 5


def test_training_and_evaluation_share_the_generator_and_a_bad_layout_is_refused() -> None:
    dataset = RetrievalDataset("mqar", 64, 4, seed=0, options={"kv_offset": "random"})
    inputs, targets = dataset[0]
    expected = mqar_sample(64, np.random.default_rng([0, 0]), kv_offset="random")
    assert torch.equal(inputs, expected.inputs) and torch.equal(targets, expected.targets)
    with pytest.raises(ValueError, match="kv_offset must be one of zoology, random, got 'middle'"):
        RetrievalDataset("mqar", 64, 4, seed=0, options={"kv_offset": "middle"})


def test_the_distance_position_table_counts_by_hand() -> None:
    bins = distance_bins(16, 64)  # [1,2) [2,4) [4,8) [8,16) [16,32) [32,64)
    answers = [
        (10, 0, 3, True),  # distance [2,4), position [8,16)
        (12, 1, 2, False),  # the same cell
        (40, 2, 3, True),  # distance [2,4), position [32,64)
        (40, 3, 33, True),  # distance [32,64), position [32,64)
        (0, 0, 1, False),  # position 0 counts in the first bin
    ]
    cells = {
        (r["distance_low"], r["position_low"]): (r["answers"], r["correct"])
        for r in distance_position_table(answers, bins)
    }
    assert cells == {(2, 8): (2, 1), (2, 32): (1, 1), (32, 32): (1, 1), (1, 1): (1, 0)}


class EarlyOnly(nn.Module):
    """Finds each query's key wherever the block is, but answers right only at positions below ``reach``."""

    def __init__(self, reach: int) -> None:
        super().__init__()
        self.reach = reach
        self.dummy = nn.Parameter(torch.zeros(()))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*tokens.shape, 256)
        for row, seq in enumerate(tokens.tolist()):
            seen: dict[int, int] = {}
            for t, token in enumerate(seq):
                if token in seen and token < 128 and seen[token] + 1 < len(seq):
                    value = seq[seen[token] + 1]
                    logits[row, t, value if t < self.reach else (value + 1) % 256] = 1.0
                seen.setdefault(token, t)
        return logits


def test_effective_length_reads_only_answers_past_the_training_length(tmp_path: Path) -> None:
    options = {"kv_offset": "random"}
    scored = evaluate_mqar(EarlyOnly(reach=64), [64, 128, 256], train_len=64, samples=40, seed=5, options=options)
    rows = {row["length"]: row for row in scored["mqar"]}
    assert rows[64]["accuracy"] == 1.0 and rows[64]["past_train_len_accuracy"] == 1.0
    assert rows[256]["past_train_len_accuracy"] == 0.0 and rows[256]["accuracy"] > 0.05  # early answers still right
    assert abs(rows[256]["distance_position_correlation"]) < 0.6
    for cell in scored["mqar_by_distance_position"]:  # right exactly in the position bins below 64
        assert cell["accuracy"] == (1.0 if cell["position_high"] <= 64 else 0.0)
    assert sum(c["answers"] for c in scored["mqar_by_distance_position"]) == sum(r["answers"] for r in rows.values())
    results = {"label": "early", "train_len": 64, "seed": 0, "eval": {}, **scored}
    lengths = both_rules(results)["relative"]
    assert lengths == {"mqar_past_train_len_accuracy": 64}  # the all-answers accuracy no longer decides
    folder = tmp_path / "run" / "eval"
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps({**results, "data": {"task": "mqar"}, "trained_task": "mqar"}))
    markdown = build_report(find_results([tmp_path]), tmp_path / "report", make_plots=False)
    assert "Accuracy by query–key distance (rows) × the answer's position" in markdown
    assert "| distance ↓ · position → |" in markdown and "mqar_past_train_len_accuracy" in markdown


def test_a_relaunch_reads_settings_introduced_since_as_what_older_runs_did() -> None:
    from posenc.training.sweep import setting_changes

    older = {"data": {"task": "mqar", "task_options": {"num_pairs": 4}}, "optim": {"lr": 1e-3}}
    now = {
        "data": {"task": "mqar", "task_options": {"num_pairs": 4, "kv_offset": "zoology"}},
        "optim": {"lr": 1e-3, "scheme_lr_multiplier": 1.0},
    }
    assert setting_changes(older, now) == []
    now["data"]["task_options"]["kv_offset"] = "random"
    now["optim"]["scheme_lr_multiplier"] = 10.0
    assert setting_changes(older, now) == [
        "data.task_options.kv_offset: 'zoology' -> 'random'",
        "optim.scheme_lr_multiplier: 1.0 -> 10.0",
    ]
