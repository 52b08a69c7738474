"""The same tuning for every scheme: the selection rule, and a run taking its scheme's setting from the selection."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import compose_train

from posenc.config import to_container
from posenc.report.tuning import SEED_SPREAD, band, grid, seed_spread, select, tuning_section, write_selection
from posenc.runs import RunError, apply_tuning


def _run(label: str, lr: float, multiplier: float, loss: float, seed: int = 10, split: str = "validation") -> dict:
    return {
        "label": label,
        "seed": seed,
        "config": {"optim": {"lr": lr, "scheme_lr_multiplier": multiplier}},
        "eval": {"split": split},
        "perplexity": [
            {"multiple": 1, "loss": loss, "error": None, "ratio": 1.0},
            {"multiple": 2, "loss": 0.1, "error": None, "ratio": 1.1},
        ],
    }


def test_the_lowest_in_length_validation_loss_wins_and_ties_go_to_the_smaller_settings() -> None:
    # ALiBi's replicated point (2e-3: 1.70, 1.74, 1 df) pooled with the comparison's 32 df of σ = 0.0049: its
    # σ = √((32 · 0.0049² + 0.0008) / 33) = 0.0068 nats, t(33) = 2.035, so two of its single-seed points tie within
    # 0.0195 and a single-seed point ties a two-seed one within 0.0169. T5 has no replicate: the comparison's σ, 0.0141.
    results = [
        _run("t5", 1e-3, 1, 2.00),
        _run("t5", 2e-3, 1, 1.91),  # within 0.0141 of the best: tied, and the smaller multiplier wins
        _run("t5", 2e-3, 10, 1.90),
        _run("t5", 4e-3, 100, 1.93),  # outside: not tied
        _run("alibi", 1e-3, 1, 1.73),  # 0.02 above the best: outside its band of 0.0195
        _run("alibi", 2e-3, 1, 1.70),
        _run("alibi", 2e-3, 1, 1.74, seed=11),  # seeds are averaged: 1.72, tied with 1.71; the smaller rate wins
        _run("alibi", 4e-3, 1, 1.71),
        _run("alibi", 4e-3, 1, 0.5, split="test"),  # never selected on the reported split
    ]
    chosen = select(results)
    spread, free = chosen["alibi"]["spread"], chosen["alibi"]["df"]
    assert spread == pytest.approx(math.sqrt((32 * 0.0049**2 + 0.04**2 / 2) / 33)) and free == 33
    assert (chosen["t5"]["spread"], chosen["t5"]["df"]) == SEED_SPREAD["text"]  # ALiBi's replicate is not T5's
    assert band(spread, free, 1, 1) == pytest.approx(2.0345 * spread * math.sqrt(2), rel=1e-4)
    assert band(spread, free, 3, 3) < band(spread, free, 1, 1) < band(spread, 1, 1, 1)  # fewer df, a wider band
    assert (chosen["t5"]["lr"], chosen["t5"]["scheme_lr_multiplier"]) == (2e-3, 1)
    assert [(t["lr"], t["scheme_lr_multiplier"]) for t in chosen["t5"]["tied"]] == [(2e-3, 1), (2e-3, 10)]
    assert (chosen["alibi"]["lr"], chosen["alibi"]["scheme_lr_multiplier"]) == (2e-3, 1)
    assert not chosen["alibi"]["resolved"] and len(chosen["t5"]["grid"]) == 4
    text = "\n".join(tuning_section(results))
    assert f"{math.exp(1.72):.3f} (n=2) ◆" in text and "lowest in-length (1×) validation loss" in text
    # Every tied point short of three seeds is listed as the run that would resolve it.
    assert "+encoding=t5 optim.lr=0.002 optim.scheme_lr_multiplier=10  # 1 seed(s)" in text
    assert "+encoding=alibi optim.lr=0.002 optim.scheme_lr_multiplier=1  # 2 seed(s)" in text
    # Each point's longest ratio, where its runs were evaluated there (here every run has 2×: ratio 1.1), tied or not.
    assert "| alibi | 0.002 ×1 ◆ | tied | 2× | 1.100 | 2 |" in text
    assert "| t5 | 0.004 ×100 | — | 2× | 1.100 | 1 |" in text
    assert "| alibi | 0.004 ×1 | tied | 2× | 1.100 | 1 |" in text  # its test-split run is never read here


def test_a_tied_point_is_listed_as_a_run_of_the_grids_own_sweep_with_the_model_it_trained() -> None:
    # A layout trained at depth 6 beside depth-4 entries: its tie line names the depth; a key only newer records
    # hold (sink) is no difference of setting, and a key every run shares (dim) is left to the sweep.
    def run(label: str, lr: float, loss: float, depth: int, **model: object) -> dict:
        return {**_run(label, lr, 1, loss), "model": {"dim": 64, "depth": depth, **model}}

    results = [run("gemma3", 1e-3, 2.00, 6, sink="none"), run("gemma3", 3e-3, 2.01, 6), run("alibi", 1e-3, 0.1, 4)]
    text = "\n".join(tuning_section(results, "retrieval_offset_tune_layouts seed=11,12"))
    assert "`python -m posenc.train -m -cd sweeps -cn retrieval_offset_tune_layouts seed=11,12` and:" in text
    assert "+encoding=gemma3 optim.lr=0.001 optim.scheme_lr_multiplier=1 model.depth=6  # 1 seed(s)" in text
    assert "+encoding=gemma3 optim.lr=0.003 optim.scheme_lr_multiplier=1 model.depth=6  # 1 seed(s)" in text
    assert "model.sink" not in text and "model.dim" not in text and "+encoding=alibi" not in text


def test_without_a_replicated_point_the_spread_is_the_comparisons_and_said_so() -> None:
    results = [_run("t5", 1e-3, 1, 2.00), _run("t5", 2e-3, 1, 2.00 + SEED_SPREAD["text"][0])]
    chosen = select(results)["t5"]
    assert (chosen["spread"], chosen["df"]) == SEED_SPREAD["text"]
    assert "the reference is the comparison's five seeds (σ = 0.0049 nats, 32 df)" in "\n".join(tuning_section(results))
    assert len(chosen["tied"]) == 2 and chosen["lr"] == 1e-3 and not chosen["resolved"]
    resolved = select([*results, *(_run("t5", lr, 1, 2.0, seed=s) for lr in (1e-3, 2e-3) for s in (11, 12))])
    assert resolved["t5"]["resolved"]


def test_replicates_at_a_learned_tasks_floor_do_not_collapse_the_band(tmp_path) -> None:
    # Two seeds of a lookup learned (loss 1e-4 apart) beside single-seed points 0.00035 and 0.2 nats above: the
    # reference's 16 df hold the band near its measured spread (0.026), so the near-equal points stay tied; the
    # grid's 1 df alone (σ 7e-5, band 1.7e-4 at z) would have split them.
    results = [
        _task_run(tmp_path, "cable", 1e-3, 1, [2.0, 0.0001]),
        {**_task_run(tmp_path / "s11", "cable", 1e-3, 1, [2.0, 0.0002]), "seed": 11},
        _task_run(tmp_path, "cable", 3e-3, 1, [2.0, 0.0005]),
        _task_run(tmp_path, "cable", 1e-2, 1, [2.0, 0.2]),
        # Another scheme learning at one seed and not at another: its spread is its own, not CABLE's.
        _task_run(tmp_path, "fope", 1e-3, 1, [2.0, 0.4]),
        {**_task_run(tmp_path / "s11", "fope", 1e-3, 1, [2.0, 3.1]), "seed": 11},
    ]
    spread, free = seed_spread(grid(results)["cable"], "task")
    assert free == 17 and spread == pytest.approx(0.0102 * math.sqrt(16 / 17), rel=1e-3)
    assert select(results)["fope"]["spread"] > 0.4
    chosen = select(results)["cable"]
    assert [(t["lr"], t["seeds"]) for t in chosen["tied"]] == [(1e-3, 2), (3e-3, 1)] and not chosen["resolved"]


def test_a_run_takes_its_schemes_tuned_rates_and_an_untuned_scheme_is_refused(tmp_path) -> None:
    selection = tmp_path / "selection.json"
    write_selection(selection, select([_run("t5", 4e-3, 10, 1.0), _run("alibi", 1e-3, 1, 1.0)]))
    config = to_container(compose_train("+encoding=t5", f"optim.tuned={selection}"))
    tuned = apply_tuning(config)
    assert (tuned["optim"]["lr"], tuned["optim"]["scheme_lr_multiplier"]) == (4e-3, 10)
    assert tuned["tuning"]["from"] == str(selection) and tuned["tuning"]["split"] == "validation"
    assert apply_tuning(to_container(compose_train("+encoding=t5")))["optim"]["lr"] == config["optim"]["lr"]
    with pytest.raises(RunError, match="has no setting for fire"):
        apply_tuning(to_container(compose_train("+encoding=fire", f"optim.tuned={selection}")))


def test_a_form_of_a_scheme_is_tuned_under_the_name_its_runs_carry() -> None:
    # Two forms of stick-breaking in one sweep: each its own run name, column and selected setting.
    from posenc.layout import encoding_label

    trained = {"name": "stick_breaking", "remainder": "head_bias", "head_norm": True}
    assert encoding_label(trained) == "stick_breaking_trained" and encoding_label("stick_breaking") == "stick_breaking"
    assert encoding_label({"name": "stick_breaking", "head_norm": True}) == "stick_breaking-head_norm"
    recorded = {**_run("stick_breaking", 4e-3, 1, 1.5), "encoding": trained}  # labelled before forms read apart
    chosen = select([recorded, _run("stick_breaking", 2e-3, 1, 1.6)])
    assert set(chosen) == {"stick_breaking_trained", "stick_breaking"}
    config = to_container(compose_train("+encoding=stick_breaking_trained"))
    assert encoding_label(config["encoding"]) in chosen  # the comparison's run finds its own scheme's setting


def _task_run(root, label: str, lr: float, multiplier: float, losses: list[float]) -> dict:
    """A recall run as the report reads it: results without perplexity, the validation curve in its run.json."""
    import json

    folder = root / f"{label}-mqar-lr{lr}-x{multiplier}-L64-s10"
    (folder / "eval").mkdir(parents=True)
    curve = [{"step": 100 * (i + 1), "loss": loss, "accuracy": 1 - loss} for i, loss in enumerate(losses)]
    (folder / "run.json").write_text(json.dumps({"val_curve": curve, "val_loss": losses[-1]}))
    return {
        "label": label,
        "seed": 10,
        "trained_task": "mqar",
        "config": {"optim": {"lr": lr, "scheme_lr_multiplier": multiplier}},
        "eval": {"split": "validation"},
        "mqar": [{"length": 64, "accuracy": 0.0}],
        "_source": str(folder / "eval" / "results.json"),
    }


def test_a_task_is_selected_on_its_last_validation_loss_not_its_best_or_its_evaluation(tmp_path) -> None:
    results = [
        _task_run(tmp_path, "t5", 1e-3, 1, [2.0, 0.05, 0.9]),  # best early, last high: not selected
        _task_run(tmp_path, "t5", 3e-3, 1, [2.0, 0.40, 0.30]),
        _task_run(tmp_path, "t5", 3e-3, 10, [2.0, 0.30, 0.30 - SEED_SPREAD["task"][0]]),  # tied: the smaller multiplier
        _task_run(tmp_path, "t5", 1e-2, 100, [2.0, 1.00, 0.20]),  # the lowest last loss
        _task_run(tmp_path, "alibi", 1e-3, 1, [2.0, 1.0, 1.5]),
        _task_run(tmp_path, "alibi", 1e-2, 1, [2.0, 1.0, 1.2]),
    ]
    chosen = select(results)
    assert (chosen["t5"]["lr"], chosen["t5"]["scheme_lr_multiplier"]) == (1e-2, 100)
    assert chosen["t5"]["margin_to_next"] == pytest.approx(0.1 - SEED_SPREAD["task"][0])
    assert (chosen["alibi"]["lr"], chosen["alibi"]["scheme_lr_multiplier"]) == (1e-2, 1)
    results[3] = _task_run(tmp_path / "other", "t5", 1e-2, 100, [2.0, 1.0, 0.30])  # now tied with x1 and x10 at 3e-3
    chosen = select(results)
    assert (chosen["t5"]["lr"], chosen["t5"]["scheme_lr_multiplier"]) == (3e-3, 1)
    without_record = {**results[0], "_source": str(tmp_path / "missing" / "eval" / "results.json")}
    assert select([without_record]) == {}  # no curve, no figure: never selected on a guess
    assert "answers' on the held-out windows" in "\n".join(tuning_section(results))
    assert "answers'" not in "\n".join(tuning_section([_run("t5", 1e-3, 1, 2.0)]))


def test_two_equal_points_tie_95_percent_of_the_time_whatever_the_df() -> None:
    # Simulated: two single-seed points of one true loss, σ estimated on `free` df. The t band ties them in 95% of
    # trials at 2 df as at 30; 1.96 in its place ties them in about 82% at 2 df: a choice made on noise.
    rng = np.random.default_rng(0)
    trials = 20_000
    for free in (2, 30):
        gaps = np.abs(rng.normal(size=trials) - rng.normal(size=trials))
        spreads = np.sqrt(rng.chisquare(free, size=trials) / free)
        assert np.mean(gaps <= band(1.0, free, 1, 1) * spreads) == pytest.approx(0.95, abs=0.01)
        if free == 2:
            assert np.mean(gaps <= 1.96 * math.sqrt(2) * spreads) == pytest.approx(0.82, abs=0.02)
