"""Known answers for the extrapolation metrics and the synthetic tasks, from models whose answers are known."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from posenc.evaluate.perplexity import _windows, evaluate_lengths, scored_span
from posenc.evaluate.tasks import (
    IGNORE,
    TaskDataset,
    copy_sample,
    evaluate_copy,
    evaluate_passkey,
    passkey_depth,
    passkey_sample,
)

VOCAB = 257


class Uniform(nn.Module):
    """Equal logits everywhere: perplexity must be exactly the vocabulary size."""

    def __init__(self) -> None:
        super().__init__()
        self.dummy = nn.Parameter(torch.zeros(()))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*tokens.shape, VOCAB) + self.dummy


class Bigram(nn.Module):
    """A fixed random bigram model: context-free, so any window cut must give the same loss per token."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(VOCAB, VOCAB))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table[tokens]


class Counter(nn.Module):
    """Context-dependent: logits depend on the position in the window, so the window cut matters."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.05))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        position = torch.arange(tokens.shape[1], dtype=torch.float32)[None, :, None]
        return (position * self.scale * torch.arange(VOCAB) / VOCAB).expand(tokens.shape[0], -1, -1) + 0 * tokens[
            ..., None
        ]


class Oracle(nn.Module):
    """Predicts every answer token of a passkey/copy sample perfectly, from the input alone."""

    def __init__(self, task: str) -> None:
        super().__init__()
        self.task = task
        self.dummy = nn.Parameter(torch.zeros(()))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*tokens.shape, VOCAB)
        for row, seq in enumerate(tokens.tolist()):
            if self.task == "passkey":
                start = seq.index(ord("#"))
                key = seq[start + 1 : seq.index(ord("#"), start + 1)]
                query = seq.index(ord("?"))
                answer = {query + i: digit for i, digit in enumerate(key)}
            else:
                bar = seq.index(ord("|"))
                n = len(seq) - bar
                text = seq[bar - n : bar]
                answer = {bar + i: text[i] for i in range(n)}
            for position, token in answer.items():
                if position < len(seq):
                    logits[row, position, token] = 10.0
        return logits


def stream(n: int = 5000) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, n).astype(np.uint16)


@pytest.mark.parametrize("mode", ["nonoverlap", "sliding"])
def test_uniform_model_has_vocab_perplexity_at_every_length(mode: str) -> None:
    rows = evaluate_lengths(Uniform(), stream(), [16, 32, 64, 128], mode=mode, stride=8, max_tokens=2048)
    context = 128 - 8 if mode == "sliding" else 0  # what the longest length's windows need before their first score
    for row in rows:
        assert row.ppl == pytest.approx(VOCAB, rel=1e-6)  # fp32 logits
        assert row.tokens == 2048 - context and row.bpb == pytest.approx(math.log2(VOCAB), rel=1e-6)


def test_same_tokens_scored_at_every_length() -> None:
    assert scored_span(5000, [16, 32, 64, 128], 2048) == 2048
    assert scored_span(5000, [16, 48], None) == 4992  # common multiple of the lengths, below available - 1
    with pytest.raises(ValueError, match="too few for one window"):
        scored_span(100, [64, 128], None)
    # A context-free model scores identical tokens identically whatever the window length.
    rows = evaluate_lengths(Bigram(), stream(), [16, 64, 256], max_tokens=2048)
    assert rows[0].loss == pytest.approx(rows[1].loss, rel=1e-12) == pytest.approx(rows[2].loss, rel=1e-12)


def test_sliding_with_stride_equal_to_length_is_nonoverlap() -> None:
    model = Counter()
    for length in (16, 64):
        (sliding,) = evaluate_lengths(model, stream(), [length], mode="sliding", stride=length, max_tokens=2048)
        (disjoint,) = evaluate_lengths(model, stream(), [length], mode="nonoverlap", max_tokens=2048)
        assert sliding.loss == disjoint.loss
        assert sliding.loss_by_position == disjoint.loss_by_position


def _after(model, context: int, length: int = 64) -> float:
    """The disjoint windows' mean loss over targets context+1..2048: what a sliding protocol scores."""
    documents = (np.arange(5000) > context).astype(np.int64)  # owner of target t is documents[t]
    (disjoint,) = evaluate_lengths(model, stream(), [length], max_tokens=2048, documents=documents)
    return disjoint.document_loss[1] / disjoint.document_tokens[1]


def test_sliding_scores_each_token_once_with_more_context() -> None:
    model = Counter()
    (sliding,) = evaluate_lengths(model, stream(), [64], mode="sliding", stride=16, max_tokens=2048)
    (disjoint,) = evaluate_lengths(model, stream(), [64], mode="nonoverlap", max_tokens=2048)
    assert disjoint.tokens == 2048 and sliding.tokens == 2048 - 48  # the first 48 targets are context only
    assert sliding.loss != disjoint.loss  # later positions (more context) are the ones scored


def test_every_sliding_score_at_the_longest_length_sees_its_share_of_context() -> None:
    """At the longest length a stream may hold one window: sliding then still differs from disjoint windows."""
    for stride, length, span in ((1024, 2048, 2048), (1024, 2048, 4096), (48, 64, 2048)):
        context = length - stride
        windows = _windows(span, length, stride, context)
        targets = [t for start, end, first in windows for t in range(start + 1 + first, end + 1)]
        assert targets == list(range(context + 1, span + 1))  # every target after the context, once
        assert min(first + 1 for _, _, first in windows) >= length - stride + 1  # context of its first scored target
    model = Counter()
    one_window = stream(2049)
    (sliding,) = evaluate_lengths(model, one_window, [2048], mode="sliding", stride_fraction=0.5, max_tokens=None)
    (disjoint,) = evaluate_lengths(model, one_window, [2048], mode="nonoverlap", max_tokens=None)
    assert (sliding.tokens, disjoint.tokens) == (1024, 2048) and sliding.loss != disjoint.loss


def test_sliding_with_a_stride_that_does_not_divide_scores_every_target_once() -> None:
    # A context-free model gives each target the same loss however it is windowed: any target scored twice or
    # missed, or a total divided by the wrong count, moves the mean away from the disjoint windows' figure.
    model = Bigram()
    for stride in (24, 40, 7):
        (sliding,) = evaluate_lengths(model, stream(), [64], mode="sliding", stride=stride, max_tokens=2048)
        assert sliding.tokens == 2048 - (64 - stride)
        assert sliding.loss == pytest.approx(_after(model, 64 - stride), rel=1e-12), stride


def test_a_stride_fraction_slides_each_length_by_its_share_and_scores_every_target_once() -> None:
    model = Bigram()
    lengths = [32, 64, 128]
    rows = evaluate_lengths(model, stream(), lengths, mode="sliding", stride_fraction=0.125, max_tokens=2048)
    assert [row.stride for row in rows] == [4, 8, 16] and {row.stride_fraction for row in rows} == {0.125}
    expected = _after(model, 128 - 16)  # the same targets at every length: after the longest one's context
    assert all(row.loss == pytest.approx(expected, rel=1e-12) for row in rows)  # context-free: same loss
    whole = evaluate_lengths(Counter(), stream(), lengths, mode="sliding", stride_fraction=1.0, max_tokens=2048)
    plain = evaluate_lengths(Counter(), stream(), lengths, mode="nonoverlap", max_tokens=2048)
    assert [r.loss for r in whole] == pytest.approx([r.loss for r in plain], rel=1e-12)  # a stride of N is disjoint
    with pytest.raises(ValueError, match="needs one stride"):
        evaluate_lengths(model, stream(), [32], mode="sliding", stride=8, stride_fraction=0.5)


def test_each_documents_loss_is_recorded_and_they_sum_to_the_total() -> None:
    documents = np.repeat(np.arange(5), 1000)  # five documents of 1,000 tokens
    rows = evaluate_lengths(Counter(), stream(), [32, 128], mode="sliding", stride=24, max_tokens=4096,
                            documents=documents)  # fmt: skip
    for row in rows:
        assert len(row.document_loss) == 5  # the targets 1..4096 reach into the fifth document
        assert sum(row.document_loss) == pytest.approx(row.loss * row.tokens, rel=1e-9)
    # worked out target by target for disjoint windows of 32: target t is predicted at position (t − 1) mod 32
    (disjoint,) = evaluate_lengths(Counter(), stream(), [32], max_tokens=4096, documents=documents)
    tokens = torch.from_numpy(stream()[: 4096 + 1].astype(np.int64))
    logits = Counter()(tokens[:-1].reshape(-1, 32)).reshape(4096, VOCAB)
    losses = torch.nn.functional.cross_entropy(logits, tokens[1:], reduction="none").double().detach()
    by_document = np.bincount(documents[1:4097], weights=losses.numpy())
    assert disjoint.document_loss == pytest.approx(by_document.tolist(), rel=1e-6)  # float32 losses, summed apart


def test_the_held_out_sample_takes_a_piece_of_every_document() -> None:
    from posenc.data.heldout import document_bounds, heldout_sample, piece_cap

    eod = 256
    sizes = [5000, 40, 900, 12000, 300]
    split = np.concatenate([np.concatenate([np.full(n, i % 200), [eod]]) for i, n in enumerate(sizes)])
    assert [end - start for start, end in document_bounds(split, eod)] == [n + 1 for n in sizes]
    assert piece_cap(sizes, 40 + 300 + 3 * 700) == 700  # 40 + 300 + 700 · 3 = 2440
    held = heldout_sample(split, 2440 + 5 - 1, "documents", seed=3, eod=eod)
    assert held.sample == "documents" and held.cap == 700
    assert sorted(set(held.documents.tolist())) == [0, 1, 2, 3, 4]  # every document, even the short ones whole
    assert [int((held.documents == i).sum()) for i in range(5)] == [701, 41, 701, 701, 301]
    assert all(set(held.tokens[held.documents == i][:-1].tolist()) == {i % 200} for i in range(5))  # its own text
    assert np.array_equal(held.tokens, heldout_sample(split, 2444, "documents", seed=3, eod=eod).tokens)  # seeded
    assert heldout_sample(split, 1000, "head", eod=eod).tokens.size == 1001
    assert heldout_sample(split, None, eod=eod).sample == "split"
    described = held.describe(2444)  # the targets a full budget scores: every document's piece
    assert described["documents"] == [0, 1, 2, 3, 4] and described["tokens"] == [700, 41, 701, 701, 301]


class ShapeRecorder(nn.Module):
    """Uniform logits, recording every input shape: each new shape is one compilation of a static-shape model."""

    def __init__(self) -> None:
        super().__init__()
        self.dummy = nn.Parameter(torch.zeros(()))
        self.shapes: set[tuple[int, ...]] = set()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.shapes.add(tuple(tokens.shape))
        return torch.zeros(*tokens.shape, VOCAB) + self.dummy


def test_sliding_evaluation_runs_at_most_two_shapes_per_length() -> None:
    # Stride 4 to 16x a length of 16 would be ~1,000 windows; partial windows at the stream's start used to be one
    # shape each, which past dynamo's recompile limit stops a GPU evaluation.
    model = ShapeRecorder()
    lengths = [16 * m for m in (1, 2, 4, 8, 16)]
    rows = evaluate_lengths(
        model, stream(9000), lengths, mode="sliding", stride=4, max_tokens=8192, tokens_per_batch=600
    )
    assert all(row.ppl == pytest.approx(VOCAB, rel=1e-6) for row in rows)
    for length in lengths:
        assert len({shape for shape in model.shapes if shape[1] == length}) <= 2, length
    assert {shape[1] for shape in model.shapes} == set(lengths)


def test_loss_by_position_follows_the_model() -> None:
    (row,) = evaluate_lengths(Counter(), stream(), [32], max_tokens=2048)
    assert len(row.loss_by_position) == 32
    # Counter's logits sharpen with position towards high token ids; random targets make later positions worse.
    assert row.loss_by_position[0] == pytest.approx(math.log(VOCAB), rel=1e-6)
    assert row.loss_by_position[-1] > row.loss_by_position[0]


def test_length_the_model_cannot_handle_is_reported_not_fatal() -> None:
    model = Uniform()
    model.max_positions = 32
    rows = evaluate_lengths(model, stream(), [16, 32, 64], max_tokens=1024)
    assert [r.error is None for r in rows] == [True, True, False]
    assert "max_positions=32" in rows[2].error


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_passkey_places_the_key_at_the_requested_depth(depth: float) -> None:
    sample = passkey_sample(200, depth, np.random.default_rng(1))
    assert sample.inputs.shape == (200,) and sample.targets.shape == (200,)
    assert passkey_depth(sample) == pytest.approx(depth, abs=1 / 180)
    answer = sample.targets[sample.targets != IGNORE]
    assert len(answer) == 5 and all(ord("0") <= t <= ord("9") for t in answer.tolist())
    text = bytes(sample.inputs.tolist()).decode()
    assert text.count("#") == 2 and text.endswith("?" + bytes(answer[:-1].tolist()).decode())


def test_passkey_oracle_scores_perfectly_and_uniform_scores_zero() -> None:
    rows = evaluate_passkey(Oracle("passkey"), [64, 256], [0.0, 0.5, 1.0], samples=6, seed=0)
    assert len(rows) == 6 and all(row["accuracy"] == 1.0 for row in rows)
    rows = evaluate_passkey(Uniform(), [64], [0.5], samples=6, seed=0)
    assert rows[0]["accuracy"] < 1.0


def test_copy_oracle_scores_perfectly() -> None:
    rows = evaluate_copy(Oracle("copy"), [64, 129], samples=5, seed=0)
    assert all(row["accuracy"] == 1.0 and row["token_accuracy"] == 1.0 for row in rows)
    sample = copy_sample(64, np.random.default_rng(0))
    scored = sample.targets[sample.targets != IGNORE]
    assert len(scored) == 32


def test_task_dataset_is_seeded() -> None:
    a, b = TaskDataset("passkey", 64, 10, seed=1), TaskDataset("passkey", 64, 10, seed=2)
    assert torch.equal(a[3][0], TaskDataset("passkey", 64, 10, seed=1)[3][0])
    assert not torch.equal(a[3][0], b[3][0])
    with pytest.raises(ValueError, match="unknown task 'sort'"):
        TaskDataset("sort", 64, 1, seed=0)
