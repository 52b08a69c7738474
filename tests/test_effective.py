"""Effective length on hand-built results: the contiguous rule, its thresholds, and the cases with no answer."""

from __future__ import annotations

import pytest

from posenc.evaluate.effective import both_rules, comparison_thresholds, effective_lengths, recorded_lengths
from posenc.evaluate.runner import summary_metrics
from posenc.report.effective import pooled_cell


def ppl_rows(*ppls: float | None, train_len: int = 64) -> list[dict]:
    """Perplexity rows at 1×, 2×, 4×, … the training length (``None``: that length failed to evaluate)."""
    return [
        {"length": train_len * 2**i, "ppl": p, "error": None if p is not None else "too long"}
        for i, p in enumerate(ppls)
    ]


def task_rows(task: str, *accuracies: float, train_len: int = 64, **fields: list[float]) -> list[dict]:
    return [
        {"task": task, "length": train_len * 2**i, "accuracy": a, **{k: v[i] for k, v in fields.items()}}
        for i, a in enumerate(accuracies)
    ]


def test_perplexity_holds_until_the_first_length_past_the_ratio() -> None:
    # ratios 1, 1.05, 1.10 (holds: ≤ 1.10), 1.12 (fails), then 1.0 again: contiguous, so 256
    results = {"train_len": 64, "perplexity": ppl_rows(10.0, 10.5, 11.0, 11.2, 10.0)}
    assert effective_lengths(results) == {"ppl": 256}
    assert effective_lengths(results, ppl_ratio=1.15) == {"ppl": 1024}
    assert effective_lengths(results, ppl_ratio=1.01) == {"ppl": 64}


def test_a_recovery_after_a_failure_does_not_count() -> None:
    results = {"train_len": 64, "copy": task_rows("copy", 1.0, 0.5, 0.95, 0.95)}
    assert effective_lengths(results) == {"copy": 64}


def test_task_accuracy_is_a_fraction_of_in_length() -> None:
    # in-length 0.9: holds while ≥ 0.72; first-byte accuracy (in-length 1.0) holds while ≥ 0.8
    rows = task_rows("multikey", 0.9, 0.8, 0.72, 0.5, first_byte_accuracy=[1.0, 0.9, 0.85, 0.79])
    results = {"train_len": 64, "multikey": rows}
    assert effective_lengths(results) == {"multikey": 256, "multikey_first_byte_accuracy": 256}
    assert effective_lengths(results, acc_fraction=0.85) == {"multikey": 128, "multikey_first_byte_accuracy": 256}


def test_depths_are_averaged_before_the_rule() -> None:
    rows = [
        {"task": "passkey", "length": n, "depth": d, "accuracy": a}
        for n, d, a in [(64, 0.0, 1.0), (64, 1.0, 0.8), (128, 0.0, 1.0), (128, 1.0, 0.5), (256, 0.0, 0.6)]
    ]
    # means 0.9, 0.75 (≥ 0.72 holds), 0.6 (fails)
    assert effective_lengths({"train_len": 64, "passkey": rows}) == {"passkey": 128}


def test_no_in_length_figure_gives_none() -> None:
    results = {
        "train_len": 64,
        "perplexity": ppl_rows(None, 10.0),  # in-length failed
        "multikey": task_rows("multikey", 0.0, 0.0),  # never learned
        "vartrack": task_rows("vartrack", 0.5, 0.5, train_len=128),  # no row at the training length
    }
    assert effective_lengths(results) == {"ppl": None, "multikey": None, "vartrack": None}


def test_a_task_at_its_floor_has_no_effective_length() -> None:
    floors = {"keyless_exact": 0.46, "chance_exact": 0.1, "keyless_first_byte": 0.46, "chance_first_byte": 0.1}
    # at the keyless floor in-length (guessing among the block's values): not learned, whatever it does further out
    guessing = task_rows("multikey", 0.41, 0.40, 0.39, token_accuracy=[0.41, 0.40, 0.39])
    results = {"train_len": 64, "multikey": [{**row, **floors} for row in guessing]}
    assert effective_lengths(results) == {"multikey": None, "multikey_token_accuracy": None}
    # learned (0.9 in-length): 0.75 at 2x holds, 0.46 at 4x is ≥ 0.8 × 0.5 but at the floor, so it does not
    learned = task_rows("multikey", 0.9, 0.75, 0.46, first_byte_accuracy=[0.5, 0.46, 0.46])
    results = {"train_len": 64, "multikey": [{**row, **floors} for row in learned]}
    assert effective_lengths(results) == {"multikey": 128, "multikey_first_byte_accuracy": 64}
    assert effective_lengths(results, acc_fraction=0.5) == {"multikey": 128, "multikey_first_byte_accuracy": 64}
    # rows without floors (passkey, copy, older results) keep the plain rule
    assert effective_lengths({"train_len": 64, "copy": task_rows("copy", 0.4, 0.4)}) == {"copy": 128}


def test_failed_lengths_and_shorter_lengths() -> None:
    rows = [{"length": 32, "ppl": 30.0, "error": None}, *ppl_rows(10.0, 10.2, None, 10.0)]
    assert effective_lengths({"train_len": 64, "perplexity": rows}) == {"ppl": 128}  # 32 ignored, 256 failed


def test_thresholds_come_from_the_results_then_the_defaults() -> None:
    results = {"train_len": 64, "perplexity": ppl_rows(10.0, 11.4), "eval": {"effective_ppl_ratio": 1.2}}
    assert effective_lengths(results) == {"ppl": 128}
    results["eval"] = {}
    assert effective_lengths(results) == {"ppl": 64}


@pytest.mark.parametrize(("ratio", "fraction", "message"), [(0.9, 0.8, "≥ 1"), (1.1, 0.0, "in \\(0, 1\\]")])
def test_bad_thresholds_are_refused(ratio: float, fraction: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        effective_lengths({"train_len": 64}, ppl_ratio=ratio, acc_fraction=fraction)


def test_summary_carries_the_lengths_it_has_under_each_rule() -> None:
    results = {
        "train_len": 64,
        "effective_length": {"absolute": {"ppl": 128}, "relative": {"ppl": 256, "passkey": None}},
    }
    summary = summary_metrics(results)
    assert summary["effective_length_absolute/ppl"] == 128 and summary["effective_length_relative/ppl"] == 256
    assert "effective_length_relative/passkey" not in summary


def test_the_absolute_rule_does_not_reward_a_model_that_starts_badly_and_stays_flat() -> None:
    # rope degrades from a good start; a scaled model starts far worse and stays flat (its ratio never passes 1.10)
    rope = {"train_len": 64, "perplexity": ppl_rows(5.6, 6.0, 8.7, 12.2)}
    scaled = {"train_len": 64, "perplexity": ppl_rows(14.0, 14.5, 14.8, 15.0)}
    assert effective_lengths(rope) == {"ppl": 128} and effective_lengths(scaled) == {"ppl": 512}  # relative
    shared = comparison_thresholds([rope, scaled])  # 1.10 × the best in-length perplexity, rope's 5.6
    assert shared == pytest.approx({"ppl": 6.16})
    assert effective_lengths(rope, "absolute", thresholds=shared) == {"ppl": 128}
    assert effective_lengths(scaled, "absolute", thresholds=shared) == {"ppl": None}  # never under 6.16
    assert effective_lengths(scaled, "absolute", thresholds={"ppl": 15.0}) == {"ppl": 512}  # a fixed threshold


def test_absolute_accuracy_threshold_is_a_fraction_of_the_best_column_or_fixed() -> None:
    good = [{"train_len": 64, "copy": task_rows("copy", acc, 0.8, 0.6)} for acc in (1.0, 0.9)]  # mean 0.95
    weak = [{"train_len": 64, "copy": task_rows("copy", 0.5, 0.5, 0.5)}]
    assert comparison_thresholds([*good, *weak], columns={"good": good, "weak": weak}) == pytest.approx({"copy": 0.76})
    assert comparison_thresholds([*good, *weak], acc_threshold=0.856) == {"copy": 0.856}  # RULER's, fixed
    shared = {"copy": 0.76}
    assert [effective_lengths(run, "absolute", thresholds=shared)["copy"] for run in good] == [128, 128]
    assert effective_lengths(weak[0], "absolute", thresholds=shared) == {"copy": None}
    assert effective_lengths(weak[0], "relative") == {"copy": 256}  # flat at 0.5: the relative rule passes it


def test_results_record_both_rules_and_older_flat_records_read_as_relative() -> None:
    recorded = both_rules({"train_len": 64, "perplexity": ppl_rows(10.0, 10.5, 12.0)})
    assert recorded["relative"] == {"ppl": 128} and recorded["absolute"] == {"ppl": 128}
    assert recorded["absolute_thresholds"] == pytest.approx({"ppl": 11.0})  # the run is its own comparison
    assert recorded_lengths({"effective_length": {"ppl": 256}}, "relative") == {"ppl": 256}
    assert recorded_lengths({"effective_length": {"ppl": 256}}, "absolute") is None
    assert recorded_lengths({"effective_length": recorded}, "absolute") == {"ppl": 128}


def test_a_pooled_cell_counts_the_seeds_without_a_length() -> None:
    assert pooled_cell([1024, None, None]) == "1024 (1 of 3 seeds; 2 without)"
    assert pooled_cell([64, 256, 128]) == "128 [64–256] (3 of 3 seeds)"
    assert pooled_cell([None, None]) == "— (0 of 2 seeds; 2 without)"
