"""The positional-parameter section: how far each learnable scheme's parameters moved, and what its bias became.

A learnable scheme is compared as learned only where its parameters learned. The drift table gives, per column,
the largest relative change of any scheme tensor since the start and over the last tenth of training (mean over
seeds), and marks a column whose parameters are still moving or have barely moved in any seed (thresholds:
``posenc/evaluate/drift.py``). The bias table and figure show each scheme's first-layer bias by query–key distance
(``posenc/evaluate/bias_curve.py``): learned schemes beside the fixed ones, per head, from one seed per column.
"""

from __future__ import annotations

import csv
import functools
import math
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any

from posenc.evaluate.drift import BARELY_MOVED, STILL_MOVING
from posenc.report.common import Appendix, Columns, drift_counts, interval_cells, order, run_dir, table_head
from posenc.training.identity import columns

FIXED = "fixed"  # a column whose scheme has no trainable positional parameter
STILL, BARELY, SETTLED = "still moving", "barely moved", "settled"
DRIFT_LEGEND = (
    "Change is measured on what attention sees where the scheme has a bias: each layer's bias over a window of the "
    "training length (three query rows over every key), each row's constant removed, since softmax ignores it; a "
    "scheme without a bias is measured on its tensors. Change is relative to the initial size, ‖f_end − f_ref‖ / "
    "‖f_start‖ (a function or tensor that starts near zero is measured against an RMS of 0.01 per entry), the "
    "largest over the layers; cells are the mean over seeds ± the half-width of its 95% Student-t interval. "
    f"**{STILL}**: in some seed the last 10% of training moved it at more than {STILL_MOVING:g} of its average speed, "
    "each per unit of learning rate spent (its final value depends on when training stopped, whatever the step "
    f"count); **{BARELY}**: in some seed it changed by less than {BARELY_MOVED:g} in all (still close to its "
    f"initialisation); {FIXED}: no trainable positional parameter. A learnable scheme marked either way is not "
    "compared as learned. (Runs recorded before the function was watched were marked by their tensors, with a last "
    "tenth's change above 0.05 as still moving; their records say which.)"
)


def drift_groups(results: list[dict[str, Any]], field: str) -> dict[int, Columns]:
    """{train_len: {column: runs}} of the runs whose results hold ``field`` (``positional_drift``, ``learned_bias``).

    A run of a fixed scheme records ``positional_drift`` as null and still has a column (marked fixed).
    """
    # One result a training run: its other evaluations (sliding windows, a scaling) hold the same parameters. The
    # end-of-training evaluation (eval/) is the one kept where there are several.
    one_each: dict[str, dict[str, Any]] = {}
    for run in results:
        if field in run and not run.get("failed"):
            key = run_dir(run) if run.get("_source") else f"{run.get('run_name')}/{run.get('seed')}"
            if key not in one_each or Path(run.get("_source", "")).parent.name == "eval":
                one_each[key] = run
    by_length: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for run in one_each.values():
        by_length[int(run["train_len"])].append(run)
    return {train_len: columns(runs) for train_len, runs in by_length.items()}


def column_mark(runs: list[dict[str, Any]]) -> str:
    """``still moving``, ``barely moved`` (both when both), ``settled`` or ``fixed`` for a column's runs."""
    moving, barely, recorded = drift_counts(runs)
    if not recorded:
        return FIXED
    marks = [STILL] * bool(moving) + [BARELY] * bool(barely)
    return ", ".join(f"**{m}**" for m in marks) or SETTLED


def _seeds_with(runs: list[dict[str, Any]], test: Any) -> str:
    records = [run["positional_drift"] for run in runs if run.get("positional_drift") is not None]
    return f"{sum(1 for r in records if test(r))}/{len(records)}" if records else "—"


def _measured_on(runs: list[dict[str, Any]]) -> str:
    records = [run["positional_drift"] for run in runs if run.get("positional_drift") is not None]
    return ", ".join(sorted({r.get("measured_on", "tensors") for r in records})) or "—"


def _change_cells(by_label: Columns, labels: list[str], name: str) -> dict[str, str]:
    """{column: mean ± half-width over seeds} of one figure of the runs' drift records."""
    values = {label: [(run.get("positional_drift") or {}).get(name) for run in by_label[label]] for label in labels}
    return interval_cells(values, digits=4)


def drift_tables(results: list[dict[str, Any]], appendix: Appendix | None = None) -> str:
    """The drift table and the bias-by-distance table, per training length."""
    out = []
    for train_len, by_label in sorted(drift_groups(results, "positional_drift").items()):
        labels = order(by_label)
        title = f"Positional parameters, trained at L={train_len}"
        out += [f"## {title}", "", DRIFT_LEGEND, ""]
        out += table_head(by_label, labels, first="| figure | ", title=title, appendix=appendix)

        total, late, speed = (
            _change_cells(by_label, labels, name)
            for name in ("max_total_change", "max_late_change", "late_speed_ratio")
        )
        rows = {
            "largest total change": [total[x] for x in labels],
            "largest change over the last 10%": [late[x] for x in labels],
            "last 10%'s speed / average speed": [speed[x] for x in labels],
            "seeds still moving": [_seeds_with(by_label[x], lambda r: bool(r.get("still_moving"))) for x in labels],
            "seeds barely moved": [_seeds_with(by_label[x], lambda r: bool(r.get("barely_moved"))) for x in labels],
            "measured on": [_measured_on(by_label[x]) for x in labels],
            "mark": [column_mark(by_label[x]) for x in labels],
        }
        out += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in rows.items()]
        out.append("")
    out += _curve_tables(results, appendix)
    out += _bias_tables(results, appendix)
    return "\n".join(out)


CURVE_FRACTIONS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0)  # the steps at which the curve table reads each run's change
CSV_LOG = "csv/metrics.csv"  # where a run's CSV logger writes; older runs logged their drift curve only there


def drift_curve(run: dict[str, Any]) -> list[list[float]]:
    """``[[step, largest change so far], …]`` of one run: from its record, else from its CSV log (older runs).

    Runs recorded before the curve went into ``positional_drift`` logged it as ``drift/max`` in
    ``<run>/csv/metrics.csv`` (whose steps count from 0: step s there is s + 1 optimizer steps done).
    """
    record = run.get("positional_drift") or {}
    if record.get("curve"):
        return record["curve"]
    if not record or not run.get("_source"):
        return []
    return [list(point) for point in _csv_curve(str(Path(run_dir(run)) / CSV_LOG))]


@functools.lru_cache(maxsize=256)
def _csv_curve(metrics: str) -> tuple[tuple[int, float], ...]:
    """One CSV log's curve, read once a process: the table and the figure both ask for it."""
    try:
        with open(metrics, newline="") as handle:
            rows = [row for row in csv.DictReader(handle) if row.get("drift/max")]
        return tuple((int(row["step"]) + 1, float(row["drift/max"])) for row in rows)
    except (OSError, ValueError, KeyError):
        return ()


def _at(curve: list[list[float]], step: float) -> float | None:
    """The curve's value at the last logged step at or before ``step``."""
    before = [value for at, value in curve if at <= step]
    return before[-1] if before else None


def _curve_tables(results: list[dict[str, Any]], appendix: Appendix | None) -> list[str]:
    out = []
    for train_len, by_label in sorted(drift_groups(results, "positional_drift").items()):
        curves = {label: [drift_curve(run) for run in runs] for label, runs in by_label.items()}
        labels = [label for label in order(by_label) if any(curves[label])]
        if not labels:
            continue
        steps = {label: max(curve[-1][0] for curve in curves[label] if curve) for label in labels}
        title = f"Positional parameters by step, trained at L={train_len}"
        out += [
            f"## {title}",
            "",
            "The largest relative change of any scheme tensor since the start, at each fraction of training (the "
            "last step logged at or before it; mean over seeds ± the half-width of its 95% Student-t interval). A "
            "curve that is still rising at 90%–100% had not settled; the figure draws every logged step.",
            "",
            *table_head({x: by_label[x] for x in labels}, labels, first="| step | ", title=title, appendix=appendix),
        ]
        for fraction in CURVE_FRACTIONS:
            values = {
                label: [_at(curve, fraction * steps[label]) if curve else None for curve in curves[label]]
                for label in labels
            }
            cells = interval_cells(values, digits=4)
            out.append(f"| {fraction:.0%} | " + " | ".join(cells[label] for label in labels) + " |")
        out.append("")
    return out


def drift_curve_plots(results: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Per training length, the largest change so far by step: a line per column (its seeds' mean), log scale.

    Written beside its final name and renamed: a reader never sees half a PNG.
    """
    images = []
    for train_len, by_label in sorted(drift_groups(results, "positional_drift").items()):
        lines = {}
        for label in order(by_label):
            curves = [curve for curve in (drift_curve(run) for run in by_label[label]) if curve]
            if curves:
                steps = sorted({step for curve in curves for step, _ in curve})
                mean = [sum(_at(curve, step) or 0.0 for curve in curves) / len(curves) for step in steps]
                lines[label] = (steps, mean, len(curves))
        if lines:
            images.append(_curve_figure(lines, train_len, out_dir / f"drift_curve_L{train_len}.png"))
    return images


def _curve_figure(lines: dict[str, tuple[list[int], list[float], int]], train_len: int, path: Path) -> Path:
    """One panel per scheme, a line per column of it (a swept setting reads as a sequence of colours)."""
    from posenc.evaluate.plots import plt  # matplotlib (Agg) only when plotting

    by_scheme: dict[str, list[str]] = defaultdict(list)
    for label in lines:
        by_scheme[label.split(" · ")[0]].append(label)
    fig, axes = _panels(plt, len(by_scheme), (4.6, 3.6))
    for ax, (scheme, labels) in zip(axes, by_scheme.items(), strict=False):
        colours = plt.cm.viridis([i / max(len(labels) - 1, 1) * 0.9 for i in range(len(labels))])
        for colour, label in zip(colours, labels, strict=True):
            steps, mean, seeds = lines[label]
            shown = label.split(" · ", 1)[1] if " · " in label else label
            ax.plot(steps, mean, linewidth=1.2, color=colour, label=f"{shown} (n={seeds})")
        ax.set_yscale("log")
        ax.set_xlim(left=0)  # steps count from 0: no axis spent before the first
        ax.axhline(BARELY_MOVED, color="grey", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
        ax.set_title(scheme, fontsize=9)
        ax.set_xlabel("optimizer step", fontsize=8)
        ax.set_ylabel("largest relative change since the start", fontsize=8)
        ax.legend(fontsize=6, loc="lower right")
    _title(fig, f"Positional parameters by step, trained at L={train_len} (seeds' mean; dotted: 'barely moved')")
    return _save(fig, path)


def _panels(plt: Any, count: int, size: tuple[float, float]) -> tuple[Any, list[Any]]:
    """A grid of ``count`` panels, three to a row, the unused cells of its last row hidden."""
    width = min(count, 3)
    rows = math.ceil(count / width)
    fig, grid = plt.subplots(rows, width, figsize=(size[0] * width, size[1] * rows), squeeze=False)
    axes = list(grid.flat)
    for ax in axes[count:]:
        ax.set_visible(False)
    return fig, axes[:count]


def _title(fig: Any, text: str) -> None:
    """A figure's title wrapped to its width (a single panel is narrow), laid out above the panels, never cut."""
    points = fig.get_figwidth() * 72
    fig.suptitle(textwrap.fill(text, max(30, int(points / 5.5))), fontsize=10)  # about 5.5 points a character at 10
    fig.tight_layout()


def _save(fig: Any, path: Path) -> Path:
    from posenc.evaluate.plots import save_figure  # matplotlib only when plotting

    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path, dpi=110)
    return path


def first_seed(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of a column drawn in its bias table and figure: the lowest seed (heads of two seeds do not pair)."""
    return min(runs, key=lambda run: (str(type(run.get("seed"))), run.get("seed") or 0))


def _bias_tables(results: list[dict[str, Any]], appendix: Appendix | None) -> list[str]:
    out = []
    for train_len, by_label in sorted(drift_groups(results, "learned_bias").items()):
        curves = {label: first_seed(runs)["learned_bias"] for label, runs in by_label.items()}
        labels = [label for label in order(by_label) if curves[label] is not None]
        if not labels:
            continue
        longest = min(curves[label]["query_position"] for label in labels)
        wanted = sorted({0, 1, 4, train_len // 4, train_len - 1, 4 * train_len, longest})
        wanted = [d for d in wanted if 0 <= d <= longest]
        title = f"First-layer bias by distance, trained at L={train_len}"
        shown = {label: by_label[label] for label in labels}
        out += [
            f"## {title}",
            "",
            "The bias added to a query's score for a key d tokens back, in the first layer, from each column's lowest "
            "seed: the lowest and highest over heads (every head in the figure). Learned schemes read as trained; "
            "a content-dependent bias is read at zero content (q = k = 0).",
            "",
            *table_head(shown, labels, first="| distance | ×L | ", title=title, appendix=appendix),
        ]
        for distance in wanted:
            cells = []
            for label in labels:
                curve = curves[label]
                index = min(range(len(curve["distances"])), key=lambda i: abs(curve["distances"][i] - distance))
                at = [head[index] for head in curve["by_head"]]
                cells.append(f"{min(at):.3f} … {max(at):.3f}" if len(at) > 1 else f"{at[0]:.3f}")
            out.append(f"| {distance} | {distance / train_len:.3g} | " + " | ".join(cells) + " |")
        out.append("")
    return out


def learned_bias_plots(results: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Per training length, one panel per column: its first-layer bias vs distance, a line per head (lowest seed).

    Written beside its final name and renamed: a reader never sees half a PNG.
    """
    images = []
    for train_len, by_label in sorted(drift_groups(results, "learned_bias").items()):
        curves = {label: first_seed(by_label[label])["learned_bias"] for label in order(by_label)}
        curves = {label: curve for label, curve in curves.items() if curve is not None}
        if curves:
            images.append(_bias_figure(curves, train_len, out_dir / f"learned_bias_L{train_len}.png"))
    return images


def _bias_figure(curves: dict[str, dict[str, Any]], train_len: int, path: Path) -> Path:
    from posenc.evaluate.plots import plt  # matplotlib (Agg) only when plotting

    fig, axes = _panels(plt, len(curves), (4.2, 3.2))
    for ax, (label, curve) in zip(axes, curves.items(), strict=False):
        for head, values in enumerate(curve["by_head"]):
            ax.plot(curve["distances"], values, linewidth=1, label=f"head {head}")
        ax.axvline(train_len, color="grey", linestyle="--", linewidth=1)
        ax.set_xscale("symlog", linthresh=1)  # distance 0 on a log-like axis
        ax.set_xlim(left=0)  # distances are never negative: no half of the axis spent on negative ticks
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
        ax.set_xlabel("query–key distance (tokens)", fontsize=8)
        ax.set_ylabel("bias added to the score", fontsize=8)
    axes[0].legend(fontsize=6)
    _title(fig, f"First-layer bias by distance, per head (lowest seed; dashed: training length {train_len})")
    return _save(fig, path)
