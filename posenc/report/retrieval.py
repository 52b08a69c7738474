"""The retrieval section: per task, a learning-rate sweep, accuracy by length, who learned, and MQAR's breakdowns.

For each retrieval task and training length:

- **Learning-rate sweep.** Where a scheme's columns differ only in ``optim.lr`` (and, for a scheme with positional
  parameters, ``optim.scheme_lr_multiplier``: the grid the comparison's tuning uses), one row per setting: the seeds
  that learned (k of n: the in-length accuracy's Wilson interval above every floor), each seed's in-length accuracy,
  the final validation accuracy and how far it still moved over the last quarter of training (from each run's
  validation curve, ``run.json``). Each scheme's rate is **selected on validation** (held-out windows of the
  training format, another seed stream than the evaluation's): the highest mean final validation accuracy, a tie
  going to the smaller multiplier, then the smaller rate. The tables below show the selected column of every scheme,
  as Zoology reports the best of a sweep.
- **Accuracy by length** (``tasks.accuracy_cell``), then the seeds that learned and each seed's accuracies, since a
  retrieval that some seeds learn and others do not is not a bell curve.
- **MQAR**: accuracy by query–key distance at each length (the windows, hence the answers per bin, are the same for
  every model) and by query index at the training length and the longest one.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from posenc.data.retrieval import RETRIEVAL_TASKS
from posenc.evaluate.effective import learned
from posenc.evaluate.stats import bootstrap_mean
from posenc.jsonio import read_record
from posenc.report.common import Appendix, Columns, order, run_dir, table_head
from posenc.report.tasks import ACCURACY_LEGEND, accuracy_cell, chance_note, task_columns
from posenc.runs import RUN_FILE
from posenc.training.identity import identity

LR = "optim.lr"
MULTIPLIER = "optim.scheme_lr_multiplier"
RATES = {LR, MULTIPLIER}  # what a sweep may vary for its selection to be a tuning, not a comparison
LAST_PART = 0.25  # how much of training the "still moving" figure looks back over


def validation_curve(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's validation curve (step, loss, accuracy) from its ``run.json``; empty where it recorded none."""
    if not run.get("_source"):
        return []
    try:
        record = read_record(Path(run_dir(run)) / RUN_FILE)
    except (OSError, UnicodeDecodeError, ValueError):
        return []
    return [point for point in record.get("val_curve") or [] if point.get("accuracy") is not None]


def still_moving(curve: list[dict[str, Any]]) -> float | None:
    """The largest change of validation accuracy from the last quarter of training's first point to any later one."""
    if len(curve) < 2:
        return None
    last_step = curve[-1]["step"]
    tail = [point for point in curve if point["step"] >= (1 - LAST_PART) * last_step]
    return max(abs(point["accuracy"] - tail[0]["accuracy"]) for point in tail)


def rates(run: dict[str, Any]) -> tuple[float, float]:
    """(multiplier, learning rate) of a run: the order a sweep's rows take, and ties are broken in."""
    settings = identity(run)
    return float(settings.get(MULTIPLIER, 1.0) or 1.0), float(settings[LR])


def lr_sweeps(by_label: Columns) -> dict[str, list[str]]:
    """{scheme: its columns} for every scheme whose columns differ in the learning rates and nothing else."""
    schemes: dict[str, list[str]] = {}
    for label in by_label:
        schemes.setdefault(label.split(" · ")[0], []).append(label)
    sweeps = {}
    for scheme, labels in schemes.items():
        if len(labels) < 2:
            continue
        settings = [identity(by_label[label][0]) for label in labels]
        keys = {key for one in settings for key in one}
        differing = {key for key in keys if len({repr(one.get(key)) for one in settings}) > 1}
        if LR in settings[0] and differing and differing <= RATES:
            sweeps[scheme] = sorted(labels, key=lambda label: rates(by_label[label][0]))
    return sweeps


def final_validation(runs: list[dict[str, Any]]) -> float | None:
    """The mean over seeds of the last validation accuracy, ``None`` when a run recorded no curve."""
    finals = [curve[-1]["accuracy"] for curve in map(validation_curve, runs) if curve]
    return statistics.fmean(finals) if finals and len(finals) == len(runs) else None


def selected(by_label: Columns) -> tuple[Columns, dict[str, str]]:
    """The columns the tables show (the selected rate of every swept scheme) and {scheme: the selected column}."""
    chosen, dropped = {}, set()
    for scheme, labels in lr_sweeps(by_label).items():
        scores = {label: final_validation(by_label[label]) for label in labels}
        if all(score is not None for score in scores.values()):  # else no selection: every rate stays tabled
            best = max(scores.values())  # labels are in (multiplier, rate) order: the first best is the smaller
            chosen[scheme] = next(label for label in labels if scores[label] == best)
            dropped |= set(labels) - {chosen[scheme]}
    return {label: runs for label, runs in by_label.items() if label not in dropped}, chosen


def learned_cell(runs: list[dict[str, Any]], task: str, train_len: int) -> str:
    """``k of n`` seeds that learned the task (``None`` verdicts, without an in-length row, are not counted)."""
    verdicts = [learned(run[task], train_len) for run in runs]
    known = [verdict for verdict in verdicts if verdict is not None]
    return f"{sum(known)} of {len(known)}"


def _in_length(run: dict[str, Any], task: str, train_len: int) -> float | None:
    rows = [row for row in run[task] if int(row["length"]) == train_len]
    return statistics.fmean(float(row["accuracy"]) for row in rows) if rows else None


def sweep_table(task: str, train_len: int, by_label: Columns, chosen: dict[str, str]) -> list[str]:
    """One row per learning rate of every swept scheme (see the module docstring)."""
    sweeps = lr_sweeps(by_label)
    if not sweeps:
        return []
    out = [
        f"Learning-rate sweep: each scheme's rate selected on the final validation accuracy (held-out windows of the "
        f"training format), marked ✓; still moving: the largest change of validation accuracy over the last "
        f"{LAST_PART:.0%} of training (mean over seeds [largest]). A curve flat at a keyless floor is a plateau, not "
        "convergence: the lookup can still form later, so 0 of n learned says 'not in this budget', not 'cannot'. "
        "Selecting the best of a sweep favours the selected columns a little, as in Zoology's reports; the selection "
        "never sees the evaluation windows.",
        "",
        "| column | lr | ×scheme | learned | in-length accuracy, each seed | final validation accuracy | still moving "
        "| |",
        "|---|---:|---:|---:|---|---:|---:|---|",
    ]
    for scheme in order(sweeps):
        for label in sweeps[scheme]:
            runs = sorted(by_label[label], key=lambda run: str(run.get("seed")))
            seeds = " ".join(
                f"{value:.2f}" for value in (_in_length(run, task, train_len) for run in runs) if value is not None
            )
            final = final_validation(runs)
            final_text = "—" if final is None else f"{final:.3f}"
            mark = "✓" if chosen.get(scheme) == label else ""
            moves = [m for m in (still_moving(validation_curve(run)) for run in runs) if m is not None]
            moving = f"{statistics.fmean(moves):.3f} [{max(moves):.3f}]" if moves else "—"
            multiplier, lr = rates(runs[0])
            out.append(
                f"| {label} | {lr:g} | {multiplier:g} | {learned_cell(runs, task, train_len)} | {seeds} | "
                f"{final_text} | {moving} | {mark} |"
            )
    unselected = [scheme for scheme in order(sweeps) if scheme not in chosen]
    if unselected:
        out += ["", f"No rate selected for {', '.join(unselected)}: a run recorded no validation curve, so every rate "
                "of it is tabled below."]  # fmt: skip
    return [*out, ""]


def seeds_table(task: str, train_len: int, by_label: Columns, labels: list[str]) -> list[str]:
    """Each seed's accuracy at every length, one row per seed, one column per scheme."""
    seeds = sorted({str(run.get("seed")) for label in labels for run in by_label[label]})
    lengths = sorted({int(row["length"]) for label in labels for run in by_label[label] for row in run[task]})
    out = [
        f"Each seed's accuracy at {', '.join(f'{n / train_len:g}×' for n in lengths)}:",
        "",
        "| seed | " + " | ".join(labels) + " |",
        "|---:|" + "---|" * len(labels),
    ]
    for seed in seeds:
        cells = []
        for label in labels:
            run = next((r for r in by_label[label] if str(r.get("seed")) == seed), None)
            values = [] if run is None else [_mean_at(run, task, n) for n in lengths]
            cells.append(" ".join("—" if v is None else f"{v:.2f}" for v in values))
        out.append(f"| {seed} | " + " | ".join(cells) + " |")
    return [*out, ""]


def _mean_at(run: dict[str, Any], task: str, length: int) -> float | None:
    rows = [float(row["accuracy"]) for row in run.get(task) or [] if int(row["length"]) == length]
    return statistics.fmean(rows) if rows else None


def breakdown_table(
    key: str, train_len: int, by_label: Columns, labels: list[str], cell: str, lengths: set[int] | None = None
) -> list[str]:
    """MQAR accuracy by distance bin (``cell`` = "distance") or query index ("query"): rows (length, cell)."""
    rows = [row for label in labels for run in by_label[label] for row in run.get(key) or []]
    if not rows:
        return []
    name = "distance_low" if cell == "distance" else "query"
    cells = sorted(
        {(int(r["length"]), r[name], r.get("distance_high")) for r in rows if not lengths or r["length"] in lengths}
    )
    out = [
        "| length | ×L | "
        + ("query–key distance" if cell == "distance" else "query")
        + " | answers | "
        + " | ".join(labels)
        + " |",
        "|---:|---:|---:|---:|" + "---:|" * len(labels),
    ]
    for length, first, high in cells:
        answers = sorted({int(r["answers"]) for r in rows if r["length"] == length and r[name] == first})
        values = []
        for label in labels:
            per_seed = [
                float(r["accuracy"])
                for run in by_label[label]
                for r in run.get(key) or []
                if r["length"] == length and r[name] == first
            ]
            if not per_seed:
                values.append("—")
                continue
            low, high_ = bootstrap_mean(per_seed)
            mean = statistics.fmean(per_seed)
            values.append(f"{mean:.2f}" if len(per_seed) == 1 else f"{mean:.2f} [{low:.2f}, {high_:.2f}]")
        what = f"[{first}, {high})" if cell == "distance" else str(first)
        shown = "/".join(map(str, answers))
        out.append(f"| {length} | {length / train_len:g} | {what} | {shown} | " + " | ".join(values) + " |")
    return [*out, ""]


def distance_position_tables(by_label: Columns, labels: list[str]) -> list[str]:
    """Per column, MQAR accuracy by query–key distance (rows) × the answer's position (columns), pooled over lengths.

    Cells: the mean over seeds of each seed's accuracy in the cell, and the answers behind it (summed over seeds).
    """
    out = []
    for label in labels:
        rows = [row for run in by_label[label] for row in run.get("mqar_by_distance_position") or []]
        if not rows:
            continue
        distance_bins = sorted({(r["distance_low"], r["distance_high"]) for r in rows})
        position_bins = sorted({(r["position_low"], r["position_high"]) for r in rows})
        out += [
            f"{label} (n={len(by_label[label])}):",
            "",
            "| distance ↓ · position → | " + " | ".join(f"[{low}, {high})" for low, high in position_bins) + " |",
            "|---:|" + "---:|" * len(position_bins),
        ]
        for d_low, d_high in distance_bins:
            cells = []
            for p_low, _ in position_bins:
                mine = [r for r in rows if r["distance_low"] == d_low and r["position_low"] == p_low]
                if not mine:
                    cells.append("")
                    continue
                accuracy = statistics.fmean(float(r["accuracy"]) for r in mine)
                cells.append(f"{accuracy:.2f} ({sum(int(r['answers']) for r in mine)})")
            out.append(f"| [{d_low}, {d_high}) | " + " | ".join(cells) + " |")
        out.append("")
    return out


def retrieval_tables(results: list[dict[str, Any]], appendix: Appendix | None = None) -> str:
    """Every retrieval task's section (see the module docstring)."""
    out: list[str] = []
    for task in RETRIEVAL_TASKS:
        for train_len, all_columns in sorted(task_columns(results, task).items()):
            by_label, chosen = selected(all_columns)
            labels = order(by_label)
            lengths = sorted({int(r["length"]) for runs in by_label.values() for run in runs for r in run[task]})
            title = f"{task} accuracy, trained at L={train_len}"
            head = table_head(by_label, labels, title=title, appendix=appendix)
            out += [f"## {title}", "", *sweep_table(task, train_len, all_columns, chosen)]
            first = (
                "held-out windows of the training format (the one generator), "
                if task == "mqar"
                else "the task's evaluation windows at the training length, "
            )
            out += [
                f"Exact match by window length; the {train_len} row is scored on {first}the longer ones are the "
                f"length-extrapolation windows{chance_note(by_label, task, 'accuracy')}. {ACCURACY_LEGEND}",
                "",
                *head,
            ]
            for length in lengths:
                row = [accuracy_cell(by_label[label], task, length) for label in labels]
                out.append(f"| {length} | {length / train_len:g} | " + " | ".join(row) + " |")
            learned_row = [learned_cell(by_label[label], task, train_len) for label in labels]
            out += ["| learned | | " + " | ".join(learned_row) + " |", ""]
            out += [
                "learned: the seeds whose in-length accuracy's 95% Wilson interval lies above every floor (for MQAR "
                "the keyless floor with elimination, the higher one), of the seeds evaluated.",
                "",
                *seeds_table(task, train_len, by_label, labels),
            ]
            if task == "mqar":
                distance = breakdown_table("mqar_by_distance", train_len, by_label, labels, "distance")
                query = breakdown_table("mqar_by_query", train_len, by_label, labels, "query", {train_len, lengths[-1]})
                if distance:
                    out += [
                        "Accuracy by query–key distance (from a key in the block to its query), at each window "
                        "length: the bins at and beyond the training length hold distances no training window had. "
                        "Answers: the same windows at a length for every model. Cells: mean over seeds [95% "
                        "bootstrap].",
                        "",
                        *distance,
                    ]
                by_position = distance_position_tables(by_label, labels)
                if by_position:
                    out += [
                        "Accuracy by query–key distance (rows) × the answer's position in its window (columns), "
                        "pooled over every evaluated length (a causal model's answer at position t reads only what "
                        "precedes it). With the block at the window's start (kv_offset zoology) only the diagonal "
                        "fills: distance is position; with kv_offset random, a row read across says whether position "
                        "matters at a fixed distance. Cells: mean over seeds (answers, over all seeds).",
                        "",
                        *by_position,
                    ]
                if query:
                    out += [
                        "Accuracy by the query's rank in its window (1 = the first query), at the training length and "
                        "the longest: a model answering later queries by elimination would score higher on them.",
                        "",
                        *query,
                    ]
    return "\n".join(out).rstrip()
