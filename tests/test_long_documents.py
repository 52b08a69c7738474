"""Evaluation documents as long as the longest window: eval.sample=long_documents on a synthetic corpus."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from posenc.data.heldout import document_bounds, long_documents_sample
from posenc.data.tokenizer import ByteTokenizer
from posenc.evaluate.heldout import heldout_perplexity
from posenc.evaluate.outputs import print_results
from posenc.evaluate.perplexity import evaluate_lengths
from posenc.model import Decoder

SIZES = [10, 300, 50, 700, 129, 64]  # contents in tokens; a window of 128 needs 129 (300, 700 and 129 have them)
LENGTHS = [16, 32, 64, 128]


def corpus(sizes: list[int] = SIZES) -> np.ndarray:
    """Documents of random bytes, each followed by the end-of-document token, as a corpus split is stored."""
    rng = np.random.default_rng(0)
    parts = [np.append(rng.integers(0, 256, size), ByteTokenizer.eod) for size in sizes]
    return np.concatenate(parts).astype(np.int64)


def test_pieces_are_whole_longest_windows_inside_the_documents_that_hold_one() -> None:
    stream = corpus()
    held = long_documents_sample(stream, LENGTHS, max_tokens=None, seed=1)
    bounds = document_bounds(stream)
    assert held.qualifying == {16: 5, 32: 5, 64: 3, 128: 3} and held.split_documents == 6
    owners = [int(held.documents[start]) for start, _ in held.pieces]
    assert owners == [1, 3, 4]
    for (start, end), owner in zip(held.pieces, owners, strict=True):
        piece = held.tokens[start:end]
        assert (end - start - 1) % 128 == 0 and (held.documents[start:end] == owner).all()
        assert ByteTokenizer.eod not in piece  # never the end of its document, nor the next one
        document = stream[bounds[owner][0] : bounds[owner][1]]
        offsets = [i for i in range(len(document) - len(piece) + 1) if (document[i : i + len(piece)] == piece).all()]
        assert offsets  # a contiguous run of the document's own tokens
    assert [end - start for start, end in held.pieces] == [257, 641, 129]  # every whole window each holds
    capped = long_documents_sample(stream, LENGTHS, max_tokens=3 * 128, seed=1)
    assert [end - start for start, end in capped.pieces] == [129, 129, 129]  # one window each fills the budget
    fewer = long_documents_sample(stream, LENGTHS, max_tokens=2 * 128, seed=1)
    assert [end - start for start, end in fewer.pieces] == [129, 129]  # two of the three documents, one window each
    assert len({int(fewer.documents[start]) for start, _ in fewer.pieces}) == 2
    record = held.describe(sum(end - start - 1 for start, end in held.pieces))
    assert record["documents"] == [1, 3, 4] and record["tokens"] == [256, 640, 128]
    assert record["qualifying"] == {"16": 5, "32": 5, "64": 3, "128": 3} and record["too_short"] == 3


def test_every_length_scores_the_same_targets_each_document_on_its_own(capsys: pytest.CaptureFixture) -> None:
    torch.manual_seed(0)
    model = Decoder("alibi", vocab_size=257, dim=16, depth=1, heads=2).eval()
    stream = corpus()
    eval_cfg = {"sample": "long_documents", "mode": "nonoverlap", "max_tokens": None, "seed": 1, "split": "test"}
    rows, record = heldout_perplexity(model, stream, [*LENGTHS, 1024], eval_cfg, tokens_per_batch=4096)
    by_length = {row.length: row for row in rows}
    assert by_length[1024].error == "no document of the test split holds a window of 1024 tokens"
    assert {row.tokens for row in rows if not row.error} == {1024}  # 256 + 640 + 128 targets at every length
    held = long_documents_sample(stream, LENGTHS, None, seed=1)
    pieces = [evaluate_lengths(model, held.tokens[s:e], LENGTHS, max_tokens=None) for s, e in held.pieces]
    for index, length in enumerate(LENGTHS):
        expected = sum(part[index].loss * part[index].tokens for part in pieces) / 1024
        assert by_length[length].loss == pytest.approx(expected, rel=1e-9)
        assert sum(by_length[length].document_loss) == pytest.approx(expected * 1024, rel=1e-9)
        assert len(by_length[length].loss_by_position) == length
    assert record["qualifying"]["1024"] == 0 and record["too_short"] == 6
    results = {
        "label": "alibi",
        "train_len": 16,
        "eval": {"split": "test"},
        "documents": record,
        "perplexity": [r.as_dict() | {"multiple": r.length / 16, "ratio": 1.0} for r in rows],
        "summary": {},
    }
    print_results(results)
    printed = capsys.readouterr().out
    assert "documents of the split that hold a window of each length: 16: 5, 32: 5, 64: 3, 128: 3, 1024: 0" in printed
    assert "6 of 6 are too short for the longest" in printed


def test_a_split_without_long_documents_says_so_at_every_length() -> None:
    model = Decoder("nope", vocab_size=257, dim=16, depth=1, heads=2).eval()
    eval_cfg = {"sample": "long_documents", "mode": "nonoverlap", "max_tokens": 512, "seed": 0, "split": "test"}
    rows, record = heldout_perplexity(model, corpus([10, 12]), [16, 32], eval_cfg, tokens_per_batch=4096)
    assert [row.error for row in rows] == [
        f"no document of the test split holds a window of {n} tokens" for n in (16, 32)
    ]
    assert record["documents"] == [] and record["too_short"] == 2
    assert all(math.isnan(row.loss) for row in rows)
