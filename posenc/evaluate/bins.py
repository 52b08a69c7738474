"""Loss by position in log-spaced bins: what every loss-by-position figure draws, and all a kept record holds of it.

Why bins: a window of 2,048 positions drawn on a log axis shows the first tokens and the far ones at once only when
positions are averaged in bins that widen with distance; and a run's 2,048 per-position losses were half of its kept
record, where the figure reads 64 numbers. The bins follow from the window's length alone, so a curve kept binned
and one binned when drawn are the same figure.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

BINS = 64


def edges(length: int, bins: int = BINS) -> list[int]:
    """Positions (1-based) where the log-spaced bins of a window of ``length`` start, and the last one's end."""
    return [int(e) for e in np.unique(np.geomspace(1, length, num=min(bins, length) + 1).astype(int))]


def centres(bounds: Sequence[int]) -> np.ndarray:
    """The middle position of each bin between consecutive ``bounds`` (from ``edges``)."""
    return np.asarray([(lo + hi - 1) / 2 for lo, hi in itertools.pairwise(bounds)])


def smooth(values: Sequence[float], bins: int = BINS) -> tuple[np.ndarray, np.ndarray]:
    """Mean of ``values`` in log-spaced position bins, so both the first tokens and far positions stay readable."""
    array = np.asarray(values, dtype=float)
    bounds = edges(len(array), bins)
    means = [array[lo - 1 : hi - 1].mean() for lo, hi in itertools.pairwise(bounds)]
    return centres(bounds), np.asarray(means)


def binned(curve: Sequence[float], length: int) -> tuple[np.ndarray, np.ndarray]:
    """(centres, means) of a window's curve: as recorded (one loss a position), or as kept (its bins' means already)."""
    if len(curve) == length:
        return smooth(curve)
    bounds = edges(length)
    if len(curve) != len(bounds) - 1:
        raise ValueError(
            f"a loss-by-position curve of {len(curve)} values fits neither {length} positions nor their bins"
        )
    return centres(bounds), np.asarray(curve, dtype=float)
