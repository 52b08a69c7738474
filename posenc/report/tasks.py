"""The task sections: accuracy by length for passkey, copy and the retrieval tasks, and passkey by key depth."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from posenc.evaluate.tasks import CHANCE_PER_BYTE
from posenc.identity import columns
from posenc.report.common import Appendix, Columns, cell, order, table_head

TASKS = ("passkey", "copy")


def task_tables(results: list[dict[str, Any]], tasks: Sequence[str] = TASKS, appendix: Appendix | None = None) -> str:
    """Exact-match and per-byte accuracy of each task by length, per training length, against chance.

    A column whose runs were not trained on the task says so under the table: their near-zero accuracy measures
    an unfamiliar format, not failed retrieval.
    """
    out = []
    for task in tasks:
        for train_len, by_label in sorted(task_columns(results, task).items()):
            labels = order(by_label)
            lengths = sorted({row["length"] for runs_ in by_label.values() for run in runs_ for row in run[task]})
            title = f"{task} accuracy, trained at L={train_len}"
            depths = " (mean over key depths)" if task == "passkey" else ""
            head = table_head(by_label, labels, title=title, appendix=appendix)
            out += [
                f"## {title}",
                "",
                f"Exact-match accuracy{depths}: the whole answer right; mean ± std over seeds (runs that differ only "
                "in their seed).",
                "",
                *head,
            ]
            for length in lengths:
                cells = [cell(task_accuracies(by_label[label], task, length)) for label in labels]
                out.append(f"| {length} | {length / train_len:g} | " + " | ".join(cells) + " |")
            chance = CHANCE_PER_BYTE[task]
            out += ["", f"Per-byte accuracy{depths} (chance: {chance:.2f}, guessing each answer byte):", "", *head]
            for length in lengths:
                cells = [
                    cell(task_accuracies(by_label[label], task, length, field="token_accuracy")) for label in labels
                ]
                out.append(f"| {length} | {length / train_len:g} | " + " | ".join(cells) + " |")
            untrained = [
                label for label in labels if any(run.get("trained_task", task) != task for run in by_label[label])
            ]
            if untrained:
                out += [
                    "",
                    f"Not trained on {task}: {', '.join(untrained)}: their accuracy measures the format, not recall.",
                ]
            out.append("")
            if task == "passkey":
                out += _depth_table(by_label, labels, max(lengths), train_len)
    return "\n".join(out)


def task_columns(results: list[dict[str, Any]], task: str) -> dict[int, Columns]:
    """{train_len: {column: runs}} for the runs scored on ``task``."""
    by_len: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for run in results:
        if run.get(task) and not run.get("failed"):
            by_len[int(run["train_len"])].append(run)
    return {train_len: columns(runs) for train_len, runs in by_len.items()}


def task_accuracies(
    runs: list[dict[str, Any]], task: str, length: int, depth: float | None = None, field: str = "accuracy"
) -> list[float]:
    """Per run: mean ``field`` over the rows at ``length`` (and ``depth``, for passkey); runs without it skip."""
    accs = []
    for run in runs:
        rows = [r for r in run[task] if r["length"] == length and (depth is None or r["depth"] == depth)]
        values = [r[field] for r in rows if r.get(field) is not None]
        if values:
            accs.append(statistics.fmean(values))
    return accs


def _depth_table(by_label: Columns, labels: list[str], length: int, train_len: int) -> list[str]:
    """Passkey accuracy by key depth at the longest length: where in the window retrieval fails."""
    depths = sorted({row["depth"] for runs in by_label.values() for run in runs for row in run["passkey"]})
    out = [
        f"Passkey accuracy by key depth at length {length} ({length / train_len:g}×; depth 0 = the key at the start"
        ", farthest from the question):",
        "",
        "| depth | " + " | ".join(labels) + " |",
        "|---:|" + "---:|" * len(labels),
    ]
    for depth in depths:
        cells = [cell(task_accuracies(by_label[label], "passkey", length, depth)) for label in labels]
        out.append(f"| {depth:g} | " + " | ".join(cells) + " |")
    out.append("")
    return out
