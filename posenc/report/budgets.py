"""Whether a ranking holds at a second budget: each scheme's rank at every training budget, side by side.

Why: at a budget far from convergence (the tiny decoder's 600 steps are 1.4 tokens a parameter) a scheme that learns
slowly ranks low for that reason alone, and doubling the steps can move in-length perplexity as much as the gaps
between schemes. A comparison run at two budgets says, per protocol, each scheme's in-length perplexity and its
longest-length ratio at each budget, the rank of each, and Kendall's τ between the budgets' rankings: a ranking that
holds has τ near 1; one that does not is a statement about the budget, not the schemes.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any

from scipy import stats

from posenc.report.perplexity import group_runs, protocol, value


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
            first, last = ranks[(kind, budgets[0])], ranks[(kind, budgets[-1])]
            shared = sorted(set(first) & set(last))
            if len(shared) > 2:
                tau = stats.kendalltau([first[s] for s in shared], [last[s] for s in shared]).statistic
                out.append(
                    f"- {kind}: Kendall's τ between {budgets[0]} and {budgets[-1]} steps = {tau:.2f} "
                    f"({len(shared)} schemes)."
                )
    return out
