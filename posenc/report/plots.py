"""The report's figures: one line per column (scheme), per training length; matplotlib is imported only here."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from posenc.report.attention import attention_groups, attention_means
from posenc.report.common import Columns, Key, mean_std, order
from posenc.report.perplexity import value
from posenc.report.tasks import TASKS, task_accuracies, task_columns


def perplexity_plots(groups: dict[Key, Columns], out_dir: Path) -> list[Path]:
    """Per group: perplexity vs length, ratio vs length, loss by position (one line per scheme)."""
    from posenc.evaluate.plots import plot_lines, smooth  # matplotlib only when plotting

    images = []
    for (train_len, mode, stride), by_label in sorted(groups.items(), key=lambda item: str(item[0])):
        suffix = f"L{train_len}_{mode}" + (f"_s{stride}" if stride else "")
        for field, ylabel, logy in (("ppl", "perplexity", True), ("ratio", "perplexity / in-length perplexity", True)):
            series = {}
            for label in order(by_label):
                lengths = sorted({row["length"] for run in by_label[label] for row in run["perplexity"]})
                stats = [mean_std([value(run, length, field) for run in by_label[label]]) for length in lengths]
                kept = [(length, m, s) for length, (m, s, n) in zip(lengths, stats, strict=True) if n]
                if kept:
                    series[label] = ([k[0] for k in kept], [k[1] for k in kept], [k[2] for k in kept])
            images.append(
                plot_lines(
                    series,
                    out_dir / f"{field}_vs_length_{suffix}.png",
                    f"{field} vs evaluation length (trained at L={train_len}, {mode})",
                    "evaluation length (tokens)",
                    ylabel,
                    train_len=train_len,
                    logy=logy,
                )
            )
        curves = {}
        for label in order(by_label):
            per_run = [run.get("loss_by_position") or {} for run in by_label[label]]
            common = set.intersection(*(set(c) for c in per_run)) if per_run else set()
            if common:
                longest = max(common, key=int)
                length = int(longest)
                mean_curve = [statistics.fmean(c[longest][i] for c in per_run) for i in range(length)]
                x, y = smooth(mean_curve)
                curves[label] = (x, y, None)
        if curves:
            images.append(
                plot_lines(
                    curves,
                    out_dir / f"loss_by_position_{suffix}.png",
                    f"loss by position (trained at {train_len})",
                    "position in window",
                    "loss (nats)",
                    train_len=train_len,
                )
            )
    return images


def task_plots(results: list[dict[str, Any]], out_dir: Path, tasks: Sequence[str] = TASKS) -> list[Path]:
    """Accuracy vs length, one line per scheme, per task and training length."""
    from posenc.evaluate.plots import plot_lines  # matplotlib only when plotting

    images = []
    for task in tasks:
        for train_len, by_label in sorted(task_columns(results, task).items()):
            series = {}
            for label in order(by_label):
                lengths = sorted({row["length"] for run in by_label[label] for row in run[task]})
                stats = [mean_std(task_accuracies(by_label[label], task, length)) for length in lengths]
                series[label] = (lengths, [m for m, _, _ in stats], [s for _, s, _ in stats])
            images.append(
                plot_lines(
                    series,
                    out_dir / f"{task}_accuracy_L{train_len}.png",
                    f"{task} accuracy vs length (trained at L={train_len})",
                    "evaluation length (tokens)",
                    "exact-match accuracy",
                    train_len=train_len,
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
                stats = [mean_std([means.get(n) for means in per_run]) for n in lengths]
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
                )
            )
    return images
