"""The statistics of tables without documents to cross: seed intervals, Holm's correction, intervals for accuracies.

Perplexity cells and every comparison of perplexities or recall come from the crossed estimator (``crossed.py``);
what is left here is for figures that vary by seed alone, each table saying so. All distributions come from
``scipy.stats``; this module only says which one each table uses and why:

- a figure of a run's parameters or attention (drift, attention statistics) is the mean over seeds with its 95%
  Student-t interval (``t_interval``), labelled as over seeds;
- a family of tests is adjusted by Holm's step-down method (``holm``), which keeps the chance of any false
  "separated" in the family at 5%;
- an accuracy is a proportion and its interval must stay in [0, 1]: one run's accuracy gets the Wilson score
  interval of its counts (``wilson``); a mean over seeds gets a percentile bootstrap over the seeds
  (``bootstrap_mean``), since seeds of a task a run learns or does not learn are not a bell curve.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
ALPHA = 1 - CONFIDENCE
RESAMPLES = 2000


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


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """Mean and Student-t half-width t_{(1+c)/2, n−1} · s / √n over ``values`` (one per seed)."""
    n = len(values)
    if n == 0:
        raise ValueError("an interval needs at least one value")
    mean = statistics.fmean(values)
    if n == 1:
        return Interval(mean, None, 1)
    quantile = float(stats.t.ppf((1 + confidence) / 2, n - 1))
    return Interval(mean, quantile * statistics.stdev(values) / math.sqrt(n), n)


def holm(p_values: Mapping[str, float]) -> dict[str, float]:
    """Holm's step-down adjustment (Holm, 1979): adjusted p_(i) = max_{j ≤ i} min(1, (m − j + 1) · p_(j)).

    A family of m tests rejected where the adjusted p < α keeps the probability of any false rejection ≤ α.
    """
    ordered = sorted(p_values.items(), key=lambda item: item[1])
    m, running, adjusted = len(ordered), 0.0, {}
    for rank, (name, p) in enumerate(ordered):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[name] = running
    return adjusted


def wilson(successes: int, trials: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The Wilson score interval of a proportion (``scipy.stats.binomtest``): inside [0, 1] even at 0 or n of n."""
    if trials < 1:
        raise ValueError(f"an interval of a proportion needs at least one trial, got {trials}")
    interval = stats.binomtest(int(successes), int(trials)).proportion_ci(confidence, method="wilson")
    return float(interval.low), float(interval.high)


def bootstrap_mean(values: Sequence[float], confidence: float = CONFIDENCE, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean over ``values`` (one per seed); within their range, so in [0, 1].

    Seeded, so a report is the same every time it is built. A single value, or values all equal, is its own
    interval.
    """
    data = np.asarray(values, dtype=float)
    if data.size == 0:
        raise ValueError("an interval needs at least one value")
    if data.size == 1 or np.all(data == data[0]):
        return float(data[0]), float(data[0])
    result = stats.bootstrap(
        (data,),
        np.mean,
        confidence_level=confidence,
        n_resamples=RESAMPLES,
        method="percentile",
        rng=np.random.default_rng(seed),
    )
    return float(result.confidence_interval.low), float(result.confidence_interval.high)
