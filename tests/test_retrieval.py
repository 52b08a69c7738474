"""Retrieval tasks (multikey, vartrack, assoc): what each sample asks and answers, scoring, training, the report."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import FAST, compose_train
from torch import nn

from posenc.data.datamodule import TaskDataModule
from posenc.data.retrieval import RETRIEVAL_TASKS, RetrievalDataset, task_dataset
from posenc.evaluate.retrieval import evaluate_retrieval
from posenc.evaluate.tasks import IGNORE, TaskDataset
from posenc.report import build_report, find_results
from posenc.train import train

VOCAB = 257
TASKS = list(RETRIEVAL_TASKS)


def text_and_answer(task: str, length: int, seed: int) -> tuple[str, str, list[int]]:
    """The whole sample as text, its scored answer bytes, and their positions in the text."""
    sample = RETRIEVAL_TASKS[task](length, np.random.default_rng(seed))
    assert sample.inputs.shape == sample.targets.shape == (length,)
    text = bytes([*sample.inputs.tolist(), int(sample.targets[-1])]).decode()
    scored = (sample.targets != IGNORE).nonzero().flatten().tolist()
    return text, "".join(text[i + 1] for i in scored), [i + 1 for i in scored]


def expected_answer(task: str, text: str) -> str:
    """The right answer, worked out from the facts in the text (not from the generator)."""
    if task == "multikey":
        needles = dict(re.findall(r"#([A-Z]{2})=(\d{4})#", text))
        return needles[re.search(r"\?([A-Z]{2})=\d{4}$", text).group(1)]
    if task == "vartrack":
        value = re.search(r"\?(\d{3}):[A-Z]+$", text).group(1)
        held = {}
        for name, source in re.findall(r"#([A-Z])=(\d{3}|[A-Z])#", text):
            held[name] = held.get(source, source)
        order = [name for name, _ in re.findall(r"#([A-Z])=(\d{3}|[A-Z])#", text)]
        return "".join(name for name in order if held[name] == value)
    pairs = dict(re.findall(r"([a-z]{2}):(\d{2}),", text))
    return "".join(pairs[key] for key in re.findall(r"\?([a-z]{2}):\d{2}", text))


@pytest.mark.parametrize("length", [64, 257, 1024])
@pytest.mark.parametrize("task", TASKS)
def test_every_sample_answers_its_question_and_only_the_answer_is_scored(task: str, length: int) -> None:
    for seed in range(20):
        text, answer, positions = text_and_answer(task, length, seed)
        assert answer == expected_answer(task, text)
        assert positions[-1] == length  # the window ends with the (last) answer


def test_facts_scale_with_the_window_and_keys_are_distinct() -> None:
    short, _, _ = text_and_answer("assoc", 64, 0)
    long, _, _ = text_and_answer("assoc", 1024, 0)
    assert len(re.findall(r"[a-z]{2}:\d{2},", long)) > 10 * len(re.findall(r"[a-z]{2}:\d{2},", short)) // 2
    keys = re.findall(r"([a-z]{2}):\d{2},", long)
    assert len(keys) == len(set(keys))
    text, _, _ = text_and_answer("multikey", 512, 3)
    assert len(set(re.findall(r"#([A-Z]{2})=", text))) == 4


@pytest.mark.parametrize("task", TASKS)
def test_too_short_a_window_fails_clearly(task: str) -> None:
    with pytest.raises(ValueError, match=f"{task} needs length ≥"):
        RETRIEVAL_TASKS[task](8, np.random.default_rng(0))


@pytest.mark.parametrize("task", TASKS)
def test_datasets_are_seeded_and_dispatched(task: str) -> None:
    first, again = RetrievalDataset(task, 64, 4, seed=7), RetrievalDataset(task, 64, 4, seed=7)
    assert all(torch.equal(first[i][0], again[i][0]) for i in range(4))
    assert not torch.equal(first[0][0], RetrievalDataset(task, 64, 4, seed=8)[0][0])
    assert isinstance(task_dataset(task, 64, 2, 0), RetrievalDataset)
    assert isinstance(task_dataset("passkey", 64, 2, 0), TaskDataset)
    inputs, targets = next(iter(TaskDataModule(task, seq_len=64, batch_size=3, num_samples=6).train_dataloader()))
    assert inputs.shape == targets.shape == (3, 64) and (targets != IGNORE).any()


class Lookup(nn.Module):
    """Knows the targets of the given samples: right on every answer byte, or on the first ``right`` of each sample."""

    def __init__(self, task: str, lengths: list[int], samples: int, seed: int, right: int | None = None) -> None:
        super().__init__()
        self.dummy = nn.Parameter(torch.zeros(()))
        self.targets = {}
        for length in lengths:
            rng = np.random.default_rng([seed, length, TASKS.index(task)])  # as evaluate_retrieval draws them
            for _ in range(samples):
                sample = RETRIEVAL_TASKS[task](length, rng)
                self.targets[tuple(sample.inputs.tolist())] = sample.targets
        self.right = right

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*tokens.shape, VOCAB)
        for row, seq in enumerate(tokens.tolist()):
            targets = self.targets[tuple(seq)]
            scored = (targets != IGNORE).nonzero().flatten().tolist()
            for position in scored[: self.right]:
                logits[row, position, targets[position]] = 10.0
        return logits


@pytest.mark.parametrize("task", TASKS)
def test_scoring_counts_a_sample_only_when_every_answer_byte_is_right(task: str) -> None:
    perfect = evaluate_retrieval(Lookup(task, [64, 128], 6, seed=0), task, [64, 128], samples=6, seed=0)
    assert [(r["length"], r["accuracy"], r["token_accuracy"]) for r in perfect] == [(64, 1.0, 1.0), (128, 1.0, 1.0)]
    first_only = evaluate_retrieval(Lookup(task, [64], 6, seed=0, right=1), task, [64], samples=6, seed=0)[0]
    answer_len = len(text_and_answer(task, 64, 0)[1])
    assert first_only["accuracy"] == 0.0 and first_only["token_accuracy"] == pytest.approx(1 / answer_len)


def test_retrieval_training_is_scored_on_its_task_with_attention_statistics(tmp_path: Path) -> None:
    overrides = [*FAST, "data.seq_len=48", "eval.multikey.multiples=[1,2]", "eval.multikey.samples=4"]
    summary = train(
        compose_train("+encoding=alibi", "data=multikey", *overrides, "eval.attention_stats=true"), tmp_path
    )
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert "perplexity" not in results and "passkey" not in results
    assert [row["length"] for row in results["multikey"]] == [48, 96]
    assert {"multikey_acc@1x", "multikey_acc@2x", "attn_sink@4x", "attn_distance@1x"} <= set(summary["eval"])
    assert len(results["attention_stats"]) == 3 * 4 * 4  # lengths × layers × heads of the tiny model
    assert (tmp_path / "eval" / "multikey.csv").exists() and (tmp_path / "eval" / "attention_stats.csv").exists()
    markdown = build_report(find_results([tmp_path]), tmp_path / "report")
    assert "## multikey accuracy, trained at L=48" in markdown
    assert "## Attention: sink by length, trained at L=48 on multikey" in markdown
    assert (tmp_path / "report" / "attention_sink_L48_multikey.png").exists()
