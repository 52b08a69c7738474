"""Whether a ranking holds at a second budget: each scheme's rank at every training budget, side by side.

Why: at a budget far from convergence (the tiny decoder's 600 steps are 1.4 tokens a parameter) a scheme that learns
slowly ranks low for that reason alone, and doubling the steps can move in-length perplexity as much as the gaps
between schemes. A comparison run at two budgets says, per protocol, each scheme's in-length perplexity and its
longest-length ratio at each budget, the rank of each, and Kendall's τ between the budgets' rankings: a ranking that
holds has τ near 1; one that does not is a statement about the budget, not the schemes.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
from scipy import stats

from posenc.evaluate.crossed import ALPHA, Estimate
from posenc.evaluate.stats import holm
from posenc.report import claims
from posenc.report.perplexity import group_runs, protocol, value

DRAWS = 2000  # bootstrap draws of each scheme's seeds
MIN_SEEDS = 2  # shared seeds a paired test needs


def _budget(run: dict[str, Any]) -> int | None:
    return (run.get("training") or {}).get("steps")


def _ranks(figures: dict[str, float | None]) -> dict[str, int]:
    """1 = lowest; schemes without a figure get no rank."""
    known = sorted((figure, scheme) for scheme, figure in figures.items() if figure is not None)
    return {scheme: rank for rank, (_, scheme) in enumerate(known, start=1)}


def budget_tables(results: list[dict[str, Any]]) -> list[str]:
    """Per training length and protocol with runs at two budgets or more: the ranks side by side, and Kendall's τ."""
    out: list[str] = []
    for (train_len, mode, stride), by_label in sorted(group_runs(results).items(), key=lambda item: str(item[0])):
        # {scheme: {steps: runs}}: a column's label names the scheme first, then what else differs (the budget)
        grid: dict[str, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
        for label, runs in by_label.items():
            for run in runs:
                if _budget(run) is not None:
                    grid[label.split(" · ")[0]][_budget(run)].append(run)
        budgets = sorted({steps for per_scheme in grid.values() for steps in per_scheme})
        if len(budgets) < 2:
            continue
        lengths = sorted({row["length"] for runs in by_label.values() for run in runs for row in run["perplexity"]})
        longest = lengths[-1]
        schemes = sorted(grid)
        kinds = {"1×": (train_len, "ppl"), f"{longest // train_len}×/1×": (longest, "ratio")}
        # {kind: {scheme: {steps: {seed: figure}}}}: each run's figure read once, for the table and the agreement
        per_seed = {
            kind: {scheme: {steps: _by_seed(grid[scheme][steps], at, field) for steps in budgets} for scheme in schemes}
            for kind, (at, field) in kinds.items()
        }
        figures = {
            (kind, steps): {
                scheme: statistics.fmean(found.values()) if (found := per_seed[kind][scheme][steps]) else None
                for scheme in schemes
            }
            for kind in kinds
            for steps in budgets
        }
        ranks = {key: _ranks(found) for key, found in figures.items()}
        header = " | ".join(f"{kind} at {steps} steps (rank)" for kind, steps in figures)
        out += [
            "",
            f"## Rankings by budget, trained at L={train_len} — {protocol(mode, stride)}",
            "",
            "Each scheme's mean over its seeds at each training budget, and its rank among the schemes (1 = lowest). "
            "Kendall's τ compares the rankings of two budgets: 1 when they agree, −1 when reversed.",
            "",
            f"| scheme | n | {header} |",
            "|---|---:|" + "---:|" * len(figures),
        ]
        for scheme in schemes:
            n = "/".join(str(len(grid[scheme][steps])) for steps in budgets)
            cells = [
                "—" if figures[key][scheme] is None else f"{figures[key][scheme]:.3f} ({ranks[key].get(scheme)})"
                for key in figures
            ]
            out.append(f"| {scheme} | {n} | " + " | ".join(cells) + " |")
        out.append("")
        for kind, (at, field) in kinds.items():
            base = None if field == "ppl" else train_len

            def test(a: str, b: str, steps: int, at: int = at, base: int | None = base, grid: dict = grid) -> Any:
                return claims.log_ratio_between(grid[a][steps], grid[b][steps], at, base)

            out += _agreement(kind, per_seed[kind], budgets[0], budgets[-1], test)
    return out


def _by_seed(runs: list[dict[str, Any]], length: int, field: str) -> dict[Any, float]:
    """{seed: the run's positive, finite ``field`` at ``length``}."""
    found = {run.get("seed"): value(run, length, field) for run in runs}
    return {seed: v for seed, v in found.items() if v is not None and math.isfinite(v) and v > 0}


def _agreement(
    kind: str,
    per_seed: dict[str, dict[int, dict[Any, float]]],
    first: int,
    last: int,
    test: Callable[[str, str, int], Estimate | None],
) -> list[str]:
    """Kendall's τ between two budgets' rankings, how far the seeds let it move, and the pairs that swapped.

    Why: a τ computed on means treats a swap of two schemes a hair apart like one of two schemes far apart. Each
    pair whose order differs is tested at each budget as the report's other comparisons are (``test``: the crossed
    estimator over the seeds both share and the scored documents; the tests of a kind's swaps one Holm family): a
    swap separated at both budgets is the budget changing the verdict; one separated at neither may be the seeds' and
    documents' spread (not separated is not equal). τ's interval comes
    from drawing each scheme's seeds again at each budget (2,000 draws), only where every scheme has at least 3
    seeds at both: fewer make a bootstrap's spread meaningless.
    """
    shared = sorted(s for s in per_seed if per_seed[s][first] and per_seed[s][last])
    if len(shared) < 3:
        return []
    means = {
        steps: np.array([statistics.fmean(per_seed[s][steps].values()) for s in shared]) for steps in (first, last)
    }
    tau = stats.kendalltau(means[first], means[last]).statistic
    if not math.isfinite(tau):  # one budget's figures all tie: no ranking to agree with
        return [f"- {kind}: no Kendall's τ between {first} and {last} steps (every scheme ties at one of them)."]
    fewest = min(len(per_seed[s][steps]) for s in shared for steps in (first, last))
    if fewest >= 3:
        rng = np.random.default_rng(0)  # fixed: the report reads the same every time it is written
        draws = {
            steps: np.stack(
                [
                    rng.choice(list(per_seed[s][steps].values()), size=(DRAWS, len(per_seed[s][steps]))).mean(axis=1)
                    for s in shared
                ],
                axis=1,
            )
            for steps in (first, last)
        }  # {steps: (DRAWS, schemes)}
        taus = [stats.kendalltau(a, b).statistic for a, b in zip(draws[first], draws[last], strict=True)]
        low, high = np.nanpercentile(taus, [2.5, 97.5])
        spread = f"95% interval over seeds {low:.2f} to {high:.2f}, {DRAWS} draws of each scheme's seeds at each budget"
    else:
        spread = f"no interval: a scheme has {fewest} seed{'s' if fewest != 1 else ''} at a budget, fewer than 3"
    line = f"- {kind}: Kendall's τ between {first} and {last} steps = {tau:.2f} ({len(shared)} schemes; {spread})."
    swaps = [
        (i, j)
        for i, j in itertools.combinations(range(len(shared)), 2)
        if (means[first][i] < means[first][j]) != (means[last][i] < means[last][j])
    ]
    estimates = {(i, j, steps): test(shared[i], shared[j], steps) for i, j in swaps for steps in (first, last)}
    tested = {key: e for key, e in estimates.items() if e is not None and e.seeds >= MIN_SEEDS and math.isfinite(e.se)}
    adjusted = holm({repr(key): e.p_value for key, e in tested.items()})
    swapped = []
    for i, j in swaps:
        untested = [steps for steps in (first, last) if (i, j, steps) not in tested]
        if untested:
            how = f"too few shared seeds to test at {', '.join(map(str, untested))} steps"
        else:
            at = [steps for steps in (first, last) if adjusted[repr((i, j, steps))] < ALPHA]
            how = {0: "separated at neither budget", 2: "separated at both budgets"}.get(len(at), "")
            how = how or f"separated at {at[0]} steps only"
        swapped.append(f"{shared[i]} and {shared[j]} ({how})")
    line += " Pairs whose order differs: " + ("; ".join(swapped) if swapped else "none") + "."
    return [line]
