"""FoPE against its paper's formulas, written out here per head and channel pair.

The backends' fast paths are checked against every scheme's dense form elsewhere (over the registry); these tests
check the dense form itself: the floor, the Fourier series each pair is rotated by, and that at identity
coefficients it is RoPE on the kept frequencies.
"""

from __future__ import annotations

import math

import pytest
import torch

from posenc.encodings import build
from posenc.encodings.hope import high_frequency_pairs
from posenc.encodings.length import scale_to_length


def test_the_floor_keeps_the_waves_that_turn_within_the_training_length() -> None:
    fope = build("fope", num_heads=2, head_dim=32, train_length=64)
    theta = 10000.0 ** (-torch.arange(0, 32, 2, dtype=torch.float64) / 32)
    expected = theta[2 * math.pi / theta <= 64]
    assert fope.theta.numel() == 5 == high_frequency_pairs(10000.0, 32, 64)  # HoPE's cut is the same rule
    torch.testing.assert_close(fope.theta.double(), expected, rtol=1e-6, atol=0)
    assert fope.cos_coef.shape == (2, 5, 5)  # P = min(M, D/4) = 5 mixed pairs of 16
    with pytest.raises(ValueError, match="train_length=6 none does"):
        build("fope", num_heads=2, head_dim=32, train_length=6)


def test_the_floor_follows_the_training_length() -> None:
    spec, record = scale_to_length({"name": "fope", "train_length": None}, 128)
    assert spec["train_length"] == 128 and record["train_length"]["value"] == 128


def _pair_scores(q: torch.Tensor, k: torch.Tensor, theta: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """RoPE's q_m · k_n on the first len(theta) pairs, written as a function of m − n; 2 (q·k) on the others."""
    half = q.shape[-1] // 2
    q1, q2, k1, k2 = q[..., :half], q[..., half:], k[..., :half], k[..., half:]
    kept = theta.numel()
    same = torch.einsum("hmi,hni->hmni", q1, k1) + torch.einsum("hmi,hni->hmni", q2, k2)
    cross = torch.einsum("hmi,hni->hmni", q2, k1) - torch.einsum("hmi,hni->hmni", q1, k2)
    phase = (q_pos[:, None] - q_pos[None, :]).double()[..., None] * theta.double()
    rotating = (same[..., :kept] * phase.cos() - cross[..., :kept] * phase.sin()).sum(-1)
    return rotating + 2 * same[..., kept:].sum(-1)


def test_at_identity_coefficients_it_is_rope_on_the_kept_frequencies() -> None:
    torch.manual_seed(0)
    fope = build("fope", num_heads=3, head_dim=16, train_length=40, init_gain=0.0).double()
    q, k = torch.randn(1, 3, 9, 16, dtype=torch.float64), torch.randn(1, 3, 9, 16, dtype=torch.float64)
    pos = torch.arange(100, 109)  # far past L: a relative scheme does not care where
    rq, rk = fope.rotate(q, k, pos, pos)
    scores = torch.einsum("bhmd,bhnd->bhmn", rq.double(), rk.double())[0]
    torch.testing.assert_close(scores, _pair_scores(q[0], k[0], fope.theta, pos), rtol=1e-4, atol=1e-4)


def test_each_pair_is_rotated_by_its_normalised_fourier_series() -> None:
    torch.manual_seed(1)
    fope = build("fope", num_heads=2, head_dim=32, train_length=64, init_gain=1.0)
    x = torch.randn(1, 2, 6, 32)
    pos = torch.tensor([0, 3, 17, 64, 200, 1000])
    out = fope.rotate(x, x, pos, pos)[0][0]
    theta, cos_coef, sin_coef = fope.theta.double(), fope.cos_coef.double(), fope.sin_coef.double()
    expected = torch.empty(2, 6, 32, dtype=torch.float64)
    for h in range(2):
        for t, p in enumerate(pos.tolist()):
            for j in range(16):
                c = s = 1.0
                if j < cos_coef.shape[-1]:
                    c = sum(math.cos(p * theta[i]) * cos_coef[h, i, j] for i in range(5)) / cos_coef[h, :, j].sum()
                    s = sum(math.sin(p * theta[i]) * sin_coef[h, i, j] for i in range(5)) / sin_coef[h, :, j].sum()
                a, b = x[0, h, t, j].double(), x[0, h, t, j + 16].double()
                expected[h, t, j], expected[h, t, j + 16] = a * c - b * s, b * c + a * s
    # the phases are fp32, as RoPE's are: at position 1000 a phase of ~1000 radians carries ~6e-5 of rounding
    torch.testing.assert_close(out.double(), expected, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("learnable", [True, False])
def test_the_coefficients_train_unless_fixed(learnable: bool) -> None:
    fope = build("fope", num_heads=2, head_dim=16, train_length=32, learnable=learnable)
    assert fope.cos_coef.requires_grad is learnable and fope.sin_coef.requires_grad is learnable
    x = torch.randn(1, 2, 5, 16, requires_grad=True)
    q, k = fope.rotate(x, x, torch.arange(5), torch.arange(5))
    (q * k).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    if learnable:
        assert fope.cos_coef.grad.abs().sum() > 0 and fope.sin_coef.grad.abs().sum() > 0
