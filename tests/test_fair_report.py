"""What the report says of a comparison made fair: the split and budget of every table, the learning rates each
column was tuned to, the columns that read parameters training never reached, and recall only where it was learned."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from posenc.evaluate.bins import binned, edges
from posenc.report import build_report, find_results
from posenc.report.common import scored_on
from posenc.report.preset import learned_seeds, recall_test
from posenc.report.study import _wall_seconds, keep_records


def _text_run(root: Path, label: str, seed: int, ppl: float, gaps: list | None = None, lr: float = 2e-3) -> Path:
    folder = root / f"{label}-L32-s{seed}"
    rows = [
        {"length": 32 * m, "mode": "nonoverlap", "stride": None, "tokens": 2048, "loss": math.log(ppl * m ** 0.01),
         "ppl": ppl * m ** 0.01, "bpb": 1.0, "error": None, "multiple": m, "ratio": m ** 0.01}
        for m in (1, 2)
    ]  # fmt: skip
    tuning = {"from": "tuning/selection.json", "rule": "the rule", "split": "validation", "lr": lr,
              "scheme_lr_multiplier": 10.0}  # fmt: skip
    config = {"optim": {"lr": lr, "scheme_lr_multiplier": 10.0, "tuned": "tuning/selection.json"}, "tuning": tuning}
    result = {"label": label, "train_len": 32, "seed": seed, "perplexity": rows, "config": config, "run_name": label}
    result |= {"eval": {"mode": "nonoverlap", "stride": None, "split": "test"}, "training": {"steps": 10}}
    result |= {"budget": {"parameters": 1000, "tokens": 6000, "tokens_per_parameter": 6.0}}
    result |= {"coverage": {"train_length": 32, "gaps": gaps or []}, "loss_by_position": {"32": [2.0] * 32,
               "64": [1.23456789] * 64}}  # fmt: skip
    (folder / "eval").mkdir(parents=True)
    (folder / "eval" / "results.json").write_text(json.dumps(result))
    (folder / "run.json").write_text(json.dumps({"steps": 10, "tokens": 6000}))
    return folder


def test_a_study_run_in_waves_days_apart_counts_only_the_time_runs_were_training() -> None:
    def run(end: str, seconds: float) -> dict[str, object]:
        return {"finished_at": end, "train_seconds": seconds}

    # two lanes overlapping by 50 s, a third run 2 days later, one run that recorded no time
    records = [run("2026-11-27T10:02:00+0000", 120), run("2026-11-27T10:03:10+0000", 120)]
    records += [run("2026-11-29T09:00:00+0000", 300), {"finished_at": "2026-11-29T09:00:00+0000"}]
    assert _wall_seconds(records) == pytest.approx(190 + 300)
    assert _wall_seconds([{}]) is None


def test_tables_say_their_split_budget_tuned_rates_and_untrained_parameters(tmp_path: Path) -> None:
    gap = {"scheme": "t5", "parameter": "table", "note": "buckets 27–31 of 32 are never reached"}
    for seed in (0, 1):
        _text_run(tmp_path, "alibi", seed, 5.0, lr=4e-3)
        _text_run(tmp_path, "t5", seed, 5.5, gaps=[gap] if seed == 0 else None)
    markdown = build_report(find_results([tmp_path]), tmp_path / "report", make_plots=False)
    table = markdown.split("## Trained at L=32 — nonoverlapping windows")[1].split("Ratio to the in-length")[0]
    assert "Scored on the test split; trained for 6 tokens a parameter." in table
    assert "selected per scheme on the validation split by one rule (the rule)" in table
    assert "alibi: lr 0.004, ×10; t5: lr 0.002, ×10" in table
    assert "differ in more than their scheme" not in table  # tuned rates are said as such, not as a difference
    assert "t5† (n=2" in table and "† reads positional parameters that training at its length never reached" in table
    assert "alibi† " not in table


def test_columns_selected_under_two_wordings_of_the_rule_say_which_read_which(tmp_path: Path) -> None:
    # A selection file rewritten between runs (a revised tie band): one rule would misstate what some columns read.
    # T5's seeds read the revised wording; ALiBi's seed 3, added later, too: a column names its seeds when they differ.
    for label, seed in (("alibi", 0), ("alibi", 1), ("alibi", 2), ("alibi", 3), ("t5", 0), ("t5", 1)):
        folder = _text_run(tmp_path, label, seed, 5.0 if label == "alibi" else 5.5)
        if label == "t5" or seed == 3:
            result = json.loads((folder / "eval" / "results.json").read_text())
            result["config"]["tuning"]["rule"] = "the revised rule"
            (folder / "eval" / "results.json").write_text(json.dumps(result))
    markdown = build_report(find_results([tmp_path]), tmp_path / "report", make_plots=False)
    rules = "by the rule as each run read it (alibi seeds 0–2: the rule; alibi seed 3, t5: the revised rule)"
    assert rules in markdown
    assert "by one rule" not in markdown


def test_a_task_run_is_said_to_be_scored_on_generated_windows_not_the_split_its_config_names() -> None:
    budget = {"budget": {"tokens_per_parameter": 70.04}}
    task = {"trained_task": "mqar", "eval": {"split": "validation"}} | budget  # the split is a text default, unread
    text = {"eval": {"split": "test"}} | budget
    said = scored_on({"alibi": [task], "t5": [task]})
    assert said.startswith("Scored on generated windows, not a text split (the same windows at a length for every run")
    assert "validation split" not in said and said.endswith("; trained for 70 tokens a parameter.")
    both = scored_on({"alibi": [text], "t5": [task]})
    assert both.startswith("Scored on the test split; and on generated windows, not a text split")
    assert scored_on({"alibi": [{"trained_task": "mqar"}]}) == ""  # nothing worth saying of a record without a budget


def test_kept_records_are_compressed_and_the_report_reads_them_the_same(tmp_path: Path) -> None:
    for seed in (0, 1):
        _text_run(tmp_path / "runs", "alibi", seed, 5.0)
    results = find_results([tmp_path / "runs"])
    keep_records(results, tmp_path / "kept")
    kept = sorted(p.relative_to(tmp_path / "kept").as_posix() for p in (tmp_path / "kept").rglob("*") if p.is_file())
    assert kept == [f"alibi-L32-s{s}/{f}" for s in (0, 1) for f in ("eval/results.json.gz", "run.json.gz")]
    again = find_results([tmp_path / "kept"])
    loss = results[0]["perplexity"][1]["loss"]  # log(5 · 2^0.01): seventeen digits as recorded, nine as kept
    assert again[0]["perplexity"][1]["loss"] == float(f"{loss:.9g}") != loss
    assert [[row["tokens"] for row in r["perplexity"]] for r in again] == [[2048, 2048]] * 2
    # Only the curve a figure draws: the longest window's log-spaced bins, to 3 decimals.
    assert again[0]["loss_by_position"] == {"64": [1.235] * (len(edges(64)) - 1)}
    assert again[0]["training"]["steps"] == 10


def test_a_curve_kept_binned_draws_as_the_curve_binned_when_drawn() -> None:
    rng = np.random.default_rng(0)
    curves = [rng.normal(2.0, 0.3, 2048) for _ in range(3)]
    drawn = binned(np.mean(curves, axis=0), 2048)  # the figure from whole curves: their mean, binned
    kept = [binned(list(binned(c, 2048)[1]), 2048) for c in curves]  # each run's bins as kept, read back
    np.testing.assert_allclose(drawn[0], kept[0][0])
    np.testing.assert_allclose(drawn[1], np.mean([means for _, means in kept], axis=0))
    with pytest.raises(ValueError, match="fits neither 2048 positions nor their bins"):
        binned([1.0] * 100, 2048)


def test_kept_records_hold_a_runs_attention_statistics_once(tmp_path: Path) -> None:
    # Both protocols of a run measure them on the same windows; the report reads the nonoverlapping evaluation's.
    folder = _text_run(tmp_path / "runs", "alibi", 0, 5.0)
    stats = [{"length": 32, "layer": 0, "head": 0, "distance": 3.0, "entropy": 1.0, "sink": 0.1, "queries": 31}]
    plain = json.loads((folder / "eval" / "results.json").read_text()) | {"attention_stats": stats}
    (folder / "eval" / "results.json").write_text(json.dumps(plain))
    sliding = plain | {"eval": {"mode": "sliding", "stride": None, "stride_fraction": 0.5, "split": "test"}}
    (folder / "eval_sliding_f0.5").mkdir()
    (folder / "eval_sliding_f0.5" / "results.json").write_text(json.dumps(sliding))
    keep_records(find_results([tmp_path / "runs"]), tmp_path / "kept")
    kept = {r["eval"]["mode"]: r for r in find_results([tmp_path / "kept"])}
    assert kept["nonoverlap"]["attention_stats"] == stats and "attention_stats" not in kept["sliding"]


def test_kept_records_hold_the_first_layer_bias_of_the_run_its_table_draws_only(tmp_path: Path) -> None:
    # A column's bias table and figure draw its lowest seed (heads of two seeds do not pair); the others keep the key,
    # so the column's n is unchanged.
    for seed in (1, 0, 2):
        folder = _text_run(tmp_path / "runs", "alibi", seed, 5.0)
        curve = {"distances": [0, 1], "query_position": 63, "source": "distance_bias", "by_head": [[0.0, -float(seed)]]}
        plain = json.loads((folder / "eval" / "results.json").read_text()) | {"learned_bias": curve}
        (folder / "eval" / "results.json").write_text(json.dumps(plain))
    results = find_results([tmp_path / "runs"])
    keep_records(results, tmp_path / "kept")
    kept = {r["seed"]: r for r in find_results([tmp_path / "kept"])}
    assert kept[0]["learned_bias"]["by_head"] == [[0.0, -0.0]]
    assert kept[1]["learned_bias"] is None and kept[2]["learned_bias"] is None
    before = build_report(results, tmp_path / "a", make_plots=False)
    after = build_report(list(kept.values()), tmp_path / "b", make_plots=False)
    assert "| 1 | 0.0312 | -0.000 |" in before  # the bias table draws seed 0
    assert after.replace(f"{tmp_path}/kept/", f"{tmp_path}/runs/") == before


def test_recall_is_compared_only_over_the_seeds_that_learned_it() -> None:
    def run(seed: int, accuracy: float) -> dict:
        rows = [{"length": 64, "accuracy": accuracy, "low": accuracy - 0.05, "keyless_exact": 0.25}]
        return {"seed": seed, "mqar": rows}

    columns = {
        "alibi": [run(0, 0.9), run(1, 0.95)],
        "t5": [run(0, 0.9), run(1, 0.2), run(2, 0.92)],
        "rope": [run(0, 0.9), run(1, 0.2)],
        "nope": [run(0, 0.1)],
    }
    kept, notes = learned_seeds(columns, 64)
    assert [r["seed"] for r in kept["t5"]] == [0, 2] and len(kept["alibi"]) == 2 and "nope" not in kept
    assert [r["seed"] for r in kept["rope"]] == [0]  # kept, but noted as too few: recall_test compares two or more
    windows = {"mqar_windows": [{"length": 64, "answers_per_window": 4, "right": [4, 3, 2, 4]}]}
    one, two = [({"seed": 0, **windows}, {"seed": 0, **windows})], [({"seed": s, **windows},) * 2 for s in (0, 1)]
    assert recall_test(one, 64) is None and recall_test(two, 64).seeds == 2  # one seed: no seed variance to give
    assert notes == [
        "t5 learned (2 of 3 seeds)",
        "rope learned (1 of 2 seeds, too few to compare)",
        "nope did not learn (0 of 1 seeds)",
    ]


def test_a_ranking_at_two_budgets_is_set_side_by_side_with_kendalls_tau(tmp_path: Path) -> None:
    from posenc.report.budgets import budget_tables

    results = []
    for steps, ppls in ((600, {"alibi": 5.0, "t5": 4.0, "nope": 6.0, "rope": 4.5}),
                        (2400, {"alibi": 4.0, "t5": 3.5, "nope": 5.0, "rope": 3.0})):  # fmt: skip
        for label, ppl in ppls.items():
            for seed in (0, 1):
                rows = [
                    {"length": 32 * m, "mode": "nonoverlap", "stride": None, "error": None, "ppl": ppl * m**0.1,
                     "ratio": m**0.1}
                    for m in (1, 2)
                ]  # fmt: skip
                config = {"trainer": {"max_steps": steps}}
                result = {"label": label, "train_len": 32, "seed": seed, "perplexity": rows, "config": config}
                results.append(result | {"eval": {"mode": "nonoverlap", "stride": None}, "training": {"steps": steps}})
    text = "\n".join(budget_tables(results))
    assert "## Rankings by budget, trained at L=32 — nonoverlapping windows" in text
    row = next(line for line in text.splitlines() if line.startswith("| rope |"))
    assert row.startswith("| rope | 2/2 | 4.500 (2) | 3.000 (1) |")
    assert (
        "1×: Kendall's τ between 600 and 2400 steps = 0.67 (4 schemes; no interval: a scheme has 2 seeds at a budget, "
        "fewer than 3)." in text
    )
    # the same difference in both seeds: the one swap (rope and t5) is separated at both budgets
    assert "Pairs whose order differs: rope and t5 (separated at both budgets)." in text


def _budget_runs(steps: int, seeds: dict[str, list[float]]) -> list[dict]:
    runs = []
    for label, ppls in seeds.items():
        for seed, ppl in enumerate(ppls):
            rows = [{"length": 32, "mode": "nonoverlap", "stride": None, "error": None, "ppl": ppl, "ratio": 1.0}]
            runs.append(
                {"label": label, "train_len": 32, "seed": seed, "perplexity": rows, "training": {"steps": steps}}
                | {"eval": {"mode": "nonoverlap", "stride": None}}
            )
    return runs


def test_a_swap_within_the_seeds_spread_is_told_from_one_the_budget_made() -> None:
    from posenc.report.budgets import budget_tables

    # alibi and nope swap by far more than their seeds spread; t5 and rope swap by a hair inside it
    results = _budget_runs(600, {"alibi": [4.0, 4.1, 4.05], "nope": [6.0, 6.1, 6.05], "t5": [5.0, 5.6, 5.3],
                                 "rope": [5.2, 5.4, 5.35]})  # fmt: skip
    results += _budget_runs(2400, {"alibi": [4.0, 4.1, 4.05], "nope": [3.0, 3.1, 3.05], "t5": [4.6, 5.0, 4.8],
                                   "rope": [4.5, 5.1, 4.7]})  # fmt: skip
    line = next(line for line in budget_tables(results) if line.startswith("- 1×"))
    assert "alibi and nope (separated at both budgets)" in line
    assert "rope and t5 (separated at neither budget)" in line
    low, high = (float(x) for x in line.split("interval over seeds ")[1].split(",")[0].split(" to "))
    assert low < high  # the seeds' spread reaches τ


def test_a_swap_with_one_seed_at_a_budget_is_not_called_separated() -> None:
    from posenc.report.budgets import budget_tables

    # one seed at 2,400 steps: no spread to test a difference against, however large it looks
    results = _budget_runs(600, {"alibi": [4.0, 4.1], "nope": [6.0, 6.1], "rope": [5.0, 5.2]})
    results += _budget_runs(2400, {"alibi": [4.0], "nope": [3.0], "rope": [3.5]})
    line = next(line for line in budget_tables(results) if line.startswith("- 1×"))
    assert "no interval: a scheme has 1 seed at a budget" in line
    assert "alibi and nope (too few shared seeds to test at 2400 steps)" in line


def test_a_budget_below_a_tenth_of_a_token_a_parameter_is_not_said_as_zero() -> None:
    def run(tokens_per_parameter: float) -> dict:
        return {"eval": {"split": "validation"}, "budget": {"tokens_per_parameter": tokens_per_parameter}}

    assert scored_on({"alibi": [run(0.0123)]}).endswith("trained for 0.012 tokens a parameter.")
    both = scored_on({"alibi": [run(0.0123)], "nope": [run(28.04)]})
    assert both.endswith("trained for 0.012–28 tokens a parameter.")
