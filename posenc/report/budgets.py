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
from typing import Any

import numpy as np
from scipy import stats

from posenc.report.perplexity import group_runs, protocol, value

DRAWS = 2000  # bootstrap draws of each scheme's seeds
FIRM = 0.975  # share of draws that must agree on a pair's order for it to count as firm


def _budget(run: dict[str, Any]) -> int | None:
    return (run.get("training") or {}).get("steps")


def _mean(values: list[float | None]) -> float | None:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.fmean(finite) if finite else None


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
        figures = {
            (kind, steps): {
                scheme: _mean(
                    [value(run, train_len if kind == "1×" else longest, field) for run in grid[scheme][steps]]
                )
                for scheme in schemes
            }
            for kind, field in (("1×", "ppl"), (f"{longest // train_len}×/1×", "ratio"))
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
        for kind in dict.fromkeys(kind for kind, _ in figures):
            field = "ppl" if kind == "1×" else "ratio"
            at = train_len if kind == "1×" else longest
            per_run = {
                scheme: {steps: _finite([value(run, at, field) for run in grid[scheme][steps]]) for steps in budgets}
                for scheme in schemes
            }
            out += _agreement(kind, per_run, budgets[0], budgets[-1])
    return out


def _finite(values: list[float | None]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def _agreement(kind: str, per_run: dict[str, dict[int, list[float]]], first: int, last: int) -> list[str]:
    """Kendall's τ between two budgets' rankings, with how far the seeds let it move, and the pairs that swapped.

    Why: a τ computed on means treats a swap of two schemes a hair apart like one of two schemes far apart. Drawing
    each scheme's seeds again (with replacement, at each budget apart) and ranking every draw gives τ's interval over
    seeds; a pair's order at a budget is firm when at least 97.5% of the draws agree on it. A swap firm at both
    budgets is the budget changing the verdict; one that is not firm at either is noise.
    """
    shared = sorted(s for s in per_run if per_run[s][first] and per_run[s][last])
    if len(shared) < 3:
        return []
    means = {steps: np.array([statistics.fmean(per_run[s][steps]) for s in shared]) for steps in (first, last)}
    tau = stats.kendalltau(means[first], means[last]).statistic
    if not math.isfinite(tau):  # one budget's figures all tie: no ranking to agree with
        return [f"- {kind}: no Kendall's τ between {first} and {last} steps (every scheme ties at one of them)."]
    rng = np.random.default_rng(0)  # fixed: the report reads the same every time it is written
    draws = {
        steps: np.stack(
            [rng.choice(per_run[s][steps], size=(DRAWS, len(per_run[s][steps]))).mean(axis=1) for s in shared], axis=1
        )
        for steps in (first, last)
    }  # {steps: (DRAWS, schemes)}
    taus = np.array([stats.kendalltau(a, b).statistic for a, b in zip(draws[first], draws[last], strict=True)])
    low, high = np.nanpercentile(taus, [2.5, 97.5])
    line = (
        f"- {kind}: Kendall's τ between {first} and {last} steps = {tau:.2f} ({len(shared)} schemes; 95% interval "
        f"over seeds {low:.2f} to {high:.2f}, {DRAWS} draws of each scheme's seeds at each budget)."
    )
    swapped = []
    for i, j in itertools.combinations(range(len(shared)), 2):
        before, after = means[first][i] < means[first][j], means[last][i] < means[last][j]
        if before == after:
            continue
        firm = [
            steps
            for steps in (first, last)
            if max(share := float(np.mean(draws[steps][:, i] < draws[steps][:, j])), 1 - share) >= FIRM
        ]
        how = "firm at both budgets" if len(firm) == 2 else "firm at neither"
        how = f"firm at {firm[0]} steps only" if len(firm) == 1 else how
        swapped.append(f"{shared[i]} and {shared[j]} ({how})")
    line += " Pairs whose order differs: " + ("; ".join(swapped) if swapped else "none") + "."
    return [line]
