"""Both evaluation protocols side by side: what each scheme's perplexity does past the training length under each.

Nonoverlapping windows give the first tokens of every window little context, and a longer window gives a smaller
share of its tokens that handicap, so perplexity can fall with length without any extrapolation (Press et al.,
2022, Appendix B). Sliding windows score only tokens with at least (1 − f) · N tokens of context. A scheme whose
ratio stays flat under both extrapolates; one that is flat only without overlap gains from the early-token effect.
One row per scheme, for each protocol its in-length perplexity, its perplexity at the longest length every protocol
evaluated, and the ratio of the two (mean over seeds ± the 95% Student-t half-width).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from posenc.report.common import Appendix, interval_cells, order
from posenc.report.perplexity import group_order, group_runs, protocol, value


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
        for label in labels:
            cells = []
            for key in keys:
                runs = groups[key].get(label, [])
                figures = {
                    "1": [value(run, train_len, "ppl") for run in runs],
                    "n": [value(run, longest, "ppl") for run in runs],
                    "r": [value(run, longest, "ratio") for run in runs],
                }
                shown = interval_cells(figures, 2)
                cells += [shown["1"], shown["n"], interval_cells({"r": figures["r"]}, 3)["r"]]
            out.append(f"| {label} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out).rstrip()
