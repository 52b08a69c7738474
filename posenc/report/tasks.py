"""The task sections: accuracy by length for passkey and copy, passkey by key depth; cells shared with retrieval.

An accuracy is a proportion, and every interval here stays in [0, 1]: a column of one seed shows its run's accuracy
with the Wilson interval of its answers, a column of several the mean over seeds with a percentile bootstrap over
the seeds. No significance marks: a seed learns a retrieval or does not, which no t-test models (the retrieval
section counts the seeds that learned).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from posenc.evaluate.stats import bootstrap_mean, wilson
from posenc.evaluate.tasks import CHANCE_PER_BYTE
from posenc.report.common import Appendix, Columns, order, table_head
from posenc.training.identity import columns

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
            out += [f"## {title}", "", ACCURACY_LEGEND, ""]
            for field, what in _accuracy_fields(by_label, task):
                out += [f"{what}{depths}{chance_note(by_label, task, field)}:", "", *head]
                for length in lengths:
                    row = [accuracy_cell(by_label[label], task, length, field) for label in labels]
                    out.append(f"| {length} | {length / train_len:g} | " + " | ".join(row) + " |")
                out.append("")
            untrained = [
                label for label in labels if any(run.get("trained_task", task) != task for run in by_label[label])
            ]
            if untrained:
                out += [
                    f"Not trained on {task}: {', '.join(untrained)}: their accuracy measures the format, not recall.",
                    "",
                ]
            if task == "passkey":
                out += _depth_table(by_label, labels, max(lengths), train_len)
    return "\n".join(out)


ACCURACY_LEGEND = (
    "Cells: a column of one seed shows its run's accuracy [95% Wilson interval of its answers]; a column of several "
    "the mean over its seeds [95% percentile bootstrap over the seeds]. Both stay within [0, 1]."
)


def accuracy_cell(
    runs: list[dict[str, Any]], task: str, length: int, field: str = "accuracy", depth: float | None = None
) -> str:
    """One accuracy cell (``ACCURACY_LEGEND``): Wilson for one run where its counts are known, else a bootstrap."""
    values = task_accuracies(runs, task, length, depth, field)
    if not values:
        return "—"
    shown = f"{statistics.fmean(values):.2f}"
    if len(values) > 1:
        low, high = bootstrap_mean(values)
    else:
        rows = [r for r in runs[0][task] if r["length"] == length and (depth is None or r["depth"] == depth)]
        counts = _counts(rows)
        if counts is None or field != "accuracy":
            return shown
        low, high = wilson(*counts)
    cell = f"{shown} [{low:.2f}, {high:.2f}]"
    return cell + (f" (n={len(values)})" if len(values) != len(runs) else "")


def _counts(rows: list[dict[str, Any]]) -> tuple[int, int] | None:
    """(right, scored) answers of one run's rows at a length: recorded, or worked out from accuracy × samples."""
    if rows and all(row.get("answers") is not None and row.get("correct") is not None for row in rows):
        return sum(int(row["correct"]) for row in rows), sum(int(row["answers"]) for row in rows)
    if rows and all(row.get("samples") for row in rows):
        right = sum(round(float(row["accuracy"]) * int(row["samples"])) for row in rows)
        return right, sum(int(row["samples"]) for row in rows)
    return None


FIELDS = {
    "accuracy": "Exact match (the whole answer right)",
    "first_byte_accuracy": "First answer byte right",
    "token_accuracy": "Per-byte accuracy",
}
CHANCE_FIELDS = {"accuracy": "chance_exact", "first_byte_accuracy": "chance_first_byte"}
KEYLESS_FIELDS = {"accuracy": "keyless_exact", "first_byte_accuracy": "keyless_first_byte"}
ELIMINATION_FIELDS = {"accuracy": "keyless_exact_elimination", "first_byte_accuracy": "keyless_first_byte_elimination"}


def _rows(by_label: Columns, task: str) -> list[dict[str, Any]]:
    """Every result row of ``task`` in the table's columns."""
    return [row for runs in by_label.values() for run in runs for row in run[task]]


def _accuracy_fields(by_label: Columns, task: str) -> list[tuple[str, str]]:
    """The accuracy fields the runs recorded, in FIELDS' order (first-byte accuracy: the retrieval tasks)."""
    rows = _rows(by_label, task)
    return [(field, what) for field, what in FIELDS.items() if any(row.get(field) is not None for row in rows)]


def chance_note(by_label: Columns, task: str, field: str) -> str:
    """`` (chance: 0.10, …)``: the floors ``field`` is read against, where recorded.

    A uniform guess over the answer alphabet, and the best guess blind to which key goes with which fact: the floor
    that recall must clear, far above a uniform guess where a window holds few facts.
    """
    rows = _rows(by_label, task)
    recorded = sorted({row[CHANCE_FIELDS[field]] for row in rows if row.get(CHANCE_FIELDS.get(field, ""))})
    keyless = sorted({row[KEYLESS_FIELDS[field]] for row in rows if row.get(KEYLESS_FIELDS.get(field, ""))})
    eliminating = sorted({row[k] for row in rows if row.get(k := ELIMINATION_FIELDS.get(field, ""))})
    if recorded:
        blind = f"; {', '.join(f'{value:.2g}' for value in keyless)} without matching keys" if keyless else ""
        if eliminating and eliminating != keyless:
            blind += f" ({', '.join(f'{value:.2g}' for value in eliminating)} with elimination)"
        return " (chance: " + ", ".join(f"{value:.2g}" for value in recorded) + f", a uniform guess{blind})"
    if field == "token_accuracy":
        return f" (chance: {CHANCE_PER_BYTE[task]:.2f}, guessing each answer byte)"
    return ""


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
        row = [accuracy_cell(by_label[label], "passkey", length, depth=depth) for label in labels]
        out.append(f"| {depth:g} | " + " | ".join(row) + " |")
    out.append("")
    return out
