"""The comparisons fixed in advance: every column against each reference, the crossed estimator's words from two
Holm families over the whole section (its coverage and error rates: tests/test_crossed.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from posenc.report import build_report, find_results
from posenc.report.preset import pairs, reference_columns


def _run(root: Path, label: str, seed: int, scale: float, rng: np.random.Generator, windows: list[int]) -> None:
    """A text run at L=32 (lengths 32, 64) with its loss per document, and an MQAR run with its windows."""
    tokens = [1000, 3000, 500, 5500]
    rows = []
    for length in (32, 64):
        # Noise small enough that four seeds × four documents (three df each, honestly few) show equivalence
        per_doc = [t * (2.0 + math.log(scale) + rng.normal(0, 0.0005)) for t in tokens]
        loss = sum(per_doc) / sum(tokens)
        rows.append(
            {"length": length, "mode": "nonoverlap", "stride": None, "tokens": sum(tokens), "loss": loss,
             "ppl": math.exp(loss), "bpb": 1.0, "error": None, "multiple": length / 32, "ratio": 1.0,
             "document_loss": per_doc}
        )  # fmt: skip
    text = {"label": label, "train_len": 32, "seed": seed, "eval": {"mode": "nonoverlap"}, "perplexity": rows}
    text["documents"] = {"sample": "documents", "documents": [0, 1, 2, 3], "tokens": tokens}
    mqar = {"label": label, "train_len": 64, "seed": seed, "eval": {}, "data": {"task": "mqar"}}
    accuracy = sum(windows) / (4 * len(windows))
    mqar["mqar"] = [{"length": 128, "accuracy": accuracy, "answers": 4 * len(windows), "low": 0, "high": 1}]
    mqar["mqar_windows"] = [{"length": 128, "answers_per_window": 4, "right": windows}]
    for name, result in (("text", text), ("mqar", mqar)):
        folder = root / f"{label}_{name}_{seed}" / "eval"
        folder.mkdir(parents=True)
        (folder / "results.json").write_text(json.dumps(result))


def test_every_column_is_compared_with_each_reference_as_one_family(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    for seed in range(4):
        right = rng.integers(0, 5, 64).tolist()
        _run(tmp_path, "alibi", seed, 1.0, rng, right)
        _run(tmp_path, "nope", seed, 1.0, rng, [min(4, r + int(rng.integers(0, 2))) for r in right])
        _run(tmp_path, "t5", seed, 1.5, rng, [0] * 64)  # perplexity 1.5 times ALiBi's, recall none
    markdown = build_report(find_results([tmp_path]), tmp_path / "report", make_plots=False)
    section = markdown.split("## Comparisons fixed in advance")[1]
    # t5 and nope against alibi, t5 against nope: 3 pairs × 2 lengths of perplexity + 3 pairs × 1 length of recall
    assert "The 9 tests are two families" in section
    ratio_table = section.split("Perplexity, trained at L=32 — nonoverlapping windows: perplexity ratio to alibi")[1]
    row = next(line for line in ratio_table.splitlines() if line.startswith("| 64 |"))
    nope_cell, t5_cell = row.split("|")[3], row.split("|")[4]
    ratio, low, high = (float(x) for x in t5_cell.replace("[", " ").replace("]", " ").replace(",", " ").split()[:3])
    assert ratio == pytest.approx(1.5, abs=0.01) and low < 1.5 < high and "✓" in t5_cell and "(n=4;" in t5_cell
    assert nope_cell.strip().startswith("1.00") and " = " in nope_cell  # equal within ±1%: equivalent, a test's word
    assert "detects ±" in nope_cell
    recall = section.split("MQAR recall, trained at L=64: accuracy minus that of alibi")[1]
    t5_recall = next(line for line in recall.splitlines() if line.startswith("| 128 |")).split("|")[4]
    assert t5_recall.strip().startswith("-0.") and "✓" in t5_recall
    by_label = {"alibi": [], "nope": [], "t5 · lr=0.1": []}
    assert reference_columns(by_label, ["alibi", "t5", "rope"]) == ["alibi", "t5 · lr=0.1"]
    assert pairs(by_label, ["alibi", "nope"]) == [("nope", "alibi"), ("t5 · lr=0.1", "alibi"), ("t5 · lr=0.1", "nope")]
    custom = build_report(find_results([tmp_path]), tmp_path / "other", make_plots=False, references=["t5"])
    assert "The 6 tests are two families" in custom


def test_a_setting_is_compared_within_each_scheme() -> None:
    # "* · sink=none": each column against its own scheme's column of that setting, never across schemes.
    by_label = {name: [] for name in ("alibi · sink=learned", "alibi · sink=none", "rope · sink=none",
                                      "rope · sink=tokens", "nope · sink=learned")}  # fmt: skip
    assert pairs(by_label, ["* · sink=none"]) == [
        ("alibi · sink=learned", "alibi · sink=none"),
        ("rope · sink=tokens", "rope · sink=none"),
    ]
