"""The report's newer sections on hand-built results: protocols side by side, the documents' share of a difference,
and the learning-rate sweep of a retrieval task selected on validation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from posenc.report import build_report, find_results, protocols

TOKENS = [1000, 3000, 500, 5500]  # four documents scored


def _text_run(root: Path, label: str, seed: int, fraction: float | None, ppl: tuple[float, float], scale: list[float]):
    """A run's results with its loss per document: ``scale`` multiplies each document's share of the loss."""
    folder = root / f"{label}_{seed}" / ("eval" if fraction is None else f"eval_sliding_f{fraction:g}")
    rows = []
    for length, p in zip((32, 64), ppl, strict=True):
        weights = [t * s for t, s in zip(TOKENS, scale, strict=True)]
        total = math.log(p) * sum(TOKENS)
        rows.append(
            {"length": length, "mode": "nonoverlap" if fraction is None else "sliding",
             "stride": None if fraction is None else int(fraction * length), "stride_fraction": fraction,
             "tokens": sum(TOKENS), "loss": math.log(p), "ppl": p, "bpb": 1.0, "error": None,
             "multiple": length / 32, "ratio": p / ppl[0],
             "document_loss": [total * w / sum(weights) for w in weights]}
        )  # fmt: skip
    eval_settings = {"mode": rows[0]["mode"], "stride_fraction": fraction, "multiples": [1, 2], "sample": "documents"}
    result = {
        "label": label,
        "train_len": 32,
        "seed": seed,
        "eval": eval_settings,
        "perplexity": rows,
        "loss_by_position": {},
        "documents": {"sample": "documents", "documents": [0, 1, 2, 3], "tokens": TOKENS},
    }
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps(result))


def test_protocols_side_by_side_and_the_documents_share_of_each_difference(tmp_path: Path) -> None:
    for seed in range(2):
        # alibi is uniformly 10% worse in perplexity than kerple on every document; t5 is worse only on document 3
        _text_run(tmp_path, "kerple_log", seed, None, (10.0, 10.0), [1, 1, 1, 1])
        _text_run(tmp_path, "alibi", seed, None, (11.0, 11.0), [1, 1, 1, 1])
        _text_run(tmp_path, "t5", seed, None, (10.5, 10.5), [1, 1, 1, 1.2])
        _text_run(tmp_path, "alibi", seed, 0.5, (10.5, 12.0), [1, 1, 1, 1])
    markdown = build_report(find_results([tmp_path]), tmp_path / "out", make_plots=False)
    assert "## Trained at L=32 — nonoverlapping windows" in markdown
    assert "## Trained at L=32 — sliding windows, stride N/2 (N the evaluation length)" in markdown
    assert "## Protocols side by side, trained at L=32" in markdown
    protocols = markdown.split("## Protocols side by side")[1]
    assert "| 1× · nonoverlapping | 2× · nonoverlapping | ratio · nonoverlapping | 1× · sliding N/2 |" in protocols
    # the same loss on every document and seed: no spread at all; a ratio of exactly 1 is flat (=), 1.143 is not (✓)
    assert (
        "| alibi | 11.00 [11.00, 11.00] | 11.00 [11.00, 11.00] | 1.000 [1.000, 1.000] = | 10.50 [10.50, 10.50] "
        "| 12.00 [12.00, 12.00] | 1.143 [1.143, 1.143] ✓ |"
    ) in protocols
    # The documents are in every cell now: alibi is 10% worse than kerple on every document (separated, ✓); t5 is
    # worse on one document only, and across four documents that may be the data (inconclusive, ?).
    table = markdown.split("## Trained at L=32 — nonoverlapping windows")[1]
    row = next(line for line in table.splitlines() if line.startswith("| 32 | 1 |"))
    alibi, kerple, t5 = (cell.strip() for cell in row.strip("|").split("|")[2:])
    assert kerple.endswith("◆") and alibi.endswith("✓") and t5.endswith("?")
    low, high = (float(x) for x in t5.split("[")[1].split("]")[0].split(", "))
    assert low < 10.5 < high and high - low > 0.5


def test_a_ratio_shown_in_two_tables_earns_the_ratio_tables_word_in_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The protocols side by side repeat each protocol's longest ratio: their word is the ratio table's, from one Holm
    # family (every length of that protocol), not a second family of their own that could word the number otherwise.
    for seed in range(3):
        _text_run(tmp_path, "alibi", seed, None, (11.0, 11.0), [1, 1, 1, 1])
        _text_run(tmp_path, "alibi", seed, 0.5, (10.5, 12.0), [1, 1, 1, 1])
    real = protocols.ratio_words

    def marked(key, by_label):  # the ratio tables' words, with a mark no other family could give
        estimates, words = real(key, by_label)
        return estimates, {name: ("inconclusive",) for name in words}

    monkeypatch.setattr(protocols, "ratio_words", marked)
    markdown = build_report(find_results([tmp_path]), tmp_path / "out", make_plots=False)
    table = markdown.split("## Protocols side by side")[1]
    row = next(line for line in table.splitlines() if line.startswith("| alibi |"))
    assert row.count(" ?") == 2 and "✓" not in row and "=" not in row
    assert "Holm-adjusted over its protocol's whole table of ratios (every length)" in table


def _mqar_run(
    root: Path, label: str, lr: float, seed: int, accuracy: float, final_validation: float, multiplier: float = 1.0
) -> None:
    folder = root / f"{label}-lr{lr}-x{multiplier:g}-s{seed}"
    rows = [
        {"task": "mqar", "length": n, "samples": 64, "answers": 256, "correct": round(a * 256), "accuracy": a,
         "low": max(0.0, a - 0.05), "high": min(1.0, a + 0.05), "chance_exact": 1 / 128, "keyless_exact": 0.25,
         "keyless_exact_elimination": 25 / 48}
        for n, a in ((64, accuracy), (128, accuracy / 2))
    ]  # fmt: skip
    optim = {"lr": lr, "scheme_lr_multiplier": multiplier}
    config = {"optim": optim, "data": {"task": "mqar"}, "encoding": {"name": label}}
    result = {"label": label, "train_len": 64, "seed": seed, "mqar": rows, "data": {"task": "mqar"}, "config": config}
    (folder / "eval").mkdir(parents=True)
    (folder / "eval" / "results.json").write_text(json.dumps(result))
    curve = [{"step": s, "accuracy": final_validation * s / 400, "loss": 1.0, "answers": 256} for s in (100, 400)]
    curve = [*curve[:1], {"step": 300, "accuracy": final_validation, "loss": 1.0, "answers": 256}, curve[1]]
    (folder / "run.json").write_text(json.dumps({"val_curve": curve}))


def test_a_learning_rate_sweep_is_selected_on_validation_and_counted_in_seeds(tmp_path: Path) -> None:
    for seed in range(3):
        _mqar_run(tmp_path, "rope", 0.001, seed, 0.30, 0.30)
        _mqar_run(tmp_path, "rope", 0.003, seed, [0.99, 0.98, 0.40][seed], [0.99, 0.97, 0.45][seed])
        _mqar_run(tmp_path, "alibi", 0.003, seed, 0.26, 0.26)
    markdown = build_report(find_results([tmp_path]), tmp_path / "out", make_plots=False)
    sweep = markdown.split("Learning-rate sweep")[1].split("Exact match by window length")[0]
    rows = [line for line in sweep.splitlines() if line.startswith("| rope")]
    assert len(rows) == 2 and rows[1].endswith("| ✓ |") and not rows[0].endswith("| ✓ |")
    assert "| 0 of 3 |" in rows[0] and "| 2 of 3 |" in rows[1]  # learned: above the elimination floor 0.52
    assert "0.30 0.30 0.30" in rows[0] and "0.99 0.98 0.40" in rows[1]
    assert "| 0.803 |" in rows[1]  # mean final validation accuracy of the selected rate
    tables = markdown.split("Exact match by window length")[1]
    header = next(line for line in tables.splitlines() if line.startswith("| length |"))
    assert "rope · lr=0.003" in header and "lr=0.001" not in header  # only the selected rate is tabled
    assert (
        next(line for line in tables.splitlines() if line.startswith("| learned |"))
        == "| learned | | 0 of 3 | 2 of 3 |"
    )
    assert "(chance: 0.0078, a uniform guess; 0.25 without matching keys (0.52 with elimination))" in tables
    assert "Accuracy by query–key distance" not in tables  # the rows recorded no breakdown: none is made up


def test_a_scheme_with_parameters_is_selected_over_its_rates_and_multipliers_together(tmp_path: Path) -> None:
    # t5's best validation is at x10 and the smaller rate; x100 ties it at the larger rate; the tie goes to x10
    grid = {(0.001, 1.0): 0.40, (0.003, 1.0): 0.60, (0.001, 10.0): 0.95, (0.003, 10.0): 0.70, (0.003, 100.0): 0.95}
    for seed in range(2):
        for (lr, multiplier), final in grid.items():
            _mqar_run(tmp_path, "t5", lr, seed, final, final, multiplier)
        _mqar_run(tmp_path, "alibi", 0.003, seed, 0.9, 0.9)
    markdown = build_report(find_results([tmp_path]), tmp_path / "out", make_plots=False)
    sweep = markdown.split("Learning-rate sweep")[1].split("Exact match by window length")[0]
    assert "| column | lr | ×scheme | learned |" in sweep
    rows = [line for line in sweep.splitlines() if line.startswith("| t5")]
    assert len(rows) == 5  # one per setting, in (multiplier, rate) order
    assert [row.split("|")[2:4] for row in rows] == [
        [" 0.001 ", " 1 "], [" 0.003 ", " 1 "], [" 0.001 ", " 10 "], [" 0.003 ", " 10 "], [" 0.003 ", " 100 "]
    ]  # fmt: skip
    assert [row.endswith("| ✓ |") for row in rows] == [False, False, True, False, False]


@pytest.mark.parametrize("flag", ["--acc-threshold=1.5", "--ppl-ratio=0.9"])
def test_report_refuses_a_threshold_that_makes_no_sense_in_one_line(flag: str, tmp_path: Path) -> None:
    import subprocess
    import sys

    _text_run(tmp_path, "alibi", 0, None, (11.0, 11.0), [1, 1, 1, 1])
    done = subprocess.run(
        [sys.executable, "-m", "posenc.report", str(tmp_path), "--no-plots", flag], capture_output=True, text=True
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert flag.split("=")[0] in done.stderr


def test_without_validation_curves_no_rate_is_selected_and_every_rate_is_tabled(tmp_path: Path) -> None:
    for seed in range(2):
        for lr in (0.001, 0.003):
            _mqar_run(tmp_path, "rope", lr, seed, 0.3, 0.3)
    for run_json in tmp_path.rglob("run.json"):
        run_json.unlink()  # results written before runs recorded their validation curve
    markdown = build_report(find_results([tmp_path]), tmp_path / "out", make_plots=False)
    header = next(
        line for line in markdown.split("Exact match by window length")[1].splitlines() if "| length |" in line
    )
    assert "rope · lr=0.001" in header and "rope · lr=0.003" in header
    assert not any(line.endswith("| ✓ |") for line in markdown.splitlines())
    assert "No rate selected for rope: a run recorded no validation curve" in markdown


def test_a_scheme_at_several_settings_says_which_verdicts_survive_every_setting(tmp_path: Path) -> None:
    # FIRE at two thresholds beside ALiBi, two seeds each: at 16 its ratio stays at 1 (flat), at 64 it doubles
    # (separated from 1); against ALiBi at 2× it is above at both settings. A learned threshold is tabled per layer.
    def run(label: str, seed: int, ppl: tuple[float, float], threshold: float | None) -> None:
        _text_run(tmp_path / f"t{threshold}", label, seed, None, ppl, [1, 1, 1.01 + 0.01 * seed, 1])
        path = tmp_path / f"t{threshold}" / f"{label}_{seed}" / "eval" / "results.json"
        result = json.loads(path.read_text())
        encoding = {"name": label} | ({"init_threshold": threshold} if threshold else {})
        result["config"] = {"encoding": encoding, "trainer": {"max_steps": 10}}
        if threshold:
            result["learned_settings"] = [{"threshold": threshold * (1.5 + seed), "threshold_multiplier": -1.5 - seed}]
        path.write_text(json.dumps(result))

    for seed in range(2):
        run("alibi", seed, (10.0, 10.0), None)
        run("fire", seed, (10.0, 10.0), 16.0)
        run("fire", seed, (10.0, 20.0), 64.0)
    markdown = build_report(find_results([tmp_path]), tmp_path / "out", make_plots=False)
    section = markdown.split("## Settings sensitivity, trained at L=32 — nonoverlapping windows")[1]
    rows = [line for line in section.splitlines() if line.startswith("| fire |")]
    assert [row.split("|")[2].strip() for row in rows] == ["init_threshold 16", "init_threshold 64"]
    assert rows[0].split("|")[6].strip() == "flat" and rows[1].split("|")[6].strip() == "separated, above 1"
    assert "- **fire**: its ratio's word moves with its setting" in section
    learned = markdown.split("### What the length settings trained to")[1]
    assert "| fire · init_threshold=64 | 0 | threshold | 128 [96, 160] | 2 |" in learned
    assert "| threshold_multiplier | -2 [-2.5, -1.5] | 2 |" in learned
