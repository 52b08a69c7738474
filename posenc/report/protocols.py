"""Both evaluation protocols side by side: what each scheme's perplexity does past the training length under each.

Nonoverlapping windows give the first tokens of every window little context, and a longer window gives a smaller
share of its tokens that handicap, so perplexity can fall with length without any extrapolation (Press et al.,
2022, Appendix B). Sliding windows score only tokens with at least (1 − f) · N tokens of context. A scheme whose
ratio stays flat under both extrapolates; one that is flat only without overlap gains from the early-token effect.
One row per scheme, for each protocol its in-length perplexity, its perplexity at the longest length every protocol
evaluated, and the ratio of the two, each over every seed and scored document with its 95% interval (seeds and documents
crossed, ``claims``); the ratio's words say whether it is flat (equivalent to 1 within the margin).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from posenc.report import claims
from posenc.report.common import Appendix, order
from posenc.report.perplexity import group_order, group_runs, protocol, ratio_words


def protocol_tables(results: list[dict[str, Any]], appendix: Appendix | None = None) -> str:
    """Per training length with more than one protocol: the table of the module docstring."""
    by_train_len: dict[int, dict[tuple[str, Any], dict[str, list[dict[str, Any]]]]] = defaultdict(dict)
    for (train_len, mode, stride), by_label in group_runs(results).items():
        by_train_len[train_len][(mode, stride)] = by_label
    out: list[str] = []
    for train_len, groups in sorted(by_train_len.items()):
        if len(groups) < 2:
            continue
        keys = sorted(groups, key=lambda key: group_order((train_len, *key)))
        lengths = [
            {row["length"] for runs in groups[key].values() for run in runs for row in run["perplexity"]}
            for key in keys
        ]
        longest = max(set.intersection(*lengths))
        labels = order({label for key in keys for label in groups[key]})
        header = ["scheme"] + [
            f"{what} · {protocol(*key, short=True)}"
            for key in keys
            for what in ("1×", f"{longest / train_len:g}×", "ratio")
        ]
        out += [
            f"## Protocols side by side, trained at L={train_len}",
            "",
            __doc__.split("\n\n")[1].replace("\n", " ")
            + f" Longest length shared: {longest}. Protocols: "
            + "; ".join(f"{protocol(*key, short=True)} = {protocol(*key)}" for key in keys)
            + ".",
            "",
            "| " + " | ".join(header) + " |",
            "|---|" + "---:|" * (len(header) - 1),
        ]
        runs = [run for key in keys for found in groups[key].values() for run in found]
        log_margin = math.log1p(claims.margin(runs)[0])
        tested = {key: ratio_words((train_len, *key), groups[key]) for key in keys}  # the ratio tables' own words
        for label in labels:
            cells = []
            for key in keys:
                mine = groups[key].get(label, [])
                cells += [claims.shown(claims.log_perplexity(mine, train_len)),
                          claims.shown(claims.log_perplexity(mine, longest))]  # fmt: skip
                estimates, flat = tested[key]
                ratio, found = estimates.get((label, longest)), flat.get(f"{label}@{longest}")
                cells.append(f"{claims.shown(ratio, 3)} {claims.mark(found)}".rstrip())
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        out += [
            "",
            claims.flat_legend(
                log_margin, "its protocol's whole table of ratios (every length), as that table marks it"
            ),
        ]
        out.append("")
    return "\n".join(out).rstrip()
