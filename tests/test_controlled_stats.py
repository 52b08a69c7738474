"""Statistics with power: the crossed bootstraps of perplexity and recall on data with known answers, and the
comparisons fixed in advance (every column against each reference, Holm over the whole family)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from posenc.evaluate.bootstrap import crossed_difference, crossed_log_ratio
from posenc.report import build_report, find_results
from posenc.report.preset import pairs, reference_columns

DOCUMENTS = 30


def _perplexity_data(
    rng: np.random.Generator, delta: float, seed_sd: float, doc_sd: float, shared_sd: float = 0.0, seeds: int = 5
):
    """(a, b, tokens): summed losses per seed and document, a's loss per token higher than b's by ``delta``.

    The difference has a seed effect (``seed_sd``), noise per seed and document (``doc_sd``) and a document effect
    shared by every seed (``shared_sd``: a document one scheme models better whatever the seed), drawn afresh in every
    trial: the documents are a sample, and ``delta`` is the difference over the population they are drawn from.
    """
    tokens = rng.integers(200, 2000, DOCUMENTS).astype(float)
    base = rng.normal(2.0, 0.3, DOCUMENTS)
    shared = rng.normal(0, shared_sd, DOCUMENTS)
    a = base + delta + shared + rng.normal(0, seed_sd, (seeds, 1)) + rng.normal(0, doc_sd, (seeds, DOCUMENTS))
    b = base + rng.normal(0, seed_sd, (seeds, 1)) + rng.normal(0, doc_sd, (seeds, DOCUMENTS))
    return a * tokens, b * tokens, tokens


def _nested_log_ratio(a, b, tokens, rng, resamples: int = 500) -> float:
    """The standard error a nested bootstrap (documents drawn anew within each seed) gives: the design it replaced."""
    seeds, documents = a.shape
    drawn = rng.integers(0, seeds, size=(resamples, seeds))
    counts = rng.multinomial(documents, np.full(documents, 1 / documents), size=(resamples, seeds))
    per_seed = np.einsum("rsd,rsd->rs", counts, (a - b)[drawn]) / (counts @ tokens)
    return float(np.std(per_seed.mean(axis=1), ddof=1)) * math.sqrt(seeds / (seeds - 1))


@pytest.mark.parametrize(("seed_sd", "doc_sd", "shared_sd"), [(0.1, 0.05, 0.0), (0.0, 0.1, 0.0), (0.0, 0.02, 0.15)])
def test_the_crossed_interval_covers_a_known_difference_at_five_seeds(seed_sd, doc_sd, shared_sd) -> None:
    """A simulation of the design every comparison has: 5 seeds crossed with the same documents."""
    rng, trials = np.random.default_rng(1), 150
    covered, ratios = 0, []
    for trial in range(trials):
        a, b, tokens = _perplexity_data(rng, 0.05, seed_sd, doc_sd, shared_sd)
        result = crossed_log_ratio(a, b, tokens, seed=trial, resamples=500)
        covered += result.low <= 0.05 <= result.high
        ratios.append(_nested_log_ratio(a, b, tokens, rng) / _error(result))
    assert 0.88 <= covered / trials <= 1.0  # 95% nominal
    if shared_sd:  # documents shared by the seeds dominate: drawing them within each seed understates the error
        assert np.mean(ratios) < 0.6  # about 1/√5: each seed's draw averages the shared effect down


def _error(result) -> float:
    """The standard error behind an interval (its half-width over Student's t at seeds − 1 degrees of freedom)."""
    from scipy import stats

    return (result.high - result.low) / 2 / stats.t.ppf(0.975, result.seeds - 1)


def test_the_interval_widens_with_seed_variance_and_a_clear_difference_is_significant() -> None:
    rng = np.random.default_rng(2)
    noise = rng.normal(0, 0.05, (2, 5, DOCUMENTS))
    tokens = np.full(DOCUMENTS, 500.0)
    widths = []
    for seed_sd in (0.01, 0.1):
        offsets = np.linspace(-2, 2, 5)[:, None] * seed_sd  # the same seed pattern, scaled
        a = (2.2 + offsets + noise[0]) * tokens
        b = (2.0 - offsets + noise[1]) * tokens
        result = crossed_log_ratio(a, b, tokens)
        assert result.estimate == pytest.approx(0.2 + noise[0].mean() - noise[1].mean())
        widths.append(result.high - result.low)
        if seed_sd == 0.01:
            assert result.p_value < 1e-3 and result.low > 0
    assert widths[1] > 5 * widths[0]
    one_seed = crossed_log_ratio(a[:1], b[:1], tokens)  # documents only: a t on the documents' count
    assert one_seed.low < one_seed.estimate < one_seed.high and one_seed.seeds == 1
    with pytest.raises(ValueError, match="seeds, documents"):
        crossed_log_ratio(a, b[:, :3], tokens)


def _recall_data(rng: np.random.Generator, delta: float, seed_sd: float, seeds: int = 5, windows: int = 128):
    """Per-window accuracy of two schemes on the same windows: every answer of a window right or wrong together."""
    difficulty = rng.uniform(0.2, 0.7, windows)
    shift_a, shift_b = rng.normal(0, seed_sd, (seeds, 1)), rng.normal(0, seed_sd, (seeds, 1))
    a = (rng.random((seeds, windows)) < difficulty + delta + shift_a).astype(float)
    b = (rng.random((seeds, windows)) < difficulty + shift_b).astype(float)
    return a, b


def test_the_crossed_interval_covers_a_known_recall_difference_and_widens_with_seeds() -> None:
    rng, trials, covered = np.random.default_rng(3), 150, 0
    for trial in range(trials):
        a, b = _recall_data(rng, 0.2, 0.05)
        result = crossed_difference(a, b, seed=trial, resamples=500)
        covered += result.low <= 0.2 <= result.high
    assert 0.88 <= covered / trials <= 1.0
    narrow, wide = (crossed_difference(*_recall_data(rng, 0.2, sd)) for sd in (0.0, 0.15))
    assert wide.high - wide.low > 1.5 * (narrow.high - narrow.low)
    with pytest.raises(ValueError, match="seeds, windows"):
        crossed_difference(np.zeros((2, 3)), np.zeros((2, 4)))


def _run(root: Path, label: str, seed: int, scale: float, rng: np.random.Generator, windows: list[int]) -> None:
    """A text run at L=32 (lengths 32, 64) with its loss per document, and an MQAR run with its windows."""
    tokens = [1000, 3000, 500, 5500]
    rows = []
    for length in (32, 64):
        per_doc = [t * (2.0 + math.log(scale) + rng.normal(0, 0.002)) for t in tokens]
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
    assert "the 9 tests of this section are one family" in section
    ratio_table = section.split("Perplexity, trained at L=32 — nonoverlapping windows: perplexity ratio to alibi")[1]
    row = next(line for line in ratio_table.splitlines() if line.startswith("| 64 |"))
    nope_cell, t5_cell = row.split("|")[3], row.split("|")[4]
    ratio, low, high = (float(x) for x in t5_cell.replace("[", " ").replace("]", " ").replace(",", " ").split()[:3])
    assert ratio == pytest.approx(1.5, abs=0.01) and low < 1.5 < high and "✓" in t5_cell and "(n=4)" in t5_cell
    assert nope_cell.strip().startswith("1.00") and "≈" in nope_cell
    recall = section.split("MQAR recall, trained at L=64: accuracy minus that of alibi")[1]
    t5_recall = next(line for line in recall.splitlines() if line.startswith("| 128 |")).split("|")[4]
    assert t5_recall.strip().startswith("-0.") and "✓" in t5_recall
    by_label = {"alibi": [], "nope": [], "t5 · lr=0.1": []}
    assert reference_columns(by_label, ["alibi", "t5", "rope"]) == ["alibi", "t5 · lr=0.1"]
    assert pairs(by_label, ["alibi", "nope"]) == [("nope", "alibi"), ("t5 · lr=0.1", "alibi"), ("t5 · lr=0.1", "nope")]
    custom = build_report(find_results([tmp_path]), tmp_path / "other", make_plots=False, references=["t5"])
    assert "the 6 tests of this section are one family" in custom
