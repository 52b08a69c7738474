"""One estimator for every interval and test of a comparison: seeds and documents crossed, by variance components.

A figure of a comparison (a perplexity, a ratio of two lengths, the difference of two schemes) varies with the seed a
run was trained on and with the documents it is scored on, and every run is scored on the same documents, so seeds and
documents are crossed (McCullagh 2000): a document that is hard is hard for every seed. With y_sd the value of seed s
on document d (a summed loss, or a window's accuracy), the two-way random-effects model

    y_sd = μ + a_s + b_d + (ab)_sd,   Var(mean) = σ_a² / S + σ_b² / D + σ_ab² / (S D)

has, from the balanced analysis of variance, the unbiased estimate (MS_seed + MS_document − MS_interaction) / (S D),
with Satterthwaite's degrees of freedom (capped, below) for the interval and the t-tests. A bootstrap that resamples
seeds and documents independently counts the interaction three times instead of once, so its intervals are too
wide; a t-interval over seed means leaves the documents out, so its intervals are too narrow where documents
matter. Both are replaced by this.

Four refinements, each measured by simulation (``tests/test_crossed.py``):

- a main effect whose mean square does not exceed the interaction's at the 25% level is pooled into it, the
  "sometimes pool" rule of Bozivich, Bancroft and Hartley (1956): the difference of two noisy mean squares otherwise
  dominates the estimate where the interaction does, and truncating a negative component at zero biases it upward;
- the degrees of freedom are capped by each kept main effect's own (``_components``), since an estimated df is
  largest where that effect's mean square came out small, which made the tails too light for a Holm family;
- a main effect of fewer than four degrees of freedom (two to four seeds: a recall column's seeds that learned) is
  never pooled, and its df cap takes its share as at least one half: one to three degrees of freedom cannot tell a
  small effect from a mean square that came out small, and pooling or trusting the df it implies covered 86–89% at
  two seeds; so the interval errs wide there (up to 3× where documents or the interaction dominate, at two seeds);
- per-document sums with unequal tokens are linearised as a ratio estimator is (the value per token of document d,
  weighted by its share of the tokens), so the estimate is the pooled loss per token.

With one seed only the documents vary (``documents only``); without per-document values only the seeds do
(``seeds only``), and a table says so where it shows one. Three words come from the tests (``verdict``):
**separated** (the difference's Holm-adjusted p below α), **equivalent** (two one-sided tests against a margin set
before the runs, Holm-adjusted), **inconclusive** (neither); both can hold (a difference smaller than the margin).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

CONFIDENCE = 0.95
ALPHA = 0.05
POWER = 0.8  # the power a minimal detectable difference is stated at
POOL_LEVEL = 0.25  # a main effect not significant against the interaction at this level is pooled into it
SHARE_FLOOR = 0.05  # the smallest share of the variance a kept main effect is taken to carry, in its df cap
FEW = 4  # a main effect of fewer degrees of freedom (under five seeds) is never pooled (module docstring)
FEW_SHARE_FLOOR = 0.5  # ... and the share such an effect is taken to carry, in its df cap, is at least this
CROSSED, DOCUMENTS_ONLY, SEEDS_ONLY = "crossed", "documents only", "seeds only"
SEPARATED, EQUIVALENT, INCONCLUSIVE = "separated", "equivalent", "inconclusive"


@dataclass(frozen=True)
class Estimate:
    """A figure on its analysis scale (log perplexity, log ratio, accuracy), its standard error and their sources."""

    estimate: float
    se: float
    df: float
    seeds: int
    units: int  # documents or windows; 1 when only seeds vary
    source: str  # CROSSED, DOCUMENTS_ONLY or SEEDS_ONLY
    pooled: tuple[str, ...] = ()  # main effects pooled into the interaction

    def interval(self, confidence: float = CONFIDENCE) -> tuple[float, float]:
        """The two-sided Student-t interval."""
        half = float(stats.t.ppf((1 + confidence) / 2, self.df)) * self.se if self.se > 0 else 0.0
        return self.estimate - half, self.estimate + half

    @property
    def p_value(self) -> float:
        """Two-sided p-value of "no difference" (the estimate is 0)."""
        if self.se == 0:
            return 1.0 if self.estimate == 0 else 0.0
        return float(2 * stats.t.sf(abs(self.estimate) / self.se, self.df))

    def equivalence_p(self, margin: float) -> float:
        """The two one-sided tests' p-value that the truth lies inside (−margin, margin): the larger of the two."""
        if self.se == 0:
            return 0.0 if abs(self.estimate) < margin else 1.0
        below = stats.t.sf((self.estimate + margin) / self.se, self.df)  # H0: truth ≤ −margin
        above = stats.t.sf((margin - self.estimate) / self.se, self.df)  # H0: truth ≥ margin
        return float(max(below, above))

    def detectable(self, alpha: float = ALPHA, power: float = POWER) -> float:
        """The smallest true difference this test separates with ``power`` at level ``alpha``: (t₁₋α/₂ + t_power)·se."""
        return float((stats.t.ppf(1 - alpha / 2, self.df) + stats.t.ppf(power, self.df)) * self.se)


def crossed(values: np.ndarray | Sequence[Sequence[float]], tokens: Sequence[float] | None = None) -> Estimate:
    """The mean of ``values`` (seeds, units) with the crossed standard error (module docstring).

    ``tokens`` (units,): the targets behind each unit's value when ``values`` are per-document sums of a loss; the
    estimate is then the pooled value per token. Without them, the plain mean over seeds and units.
    """
    y = np.asarray(values, dtype=float)
    if y.ndim != 2 or y.size == 0:
        raise ValueError(f"need values of shape (seeds, units), got {y.shape}")
    seeds, units = y.shape
    if tokens is not None:
        weights = np.asarray(tokens, dtype=float)
        if weights.shape != (units,) or not (weights > 0).all():
            raise ValueError(f"need one positive token count per unit ({units}), got {weights.shape}")
        total = weights.sum()
        estimate = float(y.sum() / (seeds * total))
        y = units * (y - estimate * weights) / total + estimate  # linearised: its mean is the estimate
    if units == 1:
        return seeds_only(y[:, 0])
    if seeds == 1:
        spread = float(np.var(y[0], ddof=1))
        return Estimate(float(y.mean()), math.sqrt(spread / units), units - 1, 1, units, DOCUMENTS_ONLY)
    return _components(y)


def _components(y: np.ndarray) -> Estimate:
    """Mean squares of seeds, units and their interaction, pooled and combined (module docstring)."""
    seeds, units = y.shape
    grand, by_seed, by_unit = y.mean(), y.mean(axis=1), y.mean(axis=0)
    free = {"seed": seeds - 1, "document": units - 1, "interaction": (seeds - 1) * (units - 1)}
    sums = {
        "seed": units * float(((by_seed - grand) ** 2).sum()),
        "document": seeds * float(((by_unit - grand) ** 2).sum()),
        "interaction": float(((y - by_seed[:, None] - by_unit[None, :] + grand) ** 2).sum()),
    }
    squares = {name: sums[name] / free[name] for name in sums}
    residual_sum, residual_free, pooled = sums["interaction"], free["interaction"], []
    for name in ("seed", "document"):
        if squares["interaction"] == 0:  # no interaction at all: an effect is kept exactly when it varies
            pool = squares[name] == 0
        elif free[name] < FEW:  # too few degrees of freedom to tell a small effect from a noisy one
            pool = False
        else:
            pool = stats.f.sf(squares[name] / squares["interaction"], free[name], free["interaction"]) >= POOL_LEVEL
        if pool:
            residual_sum, residual_free = residual_sum + sums[name], residual_free + free[name]
            pooled.append(name)
    residual = residual_sum / residual_free
    kept = [name for name in ("seed", "document") if name not in pooled]
    # (S D) · Var(mean) = Σ_kept (MS_kept − MS_residual) + MS_residual, each term with its degrees of freedom.
    terms = [(1.0, squares[name], free[name]) for name in kept] + [(1.0 - len(kept), residual, residual_free)]
    total = max(sum(c * m for c, m, _ in terms), residual)  # never below the interaction alone
    weight = sum((c * m) ** 2 / f for c, m, f in terms if c != 0)
    df = total**2 / weight if weight > 0 else float(residual_free)
    # Satterthwaite's df is itself estimated, and it is largest exactly where a main effect's mean square came out
    # small, so the t's tails were too light there: with five seeds, twice the nominal rate at p = 0.007 and a Holm
    # family of seven at 7% (measured). A kept main effect with f degrees of freedom carrying a share w of the
    # variance caps them at f / √w (Satterthwaite's own value would be f / w² were w known): calibrated by the
    # simulations of tests/test_crossed.py, which it brings to 94–96.5% coverage and a family-wise error of 4%.
    floor = {name: FEW_SHARE_FLOOR if free[name] < FEW else SHARE_FLOOR for name in kept}
    shares = {name: max(floor[name], (squares[name] - residual) / total) for name in kept}
    df = min([df, *(free[name] / math.sqrt(shares[name]) for name in kept)])
    return Estimate(float(grand), math.sqrt(total / y.size), float(df), seeds, units, CROSSED, tuple(pooled))


def seeds_only(values: Sequence[float]) -> Estimate:
    """The plain Student-t standard error over seed values: what is left when no run recorded its units."""
    y = np.asarray(values, dtype=float)
    if y.size < 2:
        return Estimate(float(y.mean()) if y.size else math.nan, math.nan, math.nan, int(y.size), 1, SEEDS_ONLY)
    return Estimate(float(y.mean()), float(y.std(ddof=1) / math.sqrt(y.size)), y.size - 1, int(y.size), 1, SEEDS_ONLY)


def verdict(separated_p: float, equivalence_p: float, alpha: float = ALPHA) -> tuple[str, ...]:
    """The words a comparison earns from its two Holm-adjusted p-values: one or both, or ``inconclusive``."""
    words = tuple(word for word, p in ((SEPARATED, separated_p), (EQUIVALENT, equivalence_p)) if p < alpha)
    return words or (INCONCLUSIVE,)
