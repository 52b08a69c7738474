"""Seed intervals and the paired comparison against values worked out by hand.

With 2 degrees of freedom Student's t has P(|T| ≤ t) = t / √(t² + 2), so t_{0.975, 2} solves t² = 0.9025 (t² + 2):
t = √(1.805 / 0.0975) = 4.302653; with 1 it is the Cauchy distribution, t_{0.975, 1} = tan(0.475 π) = 12.706205.
"""

from __future__ import annotations

import math

import pytest

from posenc.evaluate.stats import Interval, overlaps_best, paired_comparison, t_central, t_interval, t_quantile


def test_t_distribution_by_hand() -> None:
    assert t_central(2.0, 2) == pytest.approx(2 / math.sqrt(6))
    assert t_central(1.0, 1) == pytest.approx(0.5)  # Cauchy: atan(1) · 2/π
    assert t_quantile(0.95, 2) == pytest.approx(math.sqrt(1.805 / 0.0975), rel=1e-9)
    assert t_quantile(0.95, 1) == pytest.approx(math.tan(0.475 * math.pi), rel=1e-9)
    # tabulated t_{0.975}: 3 → 3.182, 4 → 2.776, 9 → 2.262, 30 → 2.042; and the normal's 1.960 far out
    for df, tabulated in [(3, 3.182), (4, 2.776), (9, 2.262), (30, 2.042), (2000, 1.961)]:
        assert t_quantile(0.95, df) == pytest.approx(tabulated, abs=1e-3)


def test_interval_over_three_seeds() -> None:
    interval = t_interval([1.0, 2.0, 3.0])  # mean 2, s = 1, half-width 4.302653 / √3
    assert interval.mean == 2.0 and interval.n == 3
    assert interval.half_width == pytest.approx(4.302653 / math.sqrt(3), rel=1e-6)  # 2.484138
    assert (interval.low, interval.high) == pytest.approx((2 - 2.484138, 2 + 2.484138), rel=1e-6)
    single = t_interval([5.0])
    assert single.half_width is None and single.low == single.high == 5.0
    with pytest.raises(ValueError, match="at least one value"):
        t_interval([])


def test_overlap_with_the_best() -> None:
    cells = {
        "alibi": Interval(10.0, 1.0, 3),  # best (lowest perplexity): [9, 11]
        "rope": Interval(11.5, 0.6, 3),  # [10.9, 12.1]: overlaps
        "nope": Interval(13.0, 1.0, 3),  # [12, 14]: separated
        "t5": Interval(10.5, None, 1),  # one seed: cannot tell
    }
    assert overlaps_best(cells, higher_is_better=False) == {"alibi": True, "rope": True, "nope": False, "t5": None}
    marks = overlaps_best(cells, higher_is_better=True)  # accuracy: nope is the best now
    assert marks["nope"] is True and marks["alibi"] is False and marks["rope"] is True


def test_paired_comparison_by_hand() -> None:
    # differences 0.5, 1, 2: mean 7/6, variance 7/12, so t = (7/6) / √(7/36) = √7 on 2 degrees of freedom and the
    # two-sided p = 1 − √7 / √(7 + 2) = 0.118083; half-width 4.302653 · √(7/36)
    result = paired_comparison([1.0, 2.0, 4.0], [0.5, 1.0, 2.0])
    assert result.n == 3 and result.mean_difference == pytest.approx(7 / 6)
    assert result.t == pytest.approx(math.sqrt(7))
    assert result.p_value == pytest.approx(1 - math.sqrt(7) / 3)
    assert result.half_width == pytest.approx(4.302653 * math.sqrt(7 / 36), rel=1e-6)


def test_paired_comparison_edge_cases() -> None:
    same = paired_comparison([1.0, 2.0], [0.0, 1.0])  # every seed 1 apart: no spread, certain
    assert same.t == math.inf and same.p_value == 0.0 and same.half_width == 0.0
    assert paired_comparison([1.0, 2.0], [1.0, 2.0]).p_value == 1.0
    with pytest.raises(ValueError, match="same seeds"):
        paired_comparison([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="at least 2 seeds"):
        paired_comparison([1.0], [1.0])
