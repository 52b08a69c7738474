"""Bootstraps that carry every source of variation a comparison of two schemes has: seeds, and documents or windows.

A difference between two schemes varies with the seed they were trained on and with the data they are scored on.
Averaging seeds first and resampling the data (``stats.document_bootstrap``) carries no seed variance; a t-test
over seed means carries no data variance. Both bootstraps here resample both, and keep the comparison paired: the
two schemes of a seed share the draw of documents or windows.

- ``crossed_log_ratio`` (perplexity): resample seeds, and the scored documents, each with replacement and
  independently, one draw of documents shared by every seed. Every run of a comparison is scored on the same
  documents, so documents and seeds are crossed, not nested (McCullagh 2000): a document on which one scheme does
  better does so for every seed, and drawing documents anew within each seed would average that effect down by the
  number of seeds (measured: standard errors up to 1.7× too small). The statistic is the log perplexity ratio, the
  difference of losses per token, over the drawn seeds and documents.
- ``crossed_difference`` (recall): the same over seeds and the evaluation windows; the statistic is the difference
  of accuracies over the drawn seed × window grid. A window is the unit: its answers share one context, so they are
  not independent, and resampling answers would understate the spread.

Each returns the estimate, an interval and a two-sided p-value of "no difference", which a report adjusts with Holm's
method over its family of comparisons. With the handful of seeds a sweep can afford, a percentile interval
undercovers (resampling 5 seeds understates their variance by 4/5, and the normal shape of a percentile interval
ignores that the seed variance is itself estimated from 5 values: 85% coverage measured for a 95% interval when seeds
dominate). So the bootstrap gives the standard error only, with the usual √(S/(S−1)) correction, and interval and
p-value use Student's t with S − 1 degrees of freedom (the units' count − 1 for a single seed): exact when seeds
dominate, conservative when documents or windows do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

from posenc.evaluate.stats import CONFIDENCE, RESAMPLES


@dataclass(frozen=True)
class BootstrapResult:
    """An estimate with its 95% interval and the two-sided p-value of "no difference" (module docstring)."""

    estimate: float
    low: float
    high: float
    p_value: float
    seeds: int


def _summary(estimate: float, resampled: np.ndarray, confidence: float, seeds: int, units: int) -> BootstrapResult:
    """Estimate ± t · the bootstrap standard error (module docstring), and the matching two-sided p-value."""
    df = seeds - 1 if seeds > 1 else max(1, units - 1)
    error = float(np.std(resampled, ddof=1)) * math.sqrt(seeds / (seeds - 1) if seeds > 1 else 1.0)
    quantile = float(stats.t.ppf((1 + confidence) / 2, df))
    if error == 0.0:
        p_value = 1.0 if estimate == 0.0 else 0.0
    else:
        p_value = float(2 * stats.t.sf(abs(estimate) / error, df))
    return BootstrapResult(float(estimate), estimate - quantile * error, estimate + quantile * error, p_value, seeds)


def crossed_log_ratio(
    a: np.ndarray,
    b: np.ndarray,
    tokens: np.ndarray,
    confidence: float = CONFIDENCE,
    seed: int = 0,
    resamples: int = RESAMPLES,
) -> BootstrapResult:
    """log(ppl_a / ppl_b) with seeds and documents resampled independently, one document draw for all (docstring).

    ``a``, ``b`` (seeds, documents): each seed's summed loss over each scored document, row i of both from seed i,
    column j the same document for every seed and both schemes; ``tokens`` (documents,): the targets scored in each.
    """
    a, b, tokens = np.asarray(a, dtype=float), np.asarray(b, dtype=float), np.asarray(tokens, dtype=float)
    if a.shape != b.shape or a.ndim != 2 or a.shape[1] != tokens.size:
        raise ValueError(
            f"need (seeds, documents) losses of one shape and tokens per document, got {a.shape}, {b.shape}"
        )
    seeds, documents = a.shape
    difference = a - b  # (S, D): the paired difference, document by document
    estimate = float(np.mean(difference.sum(axis=1)) / tokens.sum())
    rng = np.random.default_rng(seed)
    drawn = rng.integers(0, seeds, size=(resamples, seeds))  # which seeds each resample holds
    counts = rng.multinomial(documents, np.full(documents, 1 / documents), size=resamples)  # (R, D): one for all seeds
    by_seed = (difference @ counts.T) / (counts @ tokens)  # (S, R): each seed's log ratio over resample r's documents
    resampled = np.take_along_axis(by_seed.T, drawn, axis=1).mean(axis=1)
    return _summary(estimate, resampled, confidence, seeds, documents)


def crossed_difference(
    a: np.ndarray, b: np.ndarray, confidence: float = CONFIDENCE, seed: int = 0, resamples: int = RESAMPLES
) -> BootstrapResult:
    """accuracy_a − accuracy_b with seeds and windows resampled independently (module docstring).

    ``a``, ``b`` (seeds, windows): each seed's accuracy on each evaluation window (its answers right / its answers),
    row i of both from seed i, column j the same window for every seed and both schemes.
    """
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"need (seeds, windows) accuracies of one shape, got {a.shape} and {b.shape}")
    seeds, windows = a.shape
    difference = a - b
    rng = np.random.default_rng(seed)
    drawn = rng.integers(0, seeds, size=(resamples, seeds))
    counts = rng.multinomial(windows, np.full(windows, 1 / windows), size=resamples)  # (R, W), shared by the seeds
    by_seed = (difference @ counts.T) / windows  # (S, R): each seed's mean over resample r's windows
    resampled = np.take_along_axis(by_seed.T, drawn, axis=1).mean(axis=1)
    return _summary(float(difference.mean()), resampled, confidence, seeds, windows)
