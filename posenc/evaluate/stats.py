"""Intervals over seeds: what a difference between two schemes has to clear before a table may claim it.

A table cell is the mean of n seeds with a 95% Student-t interval, mean ± t_{0.975, n−1} · s / √n (s the sample
standard deviation): with 3 seeds t = 4.303, so the interval is far wider than ± s. Cells whose interval overlaps
the best cell's are marked as not separated from it. Two columns run on the same seeds and data are compared
paired: the t interval and the two-sided p-value of the per-seed differences (the paired t-test), which removes
the seed-to-seed variation both columns share.

The Student-t distribution is computed exactly for the integer degrees of freedom seeds give (Abramowitz & Stegun
26.7.3–26.7.4, a finite sum), and its quantile by bisection on that, so no statistics package is needed.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

CONFIDENCE = 0.95


def t_central(t: float, df: int) -> float:
    """P(|T| ≤ t) for Student's t with ``df`` (a positive integer) degrees of freedom, t ≥ 0 (A&S 26.7.3–4)."""
    if df < 1 or int(df) != df:
        raise ValueError(f"degrees of freedom must be a positive integer, got {df}")
    if math.isinf(t):
        return 1.0
    theta = math.atan(abs(t) / math.sqrt(df))
    cos2 = math.cos(theta) ** 2
    if df % 2:  # odd: (2/π)(θ + sin θ cos θ (1 + 2/3 cos²θ + (2·4)/(3·5) cos⁴θ + …)), the sum ending at cos^(df−3)
        term, total = 1.0, 0.0
        for k in range(1, (df - 1) // 2 + 1):
            total += term
            term *= cos2 * (2 * k) / (2 * k + 1)
        series = math.sin(theta) * math.cos(theta) * total if df > 1 else 0.0
        return 2 / math.pi * (theta + series)
    term, total = 1.0, 0.0  # even: sin θ (1 + 1/2 cos²θ + (1·3)/(2·4) cos⁴θ + …), ending at cos^(df−2)
    for k in range(1, df // 2 + 1):
        total += term
        term *= cos2 * (2 * k - 1) / (2 * k)
    return math.sin(theta) * total


def t_quantile(confidence: float, df: int) -> float:
    """The t with P(|T| ≤ t) = ``confidence`` (two-sided; 0.95 gives t_{0.975, df}), by bisection."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    low, high = 0.0, 1.0
    while t_central(high, df) < confidence:
        high *= 2
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if t_central(middle, df) < confidence else (low, middle)
    return (low + high) / 2


@dataclass(frozen=True)
class Interval:
    """Mean of n values and the half-width of its Student-t interval (``None`` with a single value)."""

    mean: float
    half_width: float | None
    n: int

    @property
    def low(self) -> float:
        return self.mean - (self.half_width or 0.0)

    @property
    def high(self) -> float:
        return self.mean + (self.half_width or 0.0)

    def overlaps(self, other: Interval) -> bool:
        return self.low <= other.high and other.low <= self.high


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """Mean and Student-t half-width t_{(1+c)/2, n−1} · s / √n over ``values`` (one per seed)."""
    n = len(values)
    if n == 0:
        raise ValueError("an interval needs at least one value")
    mean = statistics.fmean(values)
    if n == 1:
        return Interval(mean, None, 1)
    return Interval(mean, t_quantile(confidence, n - 1) * statistics.stdev(values) / math.sqrt(n), n)


def overlaps_best(intervals: Mapping[str, Interval], higher_is_better: bool) -> dict[str, bool | None]:
    """For each cell, whether its interval overlaps the best mean's (so the data cannot tell them apart).

    The best cell is marked ``True``; a cell is ``None`` when it or the best has a single seed (no interval).
    """
    if not intervals:
        return {}
    best_name = (max if higher_is_better else min)(intervals, key=lambda name: intervals[name].mean)
    best = intervals[best_name]
    return {
        name: True
        if name == best_name
        else None
        if interval.half_width is None or best.half_width is None
        else interval.overlaps(best)
        for name, interval in intervals.items()
    }


@dataclass(frozen=True)
class PairedComparison:
    """a − b over the same seeds: mean difference, its t interval, the t statistic and two-sided p-value."""

    n: int
    mean_difference: float
    half_width: float
    t: float
    p_value: float


def paired_comparison(a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE) -> PairedComparison:
    """Paired t-test of ``a`` against ``b``, element i of each from the same seed and data."""
    if len(a) != len(b):
        raise ValueError(f"a paired comparison needs the same seeds on both sides, got {len(a)} and {len(b)} values")
    if len(a) < 2:
        raise ValueError(f"a paired comparison needs at least 2 seeds, got {len(a)}")
    differences = [x - y for x, y in zip(a, b, strict=True)]
    n, mean = len(differences), statistics.fmean(differences)
    error = statistics.stdev(differences) / math.sqrt(n)
    if error == 0.0:  # every seed differs by the same amount: certain unless that amount is 0
        t = 0.0 if mean == 0.0 else math.copysign(math.inf, mean)
    else:
        t = mean / error
    p_value = 1.0 - t_central(abs(t), n - 1)
    return PairedComparison(n, mean, t_quantile(confidence, n - 1) * error, t, p_value)
