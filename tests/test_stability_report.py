"""The stability section on hand-built runs: Wortsman et al.'s sensitivity by hand, the highest stable rate, spikes
per thousand steps, a diverged run counted as diverged (read from its failed.json), and the study's sweeps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_sweeps import LIST_JOBS, SWEEPS, launch

from posenc.report.build import build_report
from posenc.report.collect import find_results
from posenc.report.stability import grid, stability_section, summary
from posenc.runs import write_failed

START = 5.5  # every run's first-step loss


def _config(scheme: str, lr: float, seed: int = 10) -> dict:
    return {"encoding": {"name": scheme}, "optim": {"lr": lr}, "seed": seed, "run_name": f"{scheme}-lr{lr}-s{seed}"}


def _stability(loss_spikes: int = 0, grad_norm_spikes: int = 0, steps: int = 600) -> dict:
    return {
        "steps": steps,
        "initial_loss": START,
        "loss_spikes": loss_spikes,
        "grad_norm_spikes": grad_norm_spikes,
        "grad_norm": {"p50": 0.5, "p90": 0.8, "p99": 1.2, "max": 2.0},
        "max_attention_logit": {"max": 9.0, "at_step": 600, "last": 8.0, "samples": 12},
    }


def _run(scheme: str, lr: float, loss: float, seed: int = 10, **spikes: int) -> dict:
    config = _config(scheme, lr, seed)
    return {
        "label": scheme,
        "encoding": config["encoding"],
        "config": config,
        "seed": seed,
        "eval": {"split": "validation"},
        "perplexity": [{"multiple": 1, "loss": loss, "ppl": 2.0**loss, "error": None}],
        "stability": _stability(**spikes),
    }


def _diverged(scheme: str, lr: float, seed: int = 10) -> dict:
    config = _config(scheme, lr, seed)
    return {"failed": "the training loss became nan at step 40", "run_name": config["run_name"], "config": config,
            "label": scheme, "stability": _stability(steps=41)}  # fmt: skip


RUNS = [
    _run("alibi", 1e-3, 2.0, loss_spikes=1),
    _run("alibi", 2e-3, 1.8, grad_norm_spikes=3),
    _run("alibi", 4e-3, 2.5, loss_spikes=2),
    _diverged("alibi", 8e-3),
    _run("rope", 1e-3, 1.9),
    _run("rope", 2e-3, 6.0),  # ended worse than it started: unstable, capped at the loss at initialisation
    _run("nope", 1e-3, 2.2),
    _run("nope", 2e-3, 2.1),
    _run("nope", 2e-3, 2.3, seed=11),
    _diverged("nope", 2e-3, seed=12),  # one seed of three diverged: the rate is not stable
]


def test_sensitivity_is_the_mean_excess_capped_loss_over_the_rates() -> None:
    summaries = {label: summary(by_rate) for label, by_rate in grid(RUNS).items()}
    alibi, rope, nope = summaries["alibi"], summaries["rope"], summaries["nope"]
    # Capped losses 2.0, 1.8, 2.5 and 5.5 (diverged): excess over 1.8 is 0.2, 0, 0.7, 3.7.
    assert alibi["sensitivity"] == pytest.approx((0.2 + 0 + 0.7 + 3.7) / 4)
    assert (alibi["best_rate"], alibi["highest_stable"], alibi["reached_unstable"]) == (2e-3, 4e-3, True)
    assert alibi["loss_spikes_per_1k"] == pytest.approx(1000 * 3 / 1800)  # over its three stable runs
    assert alibi["grad_norm_spikes_per_1k"] == pytest.approx(1000 * 3 / 1800)
    assert rope["sensitivity"] == pytest.approx((0 + (START - 1.9)) / 2) and rope["highest_stable"] == 1e-3
    # nope at 2e-3: the mean of 2.1, 2.3 and 5.5 (diverged); at 1e-3: 2.2, the best.
    assert nope["sensitivity"] == pytest.approx((0 + ((2.1 + 2.3 + START) / 3 - 2.2)) / 2)
    assert nope["highest_stable"] == 1e-3


def test_the_section_ranks_schemes_and_says_where_the_grid_stops_short() -> None:
    lines = stability_section([*RUNS, _run("t5", 1e-3, 2.0), _run("t5", 2e-3, 1.9)])
    table = [line for line in lines if line.startswith("| ") and "nats" not in line and "rate |" not in line]
    # Over the rates every scheme ran (1e-3, 2e-3): t5 0.05, alibi 0.1, nope 0.55, rope 1.8, the least sensitive
    # first; alibi's highest stable rate still reads its every rate (4e-3, and 8e-3 diverged).
    assert [row.split(" | ")[0] for row in table[:4]] == ["| t5", "| alibi", "| nope", "| rope"]
    assert "| alibi | 0.100 | 0.002 | 0.004 | yes |" in "\n".join(lines)
    assert "over the 2 rates every scheme ran (0.001, 0.002)" in "\n".join(lines)
    assert "| t5 | 0.050 | 0.002 | 0.002 | no, up to 0.002: a lower bound |" in "\n".join(lines)
    assert "| 0.008 | 1 | 1 | 5.5000 | no | 0 | 0 | 1.2 | 9 |" in "\n".join(lines)  # alibi's diverged rate, counted


def test_a_diverged_run_reaches_the_section_from_its_records(tmp_path: Path) -> None:
    for run in RUNS[:3]:
        folder = tmp_path / run["config"]["run_name"]
        (folder / "eval").mkdir(parents=True)
        results = {key: value for key, value in run.items() if key != "stability"}
        (folder / "eval" / "results.json").write_text(json.dumps({**results, "train_len": 64}))
        (folder / "run.json").write_text(json.dumps({"stability": run["stability"]}))
    diverged = RUNS[3]
    (tmp_path / diverged["run_name"]).mkdir()
    details = {"label": "alibi", "diverged": True, "stability": diverged["stability"]}
    write_failed(tmp_path / diverged["run_name"], diverged["config"], diverged["failed"], 40, details)
    markdown = build_report(find_results([tmp_path]), tmp_path / "report", make_plots=True, stability_only=True)
    assert "## Failed runs (1, counted as diverged in the stability tables)" in markdown
    assert f"| alibi | {(0.2 + 0 + 0.7 + 3.7) / 4:.3f} | 0.002 | 0.004 | yes |" in markdown
    assert (tmp_path / "report" / "stability_loss_vs_lr.png").is_file()


def _jobs(tmp_path: Path, name: str, *overrides: str) -> set[str]:
    result = launch(
        tmp_path, command=[sys.executable, "-c", LIST_JOBS, "-m", "-cd", str(SWEEPS), "-cn", name, *overrides]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return {Path(line.split()[1]).name for line in result.stdout.splitlines() if line.startswith("JOB ")}


RATES = ("0.001", "0.002", "0.004", "0.008", "0.016", "0.032", "0.064", "0.128", "0.256")


def test_the_stability_grid_extends_the_tuning_upward_at_each_schemes_multiplier(tmp_path: Path) -> None:
    schemes = ("alibi", "rope", "nope", "fox", "stick_breaking_trained")
    assert _jobs(tmp_path, "stability") == {f"{s}-lr{lr}-x1-L64-s10" for s in schemes for lr in RATES}
    assert _jobs(tmp_path, "stability", "+encoding=t5", "optim.scheme_lr_multiplier=100") == {
        f"t5-lr{lr}-x100-L64-s10" for lr in RATES
    }


def test_the_sink_study_crosses_three_sinks_with_four_schemes_on_the_comparisons_recipe(tmp_path: Path) -> None:
    tags = {"none": "", "learned": "-sink_learned", "tokens": "-sink_tokens"}
    schemes = ("alibi", "rope", "nope", "kerple_log")
    expected = {f"{s}{tag}-L64-s{seed}" for s in schemes for tag in tags.values() for seed in range(5)}
    assert _jobs(tmp_path, "sinks") == expected
    from omegaconf import OmegaConf

    command = [sys.executable, "-m", "posenc.train", "-cd", str(SWEEPS), "-cn", "sinks", "+encoding=alibi"]
    printed = subprocess.run([*command, "model.sink=tokens", "--cfg", "job"], capture_output=True, text=True,
                             timeout=120, check=True).stdout  # fmt: skip
    composed = OmegaConf.create(printed)
    assert composed.model.sink == "tokens" and composed.model.sink_tokens == 1 and composed.eval.attention_stats
    assert composed.eval.split == "test" and list(composed.eval.sliding_fractions) == [0.5]
    assert composed.optim.tuned == "docs/results/tuning/selection.json" and composed.trainer.max_steps == 600


def _grid_runs(scheme: str, curve: list[float], seeds: dict[int, int], noise: float, rng) -> list[dict]:
    """A scheme's runs over RATES_F: seed noise added to its true curve; ``seeds``: extra seeds at a rate's index."""
    runs = []
    for index, (rate, true) in enumerate(zip(RATES_F, curve, strict=True)):
        for seed in range(10, 11 + seeds.get(index, 0)):
            runs.append(_run(scheme, rate, true + float(rng.normal(0, noise)), seed=seed))
    return runs


RATES_F = (1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2)


def test_a_pair_of_sensitivities_earns_its_words_from_the_pooled_seed_noise() -> None:
    from posenc.report.stability import MARGIN, _weights, comparisons, seed_noise

    runs = [  # two seeds more at the last rate of each: the seed noise comes from there
        *(_run("alibi", rate, loss) for rate, loss in zip(RATES_F, (2.0, 1.9, 1.8, 1.9, 2.1), strict=True)),
        _run("alibi", 1.6e-2, 2.2, seed=11), _run("alibi", 1.6e-2, 2.0, seed=12),
        *(_run("rope", rate, loss) for rate, loss in zip(RATES_F, (2.0, 1.9, 1.8, 3.0, 4.0), strict=True)),
        _run("rope", 1.6e-2, 4.1, seed=11), _run("rope", 1.6e-2, 3.9, seed=12),
    ]  # fmt: skip
    by_scheme = grid(runs)
    variance, df, rate = seed_noise(by_scheme).variance(1e-3)  # no replicates there: the nearest measured rate's
    assert df == 4 and variance == pytest.approx(0.01) and rate == 1.6e-2  # each edge: 2.1, 2.2, 2.0 and 4.0, 4.1, 3.9
    # k = 5 rates, 1 + 1 + 1 + 1 + 3 runs, the best (4e-3) one run: (4 + 1/3) / 25 + 1 − 2 / 5
    assert sum(_weights(by_scheme["alibi"], 4e-3).values()) == pytest.approx((4 + 1 / 3) / 25 + 1 - 2 / 5)
    (row,), _ = comparisons(by_scheme)
    alibi = (0.2 + 0.1 + 0 + 0.1 + 0.3) / 5  # the last rate's mean is 2.1
    rope = (0.2 + 0.1 + 0 + 1.2 + 2.2) / 5
    assert row["name"] == "alibi vs rope" and row["difference"] == pytest.approx(alibi - rope)
    assert row["words"] == ("separated",) and row["interval"][1] < -MARGIN
    lines = "\n".join(stability_section(runs))
    assert "with more than one seed there: 0.1000 at 0.016 (4 df); a rate without" in lines
    assert "| alibi vs rope | -0.600 |" in lines


def test_the_seed_noise_is_each_rates_own_and_the_degrees_of_freedom_satterthwaites() -> None:
    from posenc.report.stability import _weights, comparisons, difference_error, seed_noise

    runs = [  # three seeds at the best rate (quiet) and at the top (loud); single runs between them
        *(_run("a", rate, loss) for rate, loss in zip(RATES_F, (2.0, 1.9, 1.8, 1.9, 2.1), strict=True)),
        _run("a", 4e-3, 1.81, seed=11), _run("a", 4e-3, 1.79, seed=12),
        _run("a", 1.6e-2, 2.3, seed=11), _run("a", 1.6e-2, 1.9, seed=12),
        *(_run("b", rate, loss) for rate, loss in zip(RATES_F, (2.0, 1.9, 1.8, 1.9, 2.1), strict=True)),
        _run("b", 4e-3, 1.8, seed=11), _run("b", 4e-3, 1.8, seed=12),
    ]  # fmt: skip
    by_scheme = grid(runs)
    noise = seed_noise(by_scheme)
    quiet, loud = 0.01**2 * 2 / 4, 0.2**2 * 2 / 2  # 4e-3: a's 1.8 ± 0.01, b's no spread; 1.6e-2: a's 2.1 ± 0.2
    assert noise.variance(4e-3) == (pytest.approx(quiet), 4, 4e-3)
    assert noise.variance(1.6e-2) == (pytest.approx(loud), 2, 1.6e-2)
    assert noise.variance(1e-3) == (pytest.approx(quiet), 4, 4e-3)  # below the lowest measured rate: that one's
    assert noise.variance(8e-3) == (pytest.approx(loud), 2, 1.6e-2)  # between two: the larger σ
    weights = [_weights(by_scheme[x], 4e-3) for x in ("a", "b")]
    # Each scheme: 1/k² = 1/25 at the three single rates, (1/5 − 1)² / 3 at the best; at the top a's 1/25/3 and b's
    # 1/25, both at the top's own σ (b ran one seed there, a three); 1e-3 and 2e-3 at the quiet σ, 8e-3 the loud.
    best, top_a, top_b, single = (0.2 - 1) ** 2 / 3, 1 / 75, 1 / 25, 1 / 25
    pieces = {"quiet": (2 * best + 4 * single) * quiet, "loud": (top_a + top_b + 2 * single) * loud}
    se, df = difference_error(weights, noise)
    assert se == pytest.approx(sum(pieces.values()) ** 0.5)
    assert df == pytest.approx(sum(pieces.values()) ** 2 / (pieces["quiet"] ** 2 / 4 + pieces["loud"] ** 2 / 2))
    (row,), _ = comparisons(by_scheme)
    assert row["interval"][1] - row["interval"][0] > 0


def test_equal_schemes_are_rarely_separated_and_close_ones_are_found_equivalent() -> None:
    """Simulated grids with a known truth: the false separations stay near α, equivalence is reachable."""
    import numpy as np

    from posenc.report.stability import comparisons

    rng = np.random.default_rng(0)
    curve, edges = [2.0, 1.9, 1.85, 1.9, 2.2], {3: 2, 4: 2}
    separated = equivalent = 0
    trials = 400
    for _ in range(trials):
        runs = [*_grid_runs("a", curve, edges, 0.004, rng), *_grid_runs("b", curve, edges, 0.004, rng)]
        (row,), _ = comparisons(grid(runs))
        separated += "separated" in row["words"]
        equivalent += "equivalent" in row["words"]
    assert separated / trials <= 0.08  # α = 0.05, with simulation error
    assert equivalent / trials >= 0.9  # σ = 0.004 nats against a margin of 0.02


def test_the_added_entries_are_tuned_by_the_tunings_own_grid_beside_its_runs(tmp_path: Path) -> None:
    grid_points = {f"lr{lr}-x{x}" for lr in RATES[:4] for x in (1, 10, 100)}
    expected = {f"{s}-{point}-L64-s10" for s in ("fope", "cable", "grape_a", "grape_m") for point in grid_points}
    assert _jobs(tmp_path, "tune_additions") == expected


def test_intervals_cover_when_the_seed_noise_grows_along_the_grid() -> None:
    """Quiet at the low rates (σ = 0.004), loud where the runs collapse (σ = 0.1): per-rate noise keeps 95% coverage."""
    import numpy as np

    from posenc.report.stability import comparisons

    rng = np.random.default_rng(1)
    curve, spread = [2.0, 1.9, 1.85, 2.3, 3.0], [0.004, 0.004, 0.004, 0.1, 0.1]

    def runs(scheme: str) -> list[dict]:  # three seeds at the best rate and at the top, one elsewhere
        return [
            _run(scheme, rate, true + float(rng.normal(0, sd)), seed=seed)
            for index, (rate, true, sd) in enumerate(zip(RATES_F, curve, spread, strict=True))
            for seed in range(10, 13 if index in (2, 4) else 11)
        ]

    covered = separated = 0
    trials = 400
    for _ in range(trials):
        (row,), _ = comparisons(grid([*runs("a"), *runs("b")]))
        low, high = row["interval"]
        covered += low <= 0 <= high
        separated += "separated" in row["words"]
    assert 0.92 <= covered / trials <= 0.98  # 95% intervals, with simulation error (1,000 draws: 95.9%)
    assert separated / trials <= 0.08
