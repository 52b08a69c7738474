"""Cost against extrapolation in one picture: each column a point, training speed across, length degradation up.

x is the column's training throughput (tokens per second of its runs, the median over seeds: a run slowed by other
work on the machine moves a mean, not a median of three) relative to NoPE's in the same report, the scheme that
adds no work; without a NoPE column, relative to the fastest column, and the axis says so. y is the column's
perplexity ratio at the largest evaluated length to its in-length perplexity (log scale, 1.0 kept in view), with
its 95% Student-t interval over seeds as error bars. A run's throughput is the ``tokens_per_sec`` of its
``run.json``: the tokens it trained over its training loop's seconds (steps and data loading; validation and the
end-of-training evaluation left out, since the evaluation's length is not the scheme's training cost). Runs written
before that field existed fall back to tokens over ``train_seconds``, the wall time of the whole training call,
evaluation included, which is slower.

Each point is named by the legend beside the axes, keyed by a marker and colour that no other point shares: names
written next to the points collide where most schemes sit near ratio 1. A throughput read from a run's own log is
comparable with another's only when both ran under the same conditions: each run records its device, its threads
and the machine's load while it trained (``train_conditions`` in ``run.json``), and where the columns' conditions
differ the chart says so under its axes, naming them, rather than draw a difference in load as a difference in
cost.
"""

from __future__ import annotations

import statistics
import textwrap
from pathlib import Path
from typing import Any

from posenc.evaluate import RATIO_MIN_SPAN
from posenc.jsonio import read_record
from posenc.report.benchcost import bench_speeds, measured_steps, train_len
from posenc.report.common import Columns, Key, interval, order, run_dir
from posenc.report.perplexity import group_runs, protocol, suffix, value
from posenc.runs import RUN_FILE

REFERENCE = "nope"
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">", "p", "h", "d", "8", "H")
# Load per core (the 1-minute load average over the cores) that two columns may differ by and still be read as run
# under the same conditions: half a core busy with something else changes a CPU run's throughput visibly.
LOAD_PER_CORE_TOLERANCE = 0.25


def run_record(run: dict[str, Any]) -> dict[str, Any] | None:
    """The run's ``run.json``, ``None`` where it has none or it cannot be read."""
    if not run.get("_source"):
        return None
    try:
        return read_record(Path(run_dir(run)) / RUN_FILE)
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def throughput(run: dict[str, Any]) -> float | None:
    """Training tokens per second recorded by the run (``run.json``), ``None`` where it recorded none."""
    record = run_record(run)
    if record is None:
        return None
    if record.get("tokens_per_sec"):
        return float(record["tokens_per_sec"])
    if record.get("resumed_from") and "segment" not in record:
        return None  # written before resumed runs carried their earlier seconds: its seconds are the last process's
    tokens, seconds = record.get("tokens"), record.get("train_seconds")
    return float(tokens) / float(seconds) if tokens and seconds else None


def conditions_note(by_label: Columns) -> str | None:
    """One sentence naming how the columns' training conditions differ, or ``None`` when they match.

    Compared: the device, the threads torch used, and the load per core while the run trained (median over a
    column's runs). Runs that recorded no conditions are named as such.
    """
    seen: dict[str, dict[str, Any]] = {}
    unknown = []
    for label, runs in by_label.items():
        recorded = [c for c in ((run_record(run) or {}).get("train_conditions") for run in runs) if c]
        if not recorded:
            unknown.append(label)
            continue
        loads = [c["load_per_core"] for c in recorded if c.get("load_per_core") is not None]
        seen[label] = {
            "device": sorted({c.get("device") for c in recorded}),
            "threads": sorted({c.get("threads") for c in recorded}),
            "load": statistics.median(loads) if loads else None,
        }
    differences = []
    for field in ("device", "threads"):
        if len({str(c[field]) for c in seen.values()}) > 1:
            differences.append(
                field + ": " + ", ".join(f"{label} {'/'.join(map(str, c[field]))}" for label, c in seen.items())
            )
    loads = {label: c["load"] for label, c in seen.items() if c["load"] is not None}
    if loads and max(loads.values()) - min(loads.values()) > LOAD_PER_CORE_TOLERANCE:
        calm = min(loads.values())
        busier = sorted((label for label in loads if loads[label] > calm + LOAD_PER_CORE_TOLERANCE), key=loads.get)
        rest = [loads[label] for label in loads if label not in busier]
        differences.append(
            "load per core while training: "
            + ", ".join(f"{label} {loads[label]:.2f}" for label in reversed(busier))
            + f"; the other columns {min(rest):.2f}–{max(rest):.2f}"
        )
    if unknown and seen:
        differences.append("not recorded for " + ", ".join(unknown))
    if not differences:
        return None
    return "throughput from each run's own log, under conditions that differ (" + "; ".join(differences) + ")"


def cost_points(by_label: Columns, bench: list[dict[str, Any]] | None = None) -> tuple[list[dict[str, Any]], str]:
    """The points of one group, and what x is relative to (``NoPE`` or ``the fastest column``).

    With ``bench`` (``find_bench``) measuring every column, x is its side-by-side train step relative to NoPE's.

    Each point: label, relative throughput, the ratio's mean, half-width (``None`` for one seed) and n, and the
    length it was read at. Columns without a recorded throughput or a ratio at the largest length are left out.
    """
    lengths = sorted({row["length"] for runs in by_label.values() for run in runs for row in run["perplexity"]})
    if not lengths:
        return [], ""
    longest = lengths[-1]
    relative = bench_speeds(by_label, bench or [])  # already relative to NoPE's step
    if relative:
        against = "NoPE, one train step of each timed in turn in one process (posenc.bench)"
    else:
        speeds: dict[str, float] = {}
        for label, runs in by_label.items():
            measured = [speed for speed in map(throughput, runs) if speed is not None]
            if measured:
                speeds[label] = statistics.median(measured)
        if not speeds:
            return [], ""
        reference = REFERENCE if REFERENCE in speeds else max(speeds, key=speeds.__getitem__)
        against = "NoPE" if reference == REFERENCE else f"the fastest column ({reference}; no NoPE column)"
        relative = {label: speed / speeds[reference] for label, speed in speeds.items()}
    points = []
    for label in order(relative):
        ratio = interval([value(run, longest, "ratio") for run in by_label[label]])
        if ratio is None:
            continue
        points.append(
            {
                "label": label,
                "throughput": relative[label],
                "ratio": ratio.mean,
                "half_width": ratio.half_width,
                "n": ratio.n,
                "length": longest,
            }
        )
    return points, against


NOTE_LINES = 12  # a longer note (a sweep of many columns in many conditions) is cut: the report's table has it all


def _note_below(fig: Any, note: str) -> None:
    """``note`` under the axes, the figure made taller by its lines so that the axes keep their size however long."""
    lines = textwrap.wrap(note, 130)
    if len(lines) > NOTE_LINES:
        lines = [*lines[: NOTE_LINES - 1], "… (the rest in the report's cost section)"]
    width, height = fig.get_size_inches()
    extra = 0.12 * len(lines)  # inches: 7-point lines
    fig.set_size_inches(width, height + extra)
    fig.subplots_adjust(bottom=(0.14 * height + extra) / (height + extra))
    fig.text(0.01, 0.005, "\n".join(lines), fontsize=7, color="firebrick", va="bottom")


def cost_plots(groups: dict[Key, Columns], out_dir: Path, bench: list[dict[str, Any]] | None = None) -> list[Path]:
    """One PNG per (training length, mode): each column a point with its seed interval as an error bar.

    x comes from ``bench`` where it measured every column (then the runs' own conditions do not matter and are not
    noted), else from the runs' logs with a note under the axes where their conditions differ.
    """
    from posenc.evaluate.plots import line_figure, plt, save_figure  # matplotlib only when plotting

    images = []
    for key, by_label in sorted(groups.items(), key=lambda item: str(item[0])):
        train_len, mode, stride = key
        points, against = cost_points(by_label, bench)
        if not points:
            continue
        longest = points[0]["length"]
        ends = [p["ratio"] + sign * (p["half_width"] or 0.0) for p in points for sign in (-1, 1)]
        fig, ax = line_figure(
            {p["label"]: ([p["throughput"]], [p["ratio"]], None) for p in points},
            f"cost vs extrapolation (trained at L={train_len}; {protocol(mode, stride)})",
            textwrap.fill(f"training throughput relative to {against}", 80),
            f"perplexity ratio at {longest / train_len:g}× vs 1× (95% t interval over seeds)",
            logx=False,
            logy=True,
            include=(1.0, *ends),
            min_span=RATIO_MIN_SPAN,
        )
        colours = plt.get_cmap("tab10").colors
        for index, (line, point) in enumerate(zip(ax.get_lines(), points, strict=False)):
            # A marker and colour per point that no other point shares: the legend names each one.
            colour = colours[index % len(colours)]
            line.set(marker=MARKERS[index // len(colours) % len(MARKERS)], markersize=7, color=colour)
            error = [[point["half_width"] or 0.0], [point["half_width"] or 0.0]]
            ax.errorbar([point["throughput"]], [point["ratio"]], yerr=error, color=colour, capsize=4)
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), numpoints=1)
        note = None if bench_speeds(by_label, bench or []) else conditions_note(by_label)
        if note:
            _note_below(fig, note)
        ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
        low, high = min(p["throughput"] for p in points), max(p["throughput"] for p in points)
        ax.set_xlim(low - 0.05 * max(high - low, 0.2), high + 0.05 * max(high - low, 0.2))
        path = out_dir / f"cost_vs_extrapolation_{suffix(key)}.png"
        save_figure(fig, path, dpi=120)
        images.append(path)
    return images


def cost_plots_of(
    results: list[dict[str, Any]], out_dir: Path, bench: list[dict[str, Any]] | None = None
) -> list[Path]:
    """``cost_plots`` over the report's language-modelling groups."""
    return cost_plots(group_runs(results), out_dir, bench)


def cost_section(results: list[dict[str, Any]], bench: list[dict[str, Any]]) -> list[str]:
    """The side-by-side cost table, once per training length (cost does not depend on the evaluation protocol)."""
    lines: list[str] = []
    seen: set[int] = set()
    for (length, _mode, _stride), by_label in group_runs(results).items():
        if length not in seen:
            seen.add(length)
            table = cost_table(by_label, bench)
            lines += ["", table] if table else []
    return lines


def log_cost_scatter(results: list[dict[str, Any]], run: Any) -> None:
    """The same points as a ``wandb.plot.scatter`` per group, logged to the active W&B ``run``."""
    import wandb

    for group, by_label in group_runs(results).items():
        points, against = cost_points(by_label)
        if not points:
            continue
        fields = ["label", "throughput", "ratio", "half_width", "n", "length"]
        table = wandb.Table(columns=fields, data=[[p[f] for f in fields] for p in points])
        key = f"report/cost_vs_extrapolation_{suffix(group)}"
        title = f"ratio at {points[0]['length']} vs throughput relative to {against}"
        run.log({key: wandb.plot.scatter(table, "throughput", "ratio", title=title)})


def _logged(runs: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """A column's median tokens/s and median load per core, from its runs' own records."""
    speeds = [speed for speed in map(throughput, runs) if speed is not None]
    conditions = [(run_record(run) or {}).get("train_conditions") or {} for run in runs]
    loads = [c["load_per_core"] for c in conditions if c.get("load_per_core") is not None]
    return (statistics.median(speeds) if speeds else None), (statistics.median(loads) if loads else None)


def cost_table(by_label: Columns, bench: list[dict[str, Any]]) -> str:
    """Per column: the benchmark's step (ms, ×NoPE) beside the runs' own throughput (×NoPE) and load."""
    rows = measured_steps(bench, train_len(by_label))
    if not rows:
        return ""
    logged = {label: _logged(runs) for label, runs in by_label.items()}
    nope = logged.get("nope", (None, None))[0]
    first = next(iter(rows.values()))
    env = first["environment"]
    lines = [
        "## Training cost, measured side by side",
        "",
        f"One train step of every scheme timed in turn in one process (`python -m posenc.bench`): L = "
        f"{first['seq_len']}, batch {first['batch']}, on {env.get('device', 'a device not recorded')} with "
        f"{env.get('threads', '?')} thread(s), torch {env.get('torch', '?')}, {env.get('date', 'date not recorded')}; "
        "the median of each scheme's steps. Beside it, each column's throughput from its own runs' logs "
        "(median over seeds) and the load per core those runs recorded while training: a throughput from a log "
        "compares with another only where the loads match.",
        "",
        "| scheme | parameters | step ms (side by side) | ×NoPE [95% interval] (side by side) | tokens/s (runs' logs) "
        "| ×NoPE (runs' logs) | load per core (runs) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label in order(set(by_label) | set(rows)):
        row = rows.get(label, {})
        speed, load = logged.get(label, (None, None))
        cells = [
            label,
            f"{row['parameters']:,}" if row.get("parameters") else "—",
            f"{row['step_ms']:.1f}" if row.get("step_ms") else "—",
            _ratio_cell(row),
            f"{speed:,.0f}" if speed else "—",
            f"{speed / nope:.2f}" if speed and nope else "—",
            f"{load:.2f}" if load is not None else "—",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio_cell(row: dict[str, Any]) -> str:
    """The benchmark's ratio to NoPE, with its interval over the repetitions where it recorded one."""
    if row.get("x_nope") is None:
        return "—"
    interval = row.get("x_nope_interval") or []
    return f"{row['x_nope']:.2f}" + (" [{:.2f}, {:.2f}]".format(*interval) if len(interval) == 2 else "")
