"""The statistics behind every table: seed intervals, paired tests, Holm's correction, and intervals for accuracies.

All distributions come from ``scipy.stats``; this module only says which one each table uses and why:

- a perplexity cell is the mean over seeds with its 95% Student-t interval (``t_interval``);
- whether a column differs from the best one at a length is a **paired** t-test over the seeds both share, on
  log-perplexity (``paired_comparison``): two schemes trained on the same seeds share the seed-to-seed variation,
  and differencing per seed removes it. Testing every column of a row against the best is m tests, so the p-values
  are adjusted by Holm's step-down method (``holm``), which keeps the chance of any false "separated" mark in the
  row at 5%;
- an accuracy is a proportion and its interval must stay in [0, 1]: one run's accuracy gets the Wilson score
  interval of its counts (``wilson``); a mean over seeds gets a percentile bootstrap over the seeds
  (``bootstrap_mean``), since seeds of a task a run learns or does not learn are not a bell curve;
- how much of a difference is the data rather than the seeds: a bootstrap over the documents scored
  (``document_bootstrap``), resampling the same documents for every column so that differences stay paired.
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


@dataclass(frozen=True)
class PairedComparison:
    """a − b over the same seeds: mean difference, its t interval's half-width, the t statistic and p-value."""

    n: int
    mean_difference: float
    half_width: float
    t: float
    p_value: float


def paired_comparison(a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE) -> PairedComparison:
    """Paired t-test of ``a`` against ``b`` (``scipy.stats.ttest_rel``), element i of each from the same seed.

    Differences that are all equal have no spread: the p-value is 1 when they are all 0 and 0 otherwise.
    """
    if len(a) != len(b):
        raise ValueError(f"a paired comparison needs the same seeds on both sides, got {len(a)} and {len(b)} values")
    if len(a) < 2:
        raise ValueError(f"a paired comparison needs at least 2 seeds, got {len(a)}")
    differences = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    n, mean = len(differences), float(differences.mean())
    error = float(differences.std(ddof=1)) / math.sqrt(n)
    if error == 0.0:
        t, p_value = (0.0, 1.0) if mean == 0.0 else (math.copysign(math.inf, mean), 0.0)
    else:
        result = stats.ttest_rel(a, b)
        t, p_value = float(result.statistic), float(result.pvalue)
    return PairedComparison(n, mean, float(stats.t.ppf((1 + confidence) / 2, n - 1)) * error, t, p_value)


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


def document_bootstrap(
    losses: np.ndarray, tokens: np.ndarray, confidence: float = CONFIDENCE, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Percentile interval of each column's loss (nats per token) when the scored documents are resampled.

    ``losses`` (columns, documents): each column's summed loss over each document's scored tokens (the mean over
    its seeds); ``tokens`` (documents,): the tokens scored in each. Every resample draws documents with replacement
    and applies the same draw to every column, so a difference between columns is bootstrapped paired. Returns the
    (low, high) bounds per column, and callers difference the resampled columns through ``resampled_losses``.
    """
    resampled = resampled_losses(losses, tokens, seed)
    tail = (1 - confidence) / 2 * 100
    return np.percentile(resampled, tail, axis=0), np.percentile(resampled, 100 - tail, axis=0)


def resampled_losses(losses: np.ndarray, tokens: np.ndarray, seed: int = 0) -> np.ndarray:
    """(resamples, columns) losses per token, each resample one draw of the documents with replacement."""
    losses, tokens = np.asarray(losses, dtype=float), np.asarray(tokens, dtype=float)
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(tokens.size, np.full(tokens.size, 1 / tokens.size), size=RESAMPLES)
    return (counts @ losses.T) / (counts @ tokens)[:, None]
