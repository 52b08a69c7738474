"""Retrieval tasks (multikey, vartrack; MQAR: test_mqar.py): what each sample asks and answers, scoring, the report."""

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
from posenc.data.retrieval import (
    RETRIEVAL_TASKS,
    RetrievalDataset,
    chance_rates,
    keyless_rates,
    task_dataset,
)
from posenc.evaluate.outputs import keyless_reference
from posenc.evaluate.retrieval import answer_spans, evaluate_retrieval
from posenc.evaluate.runner import summary_metrics
from posenc.evaluate.tasks import IGNORE, TaskDataset
from posenc.report import build_report, find_results
from posenc.train import train

VOCAB = 257
TASKS = list(RETRIEVAL_TASKS)
TEXT_TASKS = ["multikey", "vartrack"]  # byte strings a test can read as text (MQAR's keys and values are any byte)


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
        *needles, question = re.findall(r"([A-Z])(\d)", text)
        assert len({key for key, _ in needles}) == len(needles)  # every needle's key appears once before it is asked
        return dict(needles)[question[0]]
    if task == "vartrack":
        value = re.search(r"\?(\d{3}):[A-Z]+$", text).group(1)
        held = {}
        for name, source in re.findall(r"#([A-Z])=(\d{3}|[A-Z])#", text):
            held[name] = held.get(source, source)
        order = [name for name, _ in re.findall(r"#([A-Z])=(\d{3}|[A-Z])#", text)]
        return "".join(name for name in order if held[name] == value)
    raise ValueError(task)


@pytest.mark.parametrize("length", [64, 257, 1024])
@pytest.mark.parametrize("task", TEXT_TASKS)
def test_every_sample_answers_its_question_and_only_the_answer_is_scored(task: str, length: int) -> None:
    for seed in range(20):
        text, answer, positions = text_and_answer(task, length, seed)
        assert answer == expected_answer(task, text)
        assert positions[-1] == length  # the window ends with the (last) answer


def test_multikey_needles_sit_at_any_depth_and_the_question_comes_last() -> None:
    depths = []
    for seed in range(30):
        text, _, _ = text_and_answer("multikey", 512, seed)
        needles = [m.start() for m in re.finditer(r"[A-Z]\d", text)][:-1]
        assert len(needles) == 4 and re.fullmatch(r"[a-z0-9]*", re.sub(r"[A-Z]\d", "", text[:-2]))
        depths += [at / len(text) for at in needles]
    assert min(depths) < 0.1 and max(depths) > 0.9  # RULER's depth: anywhere in the filler


def test_multikey_training_windows_ask_only_needles_placed_before_each_question() -> None:
    repeated = 0
    for seed in range(30):
        sample = RETRIEVAL_TASKS["multikey"](64, np.random.default_rng(seed), num_keys=4, train_queries=12)
        scored = (sample.targets != IGNORE).nonzero().flatten().tolist()
        text = bytes(sample.inputs.tolist()).decode()
        items = [(m.start(), m.group(1), m.group(2)) for m in re.finditer(r"([A-Z])(\d)", text + "?")]
        needles: dict[str, str] = {}
        questions = []
        for at, key, value in items:
            if key in needles:
                assert value == needles[key]
                questions.append(at)
            else:
                needles[key] = value
        last = int(sample.targets[-1])
        if last != IGNORE:  # the window ends on a question's value: the key is the last input byte
            assert text[-1] in needles and chr(last) == needles[text[-1]]
            questions.append(len(text) - 1)
        elif text[-1].isupper():  # ... or on a needle's value, which is no input and no target
            needles[text[-1]] = "?"
        assert len(needles) == 4 and len(questions) == 12  # four needles, twelve questions, each after its needle
        assert scored == [q for q in questions]  # only the questions' values are scored (target i is byte i + 1)
        repeated += len({text[q] for q in questions}) < 12
    assert repeated == 30


def test_task_options_reach_the_dataset_and_are_checked() -> None:
    dataset = TaskDataModule("mqar", seq_len=64, batch_size=2, num_samples=2, task_options={"num_pairs": 3})
    _, targets = next(iter(dataset.train_dataloader()))
    assert int((targets != IGNORE).sum()) == 2 * 3
    with pytest.raises(ValueError, match="do not fit mqar"):
        task_dataset("mqar", 64, 2, 0, options={"num_keys": 3})
    with pytest.raises(ValueError, match="task_options are for the retrieval tasks"):
        task_dataset("passkey", 64, 2, 0, options={"num_pairs": 3})
    assert chance_rates("multikey", {"value_len": 3}) == pytest.approx((0.1, 0.001))
    assert chance_rates("multikey") == pytest.approx((0.1, 0.1))  # one digit by default


@pytest.mark.parametrize(
    ("task", "options", "first", "exact"),
    [
        # four needles, one asked: the commonest of four one-digit values, E[highest multiplicity] / 4 = 0.3835
        # (enumerated over all 10^4 value tuples), whatever the filler
        ("multikey", {"num_keys": 4}, 0.3835, 0.3835),
        # four-digit values almost never agree (one in four), but their first digits do as often as above
        ("multikey", {"num_keys": 4, "value_len": 4}, 0.3835, 0.25),
        # two chains: one in two, first variables included (every variable name is distinct)
        ("vartrack", {"num_chains": 2}, 0.5, 0.5),
    ],
)
def test_keyless_rates_are_the_best_guess_blind_to_keys(task: str, options: dict, first, exact) -> None:
    rates = keyless_rates(task, options)
    got_first, got_exact = rates["keyless_first_byte"], rates["keyless_exact"]
    assert got_exact == pytest.approx(exact, abs=0.02)
    assert got_first == pytest.approx(first, abs=0.02)
    assert got_first >= got_exact and got_exact > chance_rates(task, options)[1]
    # one question a window: nothing to eliminate; training-only options change nothing
    assert rates["keyless_exact_elimination"] == got_exact
    assert keyless_rates(task, {**options, "train_queries": 9}) == rates


def test_the_elimination_floor_strikes_out_answers_already_given() -> None:
    # four needles, all four asked: a guess among the values left: (1/4 + 1/3 + 1/2 + 1) / 4 = 25/48 when the
    # four values differ, more when some agree; without elimination the commonest of the four every time
    rates = keyless_rates("multikey", {"num_keys": 4, "num_queries": 4})
    assert rates["keyless_exact"] == pytest.approx(0.3835, abs=0.02)
    assert rates["keyless_exact_elimination"] > 25 / 48 > rates["keyless_exact"]


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
    """Knows the targets of the given samples: right on every answer byte, or on the first ``right`` of each answer."""

    def __init__(
        self, task: str, lengths: list[int], samples: int, seed: int, right: int | None = None, **options
    ) -> None:
        super().__init__()
        self.dummy = nn.Parameter(torch.zeros(()))
        self.targets = {}
        for length in lengths:
            rng = np.random.default_rng([seed, length, TASKS.index(task)])  # as evaluate_retrieval draws them
            for _ in range(samples):
                sample = RETRIEVAL_TASKS[task](length, rng, **options)
                self.targets[tuple(sample.inputs.tolist())] = sample.targets
        self.right = right

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*tokens.shape, VOCAB)
        for row, seq in enumerate(tokens.tolist()):
            targets = self.targets[tuple(seq)]
            for start, end in answer_spans(targets):
                for position in range(start, end if self.right is None else min(end, start + self.right)):
                    logits[row, position, targets[position]] = 10.0
        return logits


@pytest.mark.parametrize(
    ("task", "options"), [("multikey", {"value_len": 4}), ("vartrack", {}), ("multikey", {"num_queries": 3})]
)
def test_scoring_counts_an_answer_only_when_every_byte_is_right(task: str, options: dict) -> None:
    perfect = evaluate_retrieval(Lookup(task, [64, 128], 6, 0, **options), task, [64, 128], 6, 0, options=options)
    assert [(r["length"], r["accuracy"], r["first_byte_accuracy"], r["token_accuracy"]) for r in perfect] == [
        (64, 1.0, 1.0, 1.0),
        (128, 1.0, 1.0, 1.0),
    ]
    first_only = evaluate_retrieval(Lookup(task, [64], 6, 0, right=1, **options), task, [64], 6, 0, options=options)[0]
    answer_len = {"multikey": options.get("value_len", 1), "vartrack": 3}[task]
    if answer_len > 1:
        assert first_only["accuracy"] == 0.0 and first_only["first_byte_accuracy"] == 1.0
        assert first_only["token_accuracy"] == pytest.approx(1 / answer_len)
    assert first_only["answers"] == 6 * options.get("num_queries", 1)  # every question is an answer
    assert first_only["chance_first_byte"] == pytest.approx(1 / 26 if task == "vartrack" else 0.1)
    assert 0.0 <= first_only["low"] <= first_only["accuracy"] <= first_only["high"] <= 1.0  # Wilson
    assert first_only.items() >= keyless_rates(task, options).items()  # every row carries every floor


def test_accuracy_plots_draw_the_keyless_floor_where_recorded() -> None:
    rows = [{"length": 64, "accuracy": 0.5, "keyless_exact": 0.46}, {"length": 128, "accuracy": 0.4}]
    assert keyless_reference(rows) == {"keyless floor": 0.46}
    rows[0]["keyless_exact_elimination"] = 0.6
    assert keyless_reference(rows) == {"keyless floor": 0.46, "with elimination": 0.6}
    assert keyless_reference([{"length": 64, "accuracy": 1.0}]) == {}  # passkey, copy, older results: no line


def test_answer_spans_split_runs_of_scored_bytes() -> None:
    targets = torch.tensor([IGNORE, 5, IGNORE, 6, 7, IGNORE, 8])
    assert answer_spans(targets) == [(1, 2), (3, 5), (6, 7)]


def test_retrieval_training_is_scored_on_its_task_with_attention_statistics(tmp_path: Path) -> None:
    overrides = [*FAST, "data.seq_len=48", "eval.multikey.multiples=[1,2]", "eval.multikey.samples=4"]
    summary = train(
        compose_train("+encoding=alibi", "data=multikey", *overrides, "eval.attention_stats=true"), tmp_path
    )
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert "perplexity" not in results and "passkey" not in results
    # the in-length accuracy of every validation, kept for the report's learning curves
    assert [point["step"] for point in summary["val_curve"]] == [3] and 0 <= summary["val_curve"][0]["accuracy"] <= 1
    assert [row["length"] for row in results["multikey"]] == [48, 96]
    assert {"multikey_acc@1x", "multikey_acc@2x", "attn_sink@4x", "attn_distance@1x"} <= set(summary["eval"])
    assert len(results["attention_stats"]) == 3 * 4 * 4  # lengths × layers × heads of the tiny model
    assert (tmp_path / "eval" / "multikey.csv").exists() and (tmp_path / "eval" / "attention_stats.csv").exists()
    markdown = build_report(find_results([tmp_path]), tmp_path / "report")
    assert "## multikey accuracy, trained at L=48" in markdown
    assert "## Attention: sink by length, trained at L=48 on multikey" in markdown
    assert (tmp_path / "report" / "attention_sink_L48_multikey.png").exists()


def test_summary_has_exact_match_and_first_byte_by_length() -> None:
    rows = [
        {"task": "multikey", "length": n, "accuracy": a, "first_byte_accuracy": f, "token_accuracy": f}
        for n, a, f in [(64, 0.9, 0.95), (128, 0.4, 0.5)]
    ]
    summary = summary_metrics({"train_len": 64, "multikey": rows})
    assert summary["multikey_acc@1x"] == 0.9 and summary["multikey_first_byte@2x"] == 0.5


def test_task_options_from_the_data_config_reach_training() -> None:
    from posenc.runs.checkpoints import build_datamodule

    config = compose_train("+encoding=alibi", "data=mqar", "data.task_options.num_pairs=4")
    datamodule = build_datamodule(config, num_samples=8)
    assert datamodule.task_options["num_pairs"] == 4 and datamodule.describe()["task_options"]["num_pairs"] == 4


def test_answer_counts_count_whole_answers() -> None:
    from posenc.evaluate.curve import answer_counts

    targets = torch.tensor([[IGNORE, 5, 6, IGNORE, 7], [8, IGNORE, IGNORE, 9, 9]])  # answers: [5 6], [7]; [8], [9 9]
    logits = torch.zeros(2, 5, VOCAB)
    for row, position, token in [(0, 1, 5), (0, 2, 1), (0, 4, 7), (1, 0, 8), (1, 3, 9), (1, 4, 9)]:
        logits[row, position, token] = 1.0  # the first answer has its second byte wrong
    assert answer_counts(logits, targets) == (3, 4)
    assert answer_counts(logits, torch.full((1, 5), IGNORE)) == (0, 0)
