"""The report's figures: one line per column (scheme), per training length; matplotlib is imported only here.

A column of several seeds is drawn with a band, as in the tables: the 95% Student-t interval of its mean perplexity,
the 95% bootstrap over seeds of its mean accuracy (inside [0, 1]). A task run's validation curve (in-length
accuracy by training step) is drawn per column with the range of its seeds.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from posenc.data.retrieval import RETRIEVAL_TASKS
from posenc.evaluate import ACCURACY_LIMITS, LOSS_MIN_SPAN, PPL_MIN_SPAN, RATIO_MIN_SPAN
from posenc.evaluate.bins import binned
from posenc.evaluate.outputs import keyless_reference
from posenc.evaluate.stats import bootstrap_mean
from posenc.evaluate.tasks import CHANCE_PER_BYTE
from posenc.report.attention import attention_groups, attention_means
from posenc.report.common import Columns, Key, mean_halfwidth, order
from posenc.report.perplexity import protocol, suffix, value
from posenc.report.retrieval import selected, validation_curve
from posenc.report.tasks import TASKS, task_accuracies, task_columns


def perplexity_plots(groups: dict[Key, Columns], out_dir: Path) -> list[Path]:
    """Per group: perplexity vs length, ratio vs length, loss by position (one line per scheme)."""
    from posenc.evaluate.plots import plot_lines  # matplotlib only when plotting

    images = []
    for key, by_label in sorted(groups.items(), key=lambda item: str(item[0])):
        (train_len, mode, stride), name = key, suffix(key)
        for field, ylabel, span, include in (
            ("ppl", "perplexity", PPL_MIN_SPAN, ()),
            ("ratio", "perplexity / in-length perplexity", RATIO_MIN_SPAN, (1.0,)),
        ):
            series = {}
            for label in order(by_label):
                lengths = sorted({row["length"] for run in by_label[label] for row in run["perplexity"]})
                stats = [mean_halfwidth([value(run, length, field) for run in by_label[label]]) for length in lengths]
                kept = [(length, m, s) for length, (m, s, n) in zip(lengths, stats, strict=True) if n]
                if kept:
                    series[label] = ([k[0] for k in kept], [k[1] for k in kept], [k[2] for k in kept])
            images.append(
                plot_lines(
                    series,
                    out_dir / f"{field}_vs_length_{name}.png",
                    f"{field} vs evaluation length (trained at L={train_len}; {protocol(mode, stride)})",
                    "evaluation length (tokens)",
                    ylabel,
                    train_len=train_len,
                    logy=True,
                    min_span=span,
                    include=include,
                )
            )
        curves = {}
        for label in order(by_label):
            per_run = [run.get("loss_by_position") or {} for run in by_label[label]]
            common = set.intersection(*(set(c) for c in per_run)) if per_run else set()
            if common:  # the bins' means averaged over runs: a mean of the curves, binned (bins are linear)
                longest = max(common, key=int)
                each = [binned(c[longest], int(longest)) for c in per_run]
                curves[label] = (each[0][0], np.mean([means for _, means in each], axis=0), None)
        if curves:
            images.append(
                plot_lines(
                    curves,
                    out_dir / f"loss_by_position_{name}.png",
                    f"loss by position in the longest window (trained at {train_len}; {protocol(mode, stride)})",
                    "position in window",
                    "loss (nats)",
                    train_len=train_len,
                    min_span=LOSS_MIN_SPAN,
                )
            )
    return images


def task_plots(results: list[dict[str, Any]], out_dir: Path, tasks: Sequence[str] = TASKS) -> list[Path]:
    """Exact-match and per-byte accuracy vs length (0 to 1, per-byte chance marked), one line per scheme."""
    from posenc.evaluate.plots import plot_lines  # matplotlib only when plotting

    images = []
    for task in tasks:
        for train_len, by_label in sorted(task_columns(results, task).items()):
            if task in RETRIEVAL_TASKS:
                by_label = selected(by_label)[0]
            for field, what, tail in (("accuracy", "exact-match", ""), ("token_accuracy", "per-byte", "_per_byte")):
                series = {}
                for label in order(by_label):
                    lengths = sorted({row["length"] for run in by_label[label] for row in run[task]})
                    per_length = [task_accuracies(by_label[label], task, n, field=field) for n in lengths]
                    kept = [(n, values) for n, values in zip(lengths, per_length, strict=True) if values]
                    if kept:
                        bounds = [bootstrap_mean(values) for _, values in kept]
                        series[label] = (
                            [n for n, _ in kept],
                            [statistics.fmean(values) for _, values in kept],
                            ([low for low, _ in bounds], [high for _, high in bounds]),
                        )
                if not series:
                    continue
                images.append(
                    plot_lines(
                        series,
                        out_dir / f"{task}_accuracy{tail}_L{train_len}.png",
                        f"{task} {what} accuracy vs length (trained at L={train_len})",
                        "evaluation length (tokens)",
                        f"{what} accuracy",
                        train_len=train_len,
                        ylim=ACCURACY_LIMITS,
                        references=(
                            {"per-byte chance": CHANCE_PER_BYTE[task]}
                            if tail
                            else keyless_reference(
                                [row for runs in by_label.values() for run in runs for row in run[task]]
                            )
                        )
                        or None,
                    )
                )
    return images


def attention_plots(results: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Sink mass and mean attended distance vs length, one line per scheme, per training length and data."""
    from posenc.evaluate.plots import plot_lines  # matplotlib only when plotting

    images = []
    for (train_len, data), by_label in sorted(attention_groups(results).items()):
        for stat, ylabel, logy in (("sink", "sink mass", False), ("distance", "mean attended distance", True)):
            series = {}
            for label in order(by_label):
                per_run = [attention_means(run, stat) for run in by_label[label]]
                lengths = sorted({n for means in per_run for n in means})
                stats = [mean_halfwidth([means.get(n) for means in per_run]) for n in lengths]
                series[label] = (lengths, [m for m, _, _ in stats], [sd for _, sd, _ in stats])
            images.append(
                plot_lines(
                    series,
                    out_dir / f"attention_{stat}_L{train_len}_{data}.png",
                    f"{ylabel} vs length, mean over layers and heads (trained at L={train_len} on {data})",
                    "evaluation length (tokens)",
                    ylabel,
                    train_len=train_len,
                    logy=logy,
                    min_span=PPL_MIN_SPAN if logy else None,
                )
            )
    return images


def curve_plots(results: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """In-length validation accuracy by training step, per retrieval task: the mean over seeds, the seeds' range."""
    from posenc.evaluate.plots import plot_lines  # matplotlib only when plotting

    images = []
    for task in RETRIEVAL_TASKS:
        for train_len, by_label in sorted(task_columns(results, task).items()):
            series = {}
            for label in order(by_label):
                curves = [curve for curve in map(validation_curve, by_label[label]) if curve]
                steps = sorted(set.intersection(*(set(p["step"] for p in curve) for curve in curves))) if curves else []
                if not steps:
                    continue
                at = [[next(p["accuracy"] for p in curve if p["step"] == step) for curve in curves] for step in steps]
                series[label] = (
                    steps,
                    [statistics.fmean(values) for values in at],
                    ([min(values) for values in at], [max(values) for values in at]),
                )
            if series:
                images.append(
                    plot_lines(
                        series,
                        out_dir / f"{task}_validation_curve_L{train_len}.png",
                        f"{task}: in-length validation accuracy by step (trained at L={train_len}; band: seeds' range)",
                        "training step",
                        "validation accuracy (held-out training-format windows)",
                        logx=False,
                        ylim=ACCURACY_LIMITS,
                    )
                )
    return images
