"""A paired comparison of two columns on request: the same seeds on both sides, matched by seed, per length.

Two schemes trained on the same seeds (the same data order and initial draws) and scored on the same documents
share the seed-to-seed and the document-to-document variation; differencing per seed and document removes what they
share, and the crossed estimator (``claims``) carries what is left. The test is on log-perplexity (the loss), shown as
the ratio of perplexities it implies, with its words against the runs' equivalence margin. Columns whose seeds do not
match cannot be paired: the comparison is refused rather than pairing unlike runs.
"""

from __future__ import annotations

import math
from typing import Any

from posenc.evaluate.crossed import verdict
from posenc.report import claims
from posenc.report.perplexity import group_runs, protocol


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
        equivalence, _ = claims.margin(by_label[a] + by_label[b])
        out += [
            "",
            f"## Paired: {a} / {b}, trained at L={train_len} — {how}",
            "",
            f"Log-perplexity of {a} minus that of {b}, seed by seed ({len(seeds)} seeds: "
            f"{', '.join(map(str, seeds))}) and document by document, shown as the perplexity ratio it implies (below "
            f"1: {a} lower), its 95% interval (seeds and documents crossed; ᵗ: seeds only), the two-sided p-value, the "
            f"words of this one test (margin ±{equivalence:.0%}) and the smallest ratio it detects (80% power).",
            "",
            "| length | ×L | perplexity ratio [95% interval] | p | words | detects |",
            "|---:|---:|---:|---:|---|---:|",
        ]
        for length in lengths:
            estimate = claims.log_ratio_between(by_label[a], by_label[b], length)
            if estimate is None or not math.isfinite(estimate.se):
                out.append(f"| {length} | {length / train_len:g} | fewer than 2 seeds evaluated on both | — | — | — |")
                continue
            found = verdict(estimate.p_value, estimate.equivalence_p(math.log1p(equivalence)))
            out.append(
                f"| {length} | {length / train_len:g} | {claims.shown(estimate, 4)} | {estimate.p_value:.3g} "
                f"| {', '.join(found)} | ±{math.expm1(estimate.detectable()):.1%} |"
            )
    if not out:
        raise SystemExit(f"cannot pair {a!r} with {b!r}: no table has both columns (column labels as in report.md)")
    return out
