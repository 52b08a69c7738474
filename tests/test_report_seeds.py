"""The report's seed statistics, effective-length table, cost-vs-extrapolation points and paired comparison.

Every expected figure is computed by hand from the hand-built run directories below: three schemes × three seeds
trained at L=32 and evaluated at 32 and 64, each with a ``run.json`` giving its tokens and training seconds.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posenc.report import build_report, find_results
from posenc.report.cost import cost_points, log_cost_scatter, throughput
from posenc.report.paired import paired_section
from posenc.report.perplexity import group_runs

# {scheme: ([ppl at 32 per seed], [ppl at 64 per seed], tokens per second)}
RUNS = {
    "nope": ([10.0, 12.0, 14.0], [40.0, 44.0, 48.0], 1000.0),
    "alibi": ([10.0, 11.0, 12.0], [20.0, 21.0, 22.0], 900.0),
    "rope": ([11.0, 12.0, 13.0], [22.0, 24.0, 26.0], 800.0),
}


def _run(root: Path, label: str, seed: int, ppl: tuple[float, float], speed: float, **extra) -> Path:
    folder = root / f"{label}_{seed}"
    rows = [
        {"length": 32 * m, "mode": "nonoverlap", "stride": None, "tokens": 2048, "loss": math.log(p), "ppl": p,
         "bpb": 1.0, "error": None, "multiple": m, "ratio": p / ppl[0]}
        for m, p in zip((1, 2), ppl, strict=True)
    ]  # fmt: skip
    result = {
        "label": label,
        "train_len": 32,
        "seed": seed,
        "eval": {"mode": "nonoverlap", "stride": None, "multiples": [1, 2]},
        "perplexity": rows,
        "loss_by_position": {},
        **extra,
    }
    (folder / "eval").mkdir(parents=True)
    (folder / "eval" / "results.json").write_text(json.dumps(result))
    (folder / "run.json").write_text(json.dumps({"steps": 10, "tokens": 10 * speed, "train_seconds": 10.0}))
    return folder


def _sweep(root: Path, schemes: tuple[str, ...] = ("nope", "alibi", "rope"), **extra_by_run) -> Path:
    for label in schemes:
        short, long, speed = RUNS[label]
        for seed in range(3):
            _run(root, label, seed, (short[seed], long[seed]), speed, **extra_by_run.get(f"{label}_{seed}", {}))
    return root


def _row(markdown: str, length: int, which: int = 0) -> list[str]:
    rows = [line for line in markdown.splitlines() if line.startswith(f"| {length} | ")]
    return [cell.strip() for cell in rows[which].strip("|").split("|")[2:]]


def _paired_p(a: list[float], b: list[float]) -> float:
    """Two-sided p of the paired t-test on log values over 3 seeds: 1 − t / √(t² + 2) with 2 degrees of freedom."""
    d = [math.log(x) - math.log(y) for x, y in zip(a, b, strict=True)]
    mean = sum(d) / 3
    t = mean / math.sqrt(sum((x - mean) ** 2 for x in d) / 2 / 3)
    return 1 - abs(t) / math.sqrt(t * t + 2)


T_975_2 = 4.302653  # Student's t, 2 degrees of freedom


def _seeds_only(values: list[float], digits: int = 2) -> str:
    """A cell over seeds alone, by hand: exp of the mean log and of its t interval over 3 seeds, marked ᵗ."""
    logs = [math.log(v) for v in values]
    mean = sum(logs) / 3
    half = T_975_2 * math.sqrt(sum((x - mean) ** 2 for x in logs) / 2 / 3)
    return f"{math.exp(mean):.{digits}f} [{math.exp(mean - half):.{digits}f}, {math.exp(mean + half):.{digits}f}]ᵗ"


def test_cells_without_documents_are_over_seeds_said_so_and_marks_are_words_from_holm_tests(tmp_path: Path) -> None:
    # These runs did not record their loss per document: only the seeds vary, and every cell says so (ᵗ).
    markdown = build_report(find_results([_sweep(tmp_path / "runs")]), tmp_path / "out", make_plots=False)
    assert "over seeds only, where runs did not record their loss per document" in markdown
    assert "Holm-adjusted over the row" in markdown and "not separated is not equal" in markdown
    # at 32: alibi (10, 11, 12) is best; nope (10, 12, 14) and rope (11, 12, 13) overlap it, but rope is above it
    # on every seed by a steady margin, which pairing sees: p 0.0025 → Holm 0.0051, separated; nope p 0.213, and
    # nowhere near within ±1%: inconclusive, not "equal"
    p_rope, p_nope = _paired_p([11, 12, 13], [10, 11, 12]), _paired_p([10, 12, 14], [10, 11, 12])
    assert (round(p_rope, 4), round(p_nope, 3)) == (0.0025, 0.213) and 2 * p_rope < 0.05 < p_nope
    alibi, nope, rope = _row(markdown, 32)
    assert alibi == _seeds_only([10, 11, 12]) + " ◆" == "10.97 [8.75, 13.76]ᵗ ◆"
    assert nope == _seeds_only([10, 12, 14]) + " ?" and rope == _seeds_only([11, 12, 13]) + " ✓"
    # at 64 both are separated: nope p 0.0012 (Holm 0.0023), rope p 0.0238 (Holm max(0.0023, 0.0238))
    assert _paired_p([22, 24, 26], [20, 21, 22]) == pytest.approx(0.0238, abs=1e-4)
    alibi, nope, rope = _row(markdown, 64)
    assert (alibi, nope, rope) == (_seeds_only([20, 21, 22]) + " ◆", _seeds_only([40, 44, 48]) + " ✓",
                                   _seeds_only([22, 24, 26]) + " ✓")  # fmt: skip
    assert _row(markdown, 32, which=1) == ["1"] * 3  # ratios at 1× are 1 by construction: no test
    # ratios at 2×, each against 1: rope's is 2 on every seed (no spread: separated, p 0); all far from ±1% of 1
    alibi, nope, rope = _row(markdown, 64, which=1)
    assert alibi == _seeds_only([2, 21 / 11, 22 / 12], 3) + " ✓" and rope == "2.000 [2.000, 2.000]ᵗ ✓"
    assert nope.endswith(" ✓") and "flat" in markdown


def test_a_column_without_two_seeds_shared_with_the_best_is_not_tested(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    _sweep(root, ("alibi",))
    _run(root, "rope", 0, (11.0, 20.5), 800.0)  # one seed, below alibi's: the best, but nothing to pair
    markdown = build_report(find_results([root]), tmp_path / "out", make_plots=False)
    alibi, rope = _row(markdown, 64)
    assert rope == "20.50ᵗ ◆" and alibi == _seeds_only([20, 21, 22])  # one shared seed, no documents: no word
    assert "no mark: not tested" in markdown


def test_two_runs_of_one_seed_count_once_the_newest_kept_and_said(tmp_path: Path) -> None:
    root = _sweep(tmp_path / "runs", ("alibi",))
    again = _run(root / "again", "alibi", 0, (13.0, 26.0), 900.0)  # seed 0 run a second time, later
    (again / "done.json").write_text(json.dumps({"finished_at": "2026-11-28T12:00:00+0000"}))
    (root / "alibi_0" / "done.json").write_text(json.dumps({"finished_at": "2026-11-27T12:00:00+0000"}))
    markdown = build_report(find_results([root]), tmp_path / "out", make_plots=False)
    assert "## Seeds counted once (1 seed(s) run more than once)" in markdown
    assert f"alibi seed 0 (eval): 2 runs, counted once: kept {again}, left out {root / 'alibi_0'}" in markdown
    assert "(n=3" in markdown and "(n=4" not in markdown
    (alibi,) = _row(markdown, 32)
    assert alibi == _seeds_only([13, 11, 12]) + " ◆"  # the newest run of seed 0, once


def test_effective_length_tables_name_their_rule_and_count_every_seed(tmp_path: Path) -> None:
    # alibi seed 0 recorded 64 under the older, relative-only record; every other run is computed by the rule
    root = _sweep(tmp_path / "runs", alibi_0={"effective_length": {"ppl": 64}})
    markdown = build_report(find_results([root]), tmp_path / "out", make_plots=False)
    absolute = markdown.index("## Effective length, trained at L=32 on text, nonoverlapping windows — absolute rule")
    relative = markdown.index("## Effective length, trained at L=32 on text, nonoverlapping windows — relative rule")
    assert absolute < relative and "ppl ≤ 12.1 (perplexity: 1.1× the best in-length perplexity" in markdown

    def cells(start: int) -> list[str]:
        row = next(line for line in markdown[start:].splitlines() if line.startswith("| ppl | "))
        return [cell.strip() for cell in row.strip("|").split("|")[1:]]

    # absolute: 1.1 × alibi's mean in-length 11 = 12.1; nope's 14 and rope's 13 (their seed 2) never hold
    assert cells(absolute) == ["32 (3 of 3 seeds)", "32 (2 of 3 seeds; 1 without)", "32 (2 of 3 seeds; 1 without)"]
    # relative: every ratio at 64 is ≥ 1.69 > 1.10, so 32, but for the recorded 64
    assert cells(relative) == ["32 [32–64] (3 of 3 seeds)", "32 (3 of 3 seeds)", "32 (3 of 3 seeds)"]


def test_cost_points_are_throughput_relative_to_nope_and_the_ratio_at_the_longest_length(tmp_path: Path) -> None:
    results = find_results([_sweep(tmp_path / "runs")])
    (by_label,) = group_runs(results).values()
    points, against = cost_points(by_label)
    assert against == "NoPE"
    by_name = {p["label"]: p for p in points}
    assert by_name["alibi"]["throughput"] == pytest.approx(0.9) and by_name["rope"]["throughput"] == pytest.approx(0.8)
    ratios = [20 / 10, 21 / 11, 22 / 12]  # alibi's per-seed ratio at 64
    mean = sum(ratios) / 3
    sd = math.sqrt(sum((r - mean) ** 2 for r in ratios) / 2)
    assert by_name["rope"]["ratio"] == pytest.approx(2.0) and by_name["rope"]["half_width"] == pytest.approx(0.0)
    assert by_name["alibi"]["ratio"] == pytest.approx(mean)
    assert by_name["alibi"]["half_width"] == pytest.approx(4.302653 * sd / math.sqrt(3), rel=1e-5)
    assert {p["n"] for p in points} == {3} and {p["length"] for p in points} == {64}
    build_report(results, tmp_path / "out")
    assert (tmp_path / "out" / "cost_vs_extrapolation_L32_nonoverlap.png").stat().st_size > 0
    assert (
        "![cost_vs_extrapolation_L32_nonoverlap](cost_vs_extrapolation_L32_nonoverlap.png)"
        in (tmp_path / "out" / "report.md").read_text()
    )


def test_without_nope_throughput_is_relative_to_the_fastest_and_says_so(tmp_path: Path) -> None:
    (by_label,) = group_runs(find_results([_sweep(tmp_path / "runs", ("alibi", "rope"))])).values()
    points, against = cost_points(by_label)
    assert "fastest column (alibi" in against and "no NoPE" in against
    assert [p["throughput"] for p in points] == pytest.approx([1.0, 800 / 900])


def test_a_resumed_run_recorded_before_it_carried_its_earlier_seconds_gives_no_throughput(tmp_path: Path) -> None:
    # An older run.json of a run resumed at its last step: 600 steps' tokens over the 2.4 s of the process that only
    # evaluated. Read as a throughput it would be 200x the others'; it is no throughput at all.
    root = _sweep(tmp_path / "runs")
    stale = {"steps": 600, "tokens": 1_228_800, "train_seconds": 2.44, "resumed_from": {"step": 600}}
    (root / "alibi_0" / "run.json").write_text(json.dumps(stale))
    carried = stale | {"train_seconds": 200.0, "segment": {"from_step": 600, "steps": 0}}  # today's record
    (root / "alibi_1" / "run.json").write_text(json.dumps(carried))
    speeds = {run["seed"]: throughput(run) for run in find_results([root]) if run["label"] == "alibi"}
    assert speeds[0] is None and speeds[1] == pytest.approx(1_228_800 / 200.0) and speeds[2] == pytest.approx(900.0)


def test_paired_comparison_matches_seeds_on_log_perplexity(tmp_path: Path) -> None:
    lines = paired_section(find_results([_sweep(tmp_path / "runs")]), "alibi", "rope")
    row = next(line for line in lines if line.startswith("| 64 | "))
    # log(alibi / rope) per seed: log(20/22), log(21/24), log(22/26); the ratio is exp of their mean, its interval
    # exp(mean ± t_{0.975,2} · s / √3), over seeds only (no documents recorded); it detects (t.975 + t.8) · s / √3
    d = [math.log(20 / 22), math.log(21 / 24), math.log(22 / 26)]
    mean = sum(d) / 3
    error = math.sqrt(sum((x - mean) ** 2 for x in d) / 2 / 3)
    low, high = math.exp(mean - T_975_2 * error), math.exp(mean + T_975_2 * error)
    detects = math.expm1((T_975_2 + 1.060660) * error)  # t_{0.8, 2} = 1.0607
    expected = (
        f"| 64 | 2 | {math.exp(mean):.4f} [{low:.4f}, {high:.4f}]ᵗ | {_paired_p([20, 21, 22], [22, 24, 26]):.3g} "
        f"| separated | ±{detects:.1%} |"
    )
    assert row == expected == "| 64 | 2 | 0.8764 [0.8016, 0.9581]ᵗ | 0.0238 | separated | ±11.8% |"


def test_paired_comparison_refuses_mismatched_seeds_in_one_line(tmp_path: Path) -> None:
    root = _sweep(tmp_path / "runs", ("alibi",))
    for seed in (0, 1, 5):
        _run(root, "rope", seed, (12.0, 24.0), 800.0)
    with pytest.raises(SystemExit, match="seeds differ"):
        paired_section(find_results([root]), "alibi", "rope")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(
        [sys.executable, "-m", "posenc.report", str(root), "--no-plots", "--paired", "alibi", "rope"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "cannot pair 'alibi' with 'rope': their seeds differ (['0', '1', '2'] vs ['0', '1', '5'], each seed once on "
        "both sides is needed)"
    ]


def test_the_same_points_go_to_wandb_as_a_scatter(tmp_path: Path) -> None:
    results = find_results([_sweep(tmp_path / "runs")])

    class Run:
        def __init__(self) -> None:
            self.logged: dict = {}

        def log(self, data: dict) -> None:
            self.logged.update(data)

    run = Run()
    log_cost_scatter(results, run)
    (chart,) = run.logged.values()
    (by_label,) = group_runs(results).values()
    points, _ = cost_points(by_label)
    assert list(run.logged) == ["report/cost_vs_extrapolation_L32_nonoverlap"]
    assert chart.table.columns[:3] == ["label", "throughput", "ratio"]
    assert [row[:3] for row in chart.table.data] == [[p["label"], p["throughput"], p["ratio"]] for p in points]
    assert [row[0] for row in chart.table.data] == ["alibi", "nope", "rope"]


def test_retrieval_tables_show_accuracy_intervals_inside_zero_one_and_who_learned(tmp_path: Path) -> None:
    """Task accuracies get a bootstrap over seeds (never past 0 or 1), the floors, and k of n seeds learned."""
    for label, exact, first in (("alibi", [0.9, 0.92, 0.94], [0.95, 0.96, 0.97]), ("rope", [0.3, 0.7, 1.0], [0.6] * 3)):
        for seed in range(3):
            rows = [
                {"task": "multikey", "length": 32, "samples": 64, "answers": 64, "accuracy": exact[seed],
                 "first_byte_accuracy": first[seed], "token_accuracy": first[seed], "chance_exact": 0.01,
                 "chance_first_byte": 0.1, "keyless_exact": 0.46, "keyless_first_byte": 0.46}
            ]  # fmt: skip
            folder = tmp_path / f"{label}_{seed}" / "eval"
            folder.mkdir(parents=True)
            result = {"label": label, "train_len": 32, "seed": seed, "multikey": rows, "data": {"task": "multikey"}}
            (folder / "results.json").write_text(json.dumps(result))
    markdown = build_report(find_results([tmp_path]), tmp_path / "out", make_plots=False)
    assert "(chance: 0.01, a uniform guess; 0.46 without matching keys)" in markdown
    assert "95% percentile bootstrap over the seeds" in markdown
    exact = _row(markdown, 32)
    low, high = (float(x) for x in exact[1].split("[")[1].rstrip("]").split(", "))
    assert exact[0].startswith("0.92 [") and exact[1].startswith("0.67 [") and 0.3 <= low < high <= 1.0
    assert "±" not in " ".join(exact)  # no symmetric interval that could pass 1
    learned = next(line for line in markdown.splitlines() if line.startswith("| learned |"))
    assert learned == "| learned | | 3 of 3 | 2 of 3 |"  # rope seed 0 (0.30) is under the keyless floor
    assert "| 0 | 0.90 | 0.30 |" in markdown and "| 2 | 0.94 | 1.00 |" in markdown  # each seed's accuracy
