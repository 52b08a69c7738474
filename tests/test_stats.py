"""The statistics behind the tables, against values worked out by hand.

With 2 degrees of freedom Student's t has P(|T| ≤ t) = t / √(t² + 2), so t_{0.975, 2} solves t² = 0.9025 (t² + 2):
t = √(1.805 / 0.0975) = 4.302653, and a paired test's two-sided p is 1 − t / √(t² + 2).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from posenc.evaluate.stats import bootstrap_mean, holm, t_interval, wilson

T_2 = math.sqrt(1.805 / 0.0975)


def test_interval_over_three_seeds() -> None:
    interval = t_interval([1.0, 2.0, 3.0])  # mean 2, s = 1, half-width t_{0.975,2} / √3
    assert interval.mean == 2.0 and interval.n == 3
    assert interval.half_width == pytest.approx(T_2 / math.sqrt(3), rel=1e-9)
    # one degree of freedom is the Cauchy distribution: t_{0.975,1} = tan(0.475 π); s / √2 = 0.5
    assert t_interval([0.0, 1.0]).half_width == pytest.approx(math.tan(0.475 * math.pi) * 0.5)
    single = t_interval([5.0])
    assert single.half_width is None and single.low == single.high == 5.0
    with pytest.raises(ValueError, match="at least one value"):
        t_interval([])


def test_holm_steps_down_and_never_lets_a_later_p_fall_below_an_earlier() -> None:
    # sorted 0.01, 0.03, 0.04 with m = 3: 3 · 0.01 = 0.03; 2 · 0.03 = 0.06; 1 · 0.04 = 0.04, raised to 0.06
    assert holm({"a": 0.04, "b": 0.01, "c": 0.03}) == pytest.approx({"a": 0.06, "b": 0.03, "c": 0.06})
    assert holm({"a": 0.6, "b": 0.5}) == {"a": 1.0, "b": 1.0}  # capped at 1
    assert holm({"only": 0.02}) == {"only": 0.02} and holm({}) == {}


def test_wilson_interval_by_hand_and_inside_zero_one() -> None:
    # k of n, z = 1.959964: centre (k + z²/2) / (n + z²), half-width z √(k(n − k)/n + z²/4) / (n + z²)
    z = 1.959963984540054
    for k, n in [(0, 10), (5, 10), (10, 10), (37, 512)]:
        centre = (k + z**2 / 2) / (n + z**2)
        half = z * math.sqrt(k * (n - k) / n + z**2 / 4) / (n + z**2)
        low, high = wilson(k, n)
        assert (low, high) == pytest.approx((max(0.0, centre - half), min(1.0, centre + half)), abs=1e-12)
        assert 0.0 <= low <= k / n <= high <= 1.0
    with pytest.raises(ValueError, match="at least one trial"):
        wilson(0, 0)


def test_bootstrap_of_accuracies_stays_inside_them() -> None:
    low, high = bootstrap_mean([0.36, 0.38, 0.97, 1.0, 0.99])  # learned-or-not seeds: no bell curve
    assert 0.36 <= low < float(np.mean([0.36, 0.38, 0.97, 1.0, 0.99])) < high <= 1.0
    assert bootstrap_mean([0.5, 0.5]) == (0.5, 0.5) and bootstrap_mean([0.7]) == (0.7, 0.7)
    assert bootstrap_mean([0.1, 0.9]) == bootstrap_mean([0.1, 0.9])  # seeded: the same report every time
