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
from posenc.report.cost import cost_points, log_cost_scatter
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


def test_cells_show_the_student_t_interval_and_mark_cells_not_separated_from_the_best(tmp_path: Path) -> None:
    markdown = build_report(find_results([_sweep(tmp_path / "runs")]), tmp_path / "out", make_plots=False)
    assert "95% Student-t interval" in markdown and "◆ marks the best mean" in markdown
    # columns in registry order: alibi, nope, rope. Half-width t_{0.975,2} · s/√3 with t_{0.975,2} = 4.3027.
    alibi, nope, rope = _row(markdown, 64)
    assert alibi == f"21.00 ± {4.3027 * 1 / math.sqrt(3):.2f} ◆" == "21.00 ± 2.48 ◆"  # the best: lowest mean
    assert rope == "24.00 ± 4.97 ≈"  # [19.03, 28.97] overlaps alibi's [18.52, 23.48]
    assert nope == "44.00 ± 9.94"  # [34.06, 53.94]: separated from the best, no mark
    alibi, nope, rope = _row(markdown, 32)
    assert alibi == "11.00 ± 2.48 ◆" and nope == "12.00 ± 4.97 ≈" and rope == "12.00 ± 2.48 ≈"
    assert _row(markdown, 32, which=1) == ["1.000 ± 0.000"] * 3  # ratios at 1× are 1 by construction: no marks
    # ratios at 2×: alibi 2, 1.909, 1.833 (s 0.0834); nope 4, 3.667, 3.429 (s 0.2871); rope 2, 2, 2
    alibi, nope, rope = _row(markdown, 64, which=1)
    assert alibi == "1.914 ± 0.207 ◆" and nope == "3.698 ± 0.713" and rope == "2.000 ± 0.000 ≈"


def test_a_single_seed_column_shows_its_mean_alone_and_no_mark_against_an_interval(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    _sweep(root, ("alibi",))
    _run(root, "rope", 0, (11.0, 20.5), 800.0)  # one seed, mean below alibi's: the best, but without an interval
    markdown = build_report(find_results([root]), tmp_path / "out", make_plots=False)
    alibi, rope = _row(markdown, 64)
    assert rope == "20.50 ◆" and alibi == "21.00 ± 2.48"  # alibi's overlap with a one-seed best is unknown
    assert "one seed gives no interval" in markdown


def test_effective_length_table_pools_recorded_and_computed_lengths(tmp_path: Path) -> None:
    # alibi seed 0 recorded 64 (the report reads it as recorded); every other run has no record, so the rule
    # computes it: every ratio at 64 is ≥ 1.69 > 1.10, so 32.
    root = _sweep(tmp_path / "runs", alibi_0={"effective_length": {"ppl": 64}})
    markdown = build_report(find_results([root]), tmp_path / "out", make_plots=False)
    assert "## Effective length, trained at L=32" in markdown
    row = next(line for line in markdown.splitlines() if line.startswith("| ppl | "))
    alibi, nope, rope = (cell.strip() for cell in row.strip("|").split("|")[1:])
    assert alibi == "32 [32–64] (n=3)" and nope == "32 (n=3)" and rope == "32 (n=3)"


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


def test_paired_comparison_matches_seeds_and_gives_the_t_interval_and_p(tmp_path: Path) -> None:
    lines = paired_section(find_results([_sweep(tmp_path / "runs")]), "alibi", "rope")
    row = next(line for line in lines if line.startswith("| 64 | "))
    # differences alibi − rope per seed: −2, −3, −4 → mean −3, s = 1, half-width 4.3027/√3 = 2.484;
    # t = −3/(1/√3) = −5.196, and for 2 degrees of freedom P(|T| ≤ t) = t/√(2 + t²), so p = 1 − 5.196/√29 = 0.0351.
    assert row == "| 64 | 2 | -3.000 | [-5.484, -0.516] | 0.0351 |"


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


def test_retrieval_tables_show_intervals_first_byte_accuracy_and_chance(tmp_path: Path) -> None:
    """Task accuracies get the same intervals and marks as perplexity (higher is better), with the chance rates."""
    for label, exact, first in (("alibi", [0.9, 0.92, 0.94], [0.95, 0.96, 0.97]), ("rope", [0.5, 0.7, 0.9], [0.6] * 3)):
        for seed in range(3):
            rows = [
                {"task": "assoc", "length": 32, "samples": 8, "answers": 64, "accuracy": exact[seed],
                 "first_byte_accuracy": first[seed], "token_accuracy": first[seed], "chance_exact": 0.01,
                 "chance_first_byte": 0.1, "keyless_exact": 0.46, "keyless_first_byte": 0.46}
            ]  # fmt: skip
            folder = tmp_path / f"{label}_{seed}" / "eval"
            folder.mkdir(parents=True)
            result = {"label": label, "train_len": 32, "seed": seed, "assoc": rows, "data": {"task": "assoc"}}
            (folder / "results.json").write_text(json.dumps(result))
    markdown = build_report(find_results([tmp_path]), tmp_path / "out", make_plots=False)
    floors = "a uniform guess; 0.46 without matching keys"
    assert f"Exact match (the whole answer right) (chance: 0.01, {floors}):" in markdown
    assert f"First answer byte right (chance: 0.1, {floors}):" in markdown
    exact_row, first_row, per_byte_row = (_row(markdown, 32, which) for which in range(3))
    # alibi: s = 0.02, half-width 4.3027 · 0.02 / √3 = 0.0497; rope: s = 0.2, 0.497: [0.20, 1.20] overlaps alibi's
    assert exact_row == ["0.92 ± 0.05 ◆", "0.70 ± 0.50 ≈"]
    assert first_row == ["0.96 ± 0.02 ◆", "0.60 ± 0.00"] == per_byte_row  # rope's [0.6, 0.6] is separated
