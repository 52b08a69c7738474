"""Matplotlib figures for one run and for a comparison of runs (Agg backend: no display needed)."""

from __future__ import annotations

import io
import itertools
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")  # before pyplot: plots are written to files, there is no display
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from posenc.jsonio import write_bytes


def save_figure(fig: Figure, path: Path, dpi: int) -> None:
    """Render ``fig`` in memory, write it atomically (``posenc.jsonio.write_bytes``) and close it.

    A PNG is stored with a palette of 256 colours: line plots hold far fewer, and the full-colour file is about three
    times the size, which a repository of study figures pays for in every clone.
    """
    image = io.BytesIO()
    try:
        fig.savefig(image, format=path.suffix.lstrip(".") or "png", dpi=dpi)
    finally:
        plt.close(fig)
    if path.suffix.lower() == ".png":
        image = palette_png(image)
    write_bytes(path, image.getbuffer())


def palette_png(image: io.BytesIO) -> io.BytesIO:
    """The PNG ``image`` re-encoded with a 256-colour palette (Pillow, which matplotlib itself depends on)."""
    from PIL import Image

    out = io.BytesIO()
    Image.open(image).convert("RGB").quantize(colors=256).save(out, format="PNG", optimize=True)
    return out


def plot_lines(
    series: Mapping[str, tuple[Sequence[float], Sequence[float], Sequence[float] | None]],
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    train_len: int | None = None,
    logx: bool = True,
    logy: bool = False,
    include: Sequence[float] = (),
    min_span: float | None = None,
    ylim: tuple[float, float] | None = None,
    references: Mapping[str, float] | None = None,
) -> Path:
    """One line (with an optional band) per series: {name: (x, y, band)}; see ``line_figure``.

    A band is None, half-widths around y, or (lows, highs).
    """
    fig, _ = line_figure(series, title, xlabel, ylabel, train_len, logx, logy, include, min_span, ylim, references)
    save_figure(fig, path, dpi=120)
    return path


def line_figure(
    series: Mapping[str, tuple[Sequence[float], Sequence[float], Sequence[float] | None]],
    title: str,
    xlabel: str,
    ylabel: str,
    train_len: int | None = None,
    logx: bool = True,
    logy: bool = False,
    include: Sequence[float] = (),
    min_span: float | None = None,
    ylim: tuple[float, float] | None = None,
    references: Mapping[str, float] | None = None,
) -> tuple[plt.Figure, plt.Axes]:
    """The figure of ``plot_lines``, with a y axis that cannot exaggerate.

    ``include`` keeps values in view (1.0 on a ratio axis: no degradation), ``min_span`` is the least the axis
    spans (a factor on a log axis, a difference on a linear one), so that a change of 0.02 never fills the plot,
    and ``ylim`` fixes the axis (accuracy: 0 to 1). ``references`` are labelled horizontal lines (a chance level).
    Narrow log axes get plain, distinct tick labels.
    """
    fig, ax = plt.subplots(figsize=(8, 5))
    # Past 10 series matplotlib's default cycle repeats colours: draw from tab20 and vary the dash as well.
    colours = plt.get_cmap("tab10" if len(series) <= 10 else "tab20").colors
    shown: list[float] = list(include)
    for index, (name, (x, y, band)) in enumerate(series.items()):
        x, y = np.asarray(x, dtype=float), np.asarray([np.nan if v is None else v for v in y], dtype=float)
        style = {"color": colours[index % len(colours)], "linestyle": ("-", "--", ":")[index // len(colours) % 3]}
        ax.plot(x, y, marker="o" if len(x) < 20 else None, markersize=3, label=name, **style)
        shown += list(y)
        if band is not None:
            low, high = _band(y, band)
            ax.fill_between(x, low, high, alpha=0.2, color=style["color"])
            shown += list(low) + list(high)
    for (name, level), dash in zip((references or {}).items(), itertools.cycle((":", "-.")), strict=False):
        ax.axhline(level, color="black", linestyle=dash, linewidth=1, label=f"{name} {level:.2g}")
        shown.append(level)
    if train_len is not None:
        ax.axvline(train_len, color="grey", linestyle="--", linewidth=1, label=f"training length {train_len}")
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    finite = [v for v in shown if np.isfinite(v) and (v > 0 or not logy)]
    if ylim is not None:
        ax.set_ylim(*ylim)
    elif finite:
        ax.set_ylim(*_limits(min(finite), max(finite), logy, min_span))
    if logy:
        low, high = ax.get_ylim()
        if high / low < 20:  # a log axis without a full decade: plain ticks, each label distinct
            ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]))
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter(useOffset=False))  # 3, not 3×10^0
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.set_title(textwrap.fill(title, 80), fontsize=10)  # long protocol names would run off the figure
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return fig, ax


def _band(y: np.ndarray, band: Sequence[float] | tuple[Sequence[float], Sequence[float]]) -> tuple[np.ndarray, ...]:
    """(low, high) of a band given as half-widths around ``y``, or as its two edges.

    An interval need not be symmetric: an accuracy's stays in [0, 1].
    """
    if isinstance(band, tuple) and len(band) == 2 and np.ndim(band[0]) == 1:
        return np.asarray(band[0], dtype=float), np.asarray(band[1], dtype=float)
    half = np.asarray(band, dtype=float)
    return y - half, y + half


def _limits(low: float, high: float, log: bool, min_span: float | None) -> tuple[float, float]:
    """Data limits widened to ``min_span`` around their middle, plus a 5% margin."""
    if log:
        low_log, high_log = _limits(np.log(low), np.log(high), False, np.log(min_span) if min_span else None)
        return float(np.exp(low_log)), float(np.exp(high_log))
    if min_span and high - low < min_span:
        middle = (low + high) / 2
        low, high = middle - min_span / 2, middle + min_span / 2
    margin = 0.05 * (high - low) or 0.05 * abs(high) or 0.05
    return low - margin, high + margin


def plot_heatmap(
    matrix: np.ndarray, rows: Sequence, cols: Sequence, path: Path, title: str, xlabel: str, ylabel: str
) -> Path:
    """Accuracy grid (e.g. passkey: depth × length), 0..1, values printed in the cells."""
    fig, ax = plt.subplots(figsize=(1.0 + 0.8 * len(cols), 1.0 + 0.5 * len(rows)))
    image = ax.imshow(matrix, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
    ax.set_xticks(range(len(cols)), [str(c) for c in cols])
    ax.set_yticks(range(len(rows)), [str(r) for r in rows])
    for (i, j), value in np.ndenumerate(matrix):
        ax.text(j, i, f"{value:.2f}", ha="center", va="center", color="white" if value < 0.6 else "black", fontsize=7)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    return path


def plot_heatmap_grid(
    panels: Sequence[Sequence[np.ndarray]],
    row_names: Sequence[str],
    col_names: Sequence[str],
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
) -> Path:
    """A grid of heatmaps (rows × columns of panels, e.g. statistic × length), one colour scale per grid row.

    Sharing the scale along a row makes the panels of one statistic comparable across lengths.
    """
    nrows, ncols = len(panels), len(panels[0])
    height, width = panels[0][0].shape
    size = (1.5 + ncols * (0.6 + 0.45 * width), 1.0 + nrows * (1.0 + 0.4 * height))
    fig, axes = plt.subplots(nrows, ncols, figsize=size, squeeze=False, layout="constrained")
    for r, row in enumerate(panels):
        low, high = min(float(np.min(m)) for m in row), max(float(np.max(m)) for m in row)
        for c, matrix in enumerate(row):
            ax = axes[r][c]
            image = ax.imshow(matrix, vmin=low, vmax=high, cmap="viridis", aspect="auto", origin="lower")
            ax.set_xticks(range(width))
            ax.set_yticks(range(height))
            ax.set_title(f"{row_names[r]} · {col_names[c]}", fontsize=8)
            if r == nrows - 1:
                ax.set_xlabel(xlabel, fontsize=8)
            if c == 0:
                ax.set_ylabel(ylabel, fontsize=8)
        fig.colorbar(image, ax=list(axes[r]), shrink=0.8)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path, dpi=110)
    return path
