"""Every fast path keeps its bias arithmetic in fp32 far past the distances training windows reach.

bf16 holds integers exactly only up to 256: a distance cast to bf16 anywhere in a fast path (a score_mod, a distance
table, a gradient form, the backend's own index shift) is exact at the short lengths most tests use and wrong from
d = 257 on (ALiBi: -64.0 instead of -64.25 at slope 1/4). So each form is checked against the dense fp32 reference
at distances up to 4095, for every scheme of the registry and two stacks built by declaration, with tolerances
well below what such a cast costs; and the flex and flex_learnable backends run whole windows past 2,048.
"""

from __future__ import annotations

import pytest
import torch
from conftest import BIAS_SCHEMES, HEAD_DIM, HEADS, SCHEMES, layer_features, make

from posenc.attention import get_backend
from posenc.attention.flex_learnable import supports
from posenc.encodings.forms import DerivativeForm, TableForm

Q_POS = torch.tensor([0, 255, 256, 257, 511, 2047, 2048, 2049, 3001, 4095])  # around every power of two that matters
K_POS = torch.arange(4096)
CAUSAL = K_POS[None, :] <= Q_POS[:, None]
ATOL, RTOL = 1e-4, 1e-5  # a bf16 distance past 256 is off by ≥ 1 distance unit: ≥ 1e-3 for every bias here


def _stacks() -> list[str]:
    """Every fixed position bias together, and every bias with gradient forms together (by declaration)."""
    fixed = [n for n in BIAS_SCHEMES if "+" not in n and not make(n).learnable_bias and not make(n).adds_content_bias]
    forms = [n for n in BIAS_SCHEMES if "+" not in n and make(n).learnable_bias and supports(make(n))]
    return ["+".join(group) for group in (fixed, forms) if len(group) > 1]


POSITION_BIASES = [n for n in BIAS_SCHEMES if not make(n).adds_content_bias] + _stacks()


def _evaluate(mod, shape: tuple[int, ...]) -> torch.Tensor:
    """A score_mod over every (head, query, key) of Q_POS × K_POS at once, from a zero score."""
    heads = torch.arange(HEADS)[:, None, None]
    return mod(torch.zeros(shape), torch.tensor(0), heads, Q_POS[None, :, None], K_POS[None, None, :])


def test_cases_come_from_the_registry() -> None:
    assert set(BIAS_SCHEMES) <= set(POSITION_BIASES) | {n for n in SCHEMES if make(n).adds_content_bias}
    assert any("+" in name for name in POSITION_BIASES)


@pytest.mark.parametrize("name", POSITION_BIASES)
@pytest.mark.parametrize("detached", [False, True])
@pytest.mark.parametrize("num_distances", [None, 4096])
def test_score_mod_equals_the_dense_bias_at_long_distances(name: str, detached: bool, num_distances: int) -> None:
    enc = make(name)
    with torch.no_grad():
        expected = enc.bias(Q_POS, K_POS)  # (H, Lq, Lk)
        got = _evaluate(enc.score_mod(detached=detached, num_distances=num_distances), expected.shape)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got[:, CAUSAL], expected[:, CAUSAL], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", [n for n in POSITION_BIASES if make(n).distance_only])
def test_distance_table_equals_the_dense_bias_at_long_distances(name: str) -> None:
    enc = make(name)
    with torch.no_grad():
        table = enc.distance_bias(4096)
        dense = enc.bias(Q_POS, K_POS)
    assert table.dtype == torch.float32
    for row, query in enumerate(Q_POS.tolist()):
        # Row i sees keys 0 .. i at distances i .. 0.
        torch.testing.assert_close(dense[:, row, : query + 1], table[:, : query + 1].flip(-1), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("name", [n for n in SCHEMES if make(n).bias_gradient_forms()])
def test_gradient_forms_hold_at_long_distances(name: str) -> None:
    enc = make(name)
    q_idx, k_idx = CAUSAL.nonzero(as_tuple=True)
    weights = torch.rand(q_idx.shape)  # random weights per (i, j): an error on some distances cannot cancel out
    bias = enc.bias(Q_POS, K_POS)
    for form in enc.bias_gradient_forms():
        if isinstance(form, DerivativeForm):
            (derivative,) = torch.autograd.grad(
                (bias[:, q_idx, k_idx] * weights).sum(), form.parameter, retain_graph=True
            )
            log_f = form.log_factor(torch.zeros(HEADS, q_idx.numel()), torch.tensor(0), torch.arange(HEADS)[:, None],
                                    Q_POS[q_idx][None], K_POS[k_idx][None])  # fmt: skip
            assert log_f.dtype == torch.float32 and not log_f.isnan().any()
            declared = (weights * form.scale[:, None] * log_f.exp()).sum(-1)
            torch.testing.assert_close(declared, derivative, atol=1e-3, rtol=RTOL)
        else:
            assert isinstance(form, TableForm)
            distance = (Q_POS[q_idx] - K_POS[k_idx]).clamp(max=form.horizon)
            torch.testing.assert_close(form.table.detach()[:, form.index[distance]], bias.detach()[:, q_idx, k_idx])


def _declares_key_bias(name: str) -> bool:
    enc = make(name)
    return enc.key_bias(torch.zeros(1, HEADS, 1, HEAD_DIM), K_POS[:1], layer_features(enc, 1, 1)) is not None


@pytest.mark.parametrize("name", [n for n in SCHEMES if _declares_key_bias(n)])
def test_key_terms_fold_the_content_bias_at_long_positions(name: str) -> None:
    enc = make(name)
    q = torch.randn(1, HEADS, len(Q_POS), HEAD_DIM)
    k = torch.randn(1, HEADS, len(K_POS), HEAD_DIM)
    with torch.no_grad():
        features = layer_features(enc, 1, len(K_POS))
        dense = enc.content_bias(q, k, Q_POS, K_POS, features=features)
        rest = dense - enc.key_bias(k, K_POS, features)[:, :, None, :]  # r_i + t_j - t_j: constant along each row
    for row, query in enumerate(Q_POS.tolist()):
        spread = rest[..., row, : query + 1]
        torch.testing.assert_close(spread, spread[..., :1].expand_as(spread), atol=1e-3, rtol=RTOL)


# ---- whole windows past 2,048 through the fast backends ------------------------------------------------------

LONG, OFFSET = 2304, 1000  # not a multiple of 128, starting mid-stream: the kernel's indices are shifted


def _attend(backend: str, name: str, grad: bool) -> list[torch.Tensor]:
    torch.manual_seed(11)
    enc = make(name)
    pos = torch.arange(OFFSET, OFFSET + LONG)
    q, k, v = (torch.randn(1, HEADS, LONG, HEAD_DIM) for _ in range(3))
    if not grad:
        with torch.no_grad():
            return [get_backend(backend)(q, k, v, enc, pos, pos)]
    out = get_backend(backend)(q, k, v, enc, pos, pos)
    (out * torch.randn(out.shape)).sum().backward()
    return [out.detach(), *(p.grad for p in enc.parameters() if p.requires_grad)]


@pytest.mark.parametrize("name", POSITION_BIASES)
def test_flex_forward_equals_eager_past_2048(name: str) -> None:
    (got,), (expected,) = _attend("flex", name, grad=False), _attend("eager", name, grad=False)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", [n for n in POSITION_BIASES if make(n).learnable_bias and supports(make(n))])
def test_flex_learnable_values_and_bias_gradients_equal_eager_past_2048(name: str) -> None:
    got, expected = _attend("flex_learnable", name, grad=True), _attend("eager", name, grad=True)
    assert len(got) == len(expected) > 1
    for value, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(value, reference, atol=1e-4, rtol=1e-3)


def test_stick_breaking_in_fp32_equals_fp64_past_2048() -> None:
    # Stick-breaking multiplies a stick along whole rows: fp32 must hold the products over 2,304 keys.
    enc = make("stick_breaking")
    pos = torch.arange(OFFSET, OFFSET + LONG)
    q, k, v = (torch.randn(1, HEADS, LONG, HEAD_DIM, dtype=torch.float64) for _ in range(3))
    with torch.no_grad():
        expected = enc.attend(q, k, v, pos, pos)
        got = enc.attend(q.float(), k.float(), v.float(), pos, pos)
    assert expected.dtype == torch.float64 and got.dtype == torch.float32
    torch.testing.assert_close(got, expected.float(), atol=1e-5, rtol=1e-4)
