"""A paired comparison of two columns on request: the same seeds on both sides, matched by seed, per length.

Two schemes trained on the same seeds (the same data order and initial draws) share the seed-to-seed variation;
differencing per seed removes it, so the paired t interval is what a claim "a beats b" has to clear. The test is on
log-perplexity (the loss), where a scheme's seeds spread evenly, and is shown as the ratio of perplexities it implies.
Columns whose seeds do not match cannot be paired: the comparison is refused rather than pairing unlike runs.
"""

from __future__ import annotations

import math
from typing import Any

from posenc.evaluate.stats import paired_comparison
from posenc.report.perplexity import group_runs, protocol, value


def paired_section(results: list[dict[str, Any]], a: str, b: str) -> list[str]:
    """Markdown lines: for every group holding both columns, a / b in perplexity per length (ratio, interval, p).

    Raises ``SystemExit`` with one line when no group has both columns or when their seeds differ.
    """
    out: list[str] = []
    for (train_len, mode, stride), by_label in sorted(group_runs(results).items(), key=lambda item: str(item[0])):
        if a not in by_label or b not in by_label:
            continue
        seeds_a = {run.get("seed"): run for run in by_label[a]}
        seeds_b = {run.get("seed"): run for run in by_label[b]}
        if set(seeds_a) != set(seeds_b) or len(seeds_a) != len(by_label[a]) or len(seeds_b) != len(by_label[b]):
            raise SystemExit(
                f"cannot pair {a!r} with {b!r}: their seeds differ ({sorted(map(str, seeds_a))} vs "
                f"{sorted(map(str, seeds_b))}, each seed once on both sides is needed)"
            )
        if len(seeds_a) < 2:
            raise SystemExit(f"cannot pair {a!r} with {b!r}: a paired comparison needs at least 2 shared seeds")
        seeds = sorted(seeds_a, key=str)
        lengths = sorted({row["length"] for run in by_label[a] + by_label[b] for row in run["perplexity"]})
        how = protocol(mode, stride)
        out += [
            "",
            f"## Paired: {a} / {b}, trained at L={train_len} — {how}",
            "",
            f"Log-perplexity of {a} minus that of {b}, seed by seed ({len(seeds)} seeds: "
            f"{', '.join(map(str, seeds))}), "
            "shown as the perplexity ratio it implies: exp of the mean difference, exp of its 95% Student-t interval, "
            "and the two-sided p-value of the paired t-test (below 1: {a} lower).".replace("{a}", a),
            "",
            "| length | ×L | perplexity ratio | 95% interval | p |",
            "|---:|---:|---:|---:|---:|",
        ]
        for length in lengths:
            pairs = [(value(seeds_a[s], length, "ppl"), value(seeds_b[s], length, "ppl")) for s in seeds]
            kept = [(math.log(x), math.log(y)) for x, y in pairs if x and y and math.isfinite(x) and math.isfinite(y)]
            if len(kept) < 2:
                out.append(f"| {length} | {length / train_len:g} | — | fewer than 2 seeds evaluated on both | — |")
                continue
            c = paired_comparison([x for x, _ in kept], [y for _, y in kept])
            low, high = math.exp(c.mean_difference - c.half_width), math.exp(c.mean_difference + c.half_width)
            out.append(
                f"| {length} | {length / train_len:g} | {math.exp(c.mean_difference):.4f} | [{low:.4f}, {high:.4f}] "
                f"| {c.p_value:.3g} |"
            )
    if not out:
        raise SystemExit(f"cannot pair {a!r} with {b!r}: no table has both columns (column labels as in report.md)")
    return out
