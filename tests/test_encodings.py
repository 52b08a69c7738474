"""Each scheme's own formula on hand-computed values, and the contract every scheme honours."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import BIAS_SCHEMES, DISTANCE_BIAS_SCHEMES, HEAD_DIM, HEADS, RELATIVE_SCHEMES, SCHEMES, make

from posenc.encodings import available, build
from posenc.encodings.alibi import alibi_slopes
from posenc.encodings.t5 import t5_bucket

EXPECTED = {"alibi", "rope", "kerple_log", "kerple_power", "xpos", "t5", "nope", "sinusoidal", "learned"}


def test_registry_lists_every_scheme() -> None:
    assert EXPECTED <= set(available())


def test_unknown_scheme_lists_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown positional scheme 'alibii'.*alibi.*rope"):
        build("alibii", num_heads=4, head_dim=8)


@pytest.mark.parametrize("name", SCHEMES)
def test_contract_shapes(name: str) -> None:
    enc = make(name)
    pos = torch.arange(10)
    q, k = torch.randn(2, HEADS, 10, HEAD_DIM), torch.randn(2, HEADS, 10, HEAD_DIM)
    q2, k2 = enc.rotate(q, k, pos, pos)
    widened = (*q.shape[:-1], HEAD_DIM * enc.qk_width)  # v keeps the head width; q and k may widen (PoPE)
    assert q2.shape == widened and k2.shape == widened
    x = torch.randn(2, 10, HEADS * HEAD_DIM)
    assert enc.embed(x, pos).shape == x.shape
    bias = enc.bias(pos, torch.arange(7))
    assert (bias is None) == (not enc.adds_bias)
    if bias is not None:
        assert bias.shape == (HEADS, 10, 7) and bias.dtype == torch.float32
    assert (enc.score_mod() is None) == (not enc.adds_bias)
    if not enc.rotates:
        assert torch.equal(q2, q) and torch.equal(k2, k)
    if not enc.absolute:
        assert torch.equal(enc.embed(x, pos), x)


def test_alibi_slopes_power_of_two() -> None:
    assert alibi_slopes(8) == pytest.approx([1 / 2**h for h in range(1, 9)])
    assert alibi_slopes(4) == pytest.approx([1 / 4, 1 / 16, 1 / 64, 1 / 256])


def test_alibi_slopes_twelve_heads_follow_the_interpolation_rule() -> None:
    # c = 8: the 8-head slopes 2^-1..2^-8, then every other slope of the 16-head rule 2^(-h/2): h = 1, 3, 5, 7.
    expected = [2.0**-h for h in range(1, 9)] + [2.0 ** (-h / 2) for h in (1, 3, 5, 7)]
    assert alibi_slopes(12) == pytest.approx(expected)
    assert alibi_slopes(6) == pytest.approx([2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])


def test_alibi_bias_values_and_sign() -> None:
    enc = make("alibi", heads=8)
    bias = enc.bias(torch.arange(4), torch.arange(4))
    assert bias[0, 3, 0] == pytest.approx(-3 * 0.5)  # head 1, distance 3, slope 1/2: penalised, not rewarded
    assert bias[7, 2, 1] == pytest.approx(-1 / 256)
    assert torch.all(bias[:, torch.arange(4), torch.arange(4)] == 0)  # distance 0 has no bias


def test_alibi_distances_stay_exact_far_out() -> None:
    enc = make("alibi", heads=8)
    bias = enc.bias(torch.tensor([70000]), torch.tensor([0, 69743]))
    assert bias.dtype == torch.float32
    assert bias[0, 0, 1].item() == -257 * 0.5  # would round to -256*0.5 or -258*0.5 in bf16


def test_t5_buckets() -> None:
    d = torch.tensor([0, 1, 15, 16, 20, 32, 64, 100, 127, 128, 1000, -5])
    buckets = t5_bucket(d).tolist()
    # exact below 16; then 16 + floor(log(d/16)/log(8) * 16), capped at 31; negative distances count as 0
    expected = [0, 1, 15, 16]
    for n in (20, 32, 64, 100, 127):
        expected.append(16 + int(math.log(n / 16) / math.log(8) * 16))
    expected += [31, 31, 0]
    assert buckets == expected
    assert buckets[5] == 21 and buckets[6] == 26  # d=32 -> 16 + 16/3 ; d=64 -> 16 + 32/3


def test_t5_bias_reads_the_table_by_bucket() -> None:
    enc = make("t5")
    with torch.no_grad():
        enc.table.copy_(torch.arange(HEADS * 32, dtype=torch.float32).view(HEADS, 32))
    bias = enc.bias(torch.arange(200), torch.arange(200))
    assert bias[2, 199, 0] == 2 * 32 + 31
    assert bias[1, 17, 10] == 32 + 7


def test_kerple_values() -> None:
    log = make("kerple_log")
    power = make("kerple_power")
    with torch.no_grad():
        log.r1.fill_(2.0)
        log.r2.fill_(0.5)
        power.r1.fill_(0.3)
        power.r2.fill_(1.5)
    pos = torch.arange(5)
    assert log.bias(pos, pos)[0, 4, 0].item() == pytest.approx(-2.0 * math.log(1 + 0.5 * 4))
    assert power.bias(pos, pos)[3, 4, 1].item() == pytest.approx(-0.3 * 3**1.5)
    assert power.bias(pos, pos)[0, 2, 2].item() == 0.0


def test_kerple_parameters_are_learnable_and_constrained() -> None:
    enc = make("kerple_power")
    assert enc.learnable_bias
    with torch.no_grad():
        enc.r1.fill_(-1.0)
        enc.r2.fill_(5.0)
    enc.constrain_()
    assert torch.all(enc.r1 == 0.01) and torch.all(enc.r2 == 2.0)
    log = make("kerple_log")
    assert torch.all((log.r1 > 0) & (log.r1 <= 2)) and torch.all((log.r2 > 0) & (log.r2 <= 1))


def test_kerple_power_gradient_is_finite_at_distance_zero() -> None:
    enc = make("kerple_power")
    enc.bias(torch.arange(6), torch.arange(6)).sum().backward()
    assert torch.isfinite(enc.r1.grad).all() and torch.isfinite(enc.r2.grad).all()


@pytest.mark.parametrize("name", ["rope", "xpos"])
def test_rotation_depends_on_relative_position_only(name: str) -> None:
    enc = make(name, head_dim=16)
    q, k = torch.randn(1, HEADS, 1, 16), torch.randn(1, HEADS, 1, 16)

    def score(m: int, n: int) -> torch.Tensor:
        qr, kr = enc.rotate(q, k, torch.tensor([m]), torch.tensor([n]))
        return (qr * kr).sum(-1)

    # xPos centres its scale on the key positions, which cancels in every product: only m - n matters.
    assert torch.allclose(score(7, 3), score(107, 103), atol=1e-4)
    assert torch.allclose(score(30, 30), score(0, 0), atol=1e-4)
    assert not torch.allclose(score(7, 3), score(7, 5), atol=1e-3)


def test_rope_rotation_hand_computed() -> None:
    enc = make("rope", heads=1, head_dim=4, base=100.0)
    x = torch.tensor([[[[1.0, 0.0, 0.0, 0.0]]]])  # pair (x0, x2) = (1, 0), frequency base^0 = 1
    q, _ = enc.rotate(x, x, torch.tensor([2]), torch.tensor([2]))
    assert q[0, 0, 0].tolist() == pytest.approx([math.cos(2), 0.0, math.sin(2), 0.0], abs=1e-6)


def test_rope_partial_rotation_leaves_the_rest() -> None:
    enc = make("rope", head_dim=16, rotary_fraction=0.25)
    assert enc.rotary_dims == 4
    x = torch.randn(1, HEADS, 5, 16)
    q, _ = enc.rotate(x, x, torch.arange(5), torch.arange(5))
    assert torch.equal(q[..., 4:], x[..., 4:])
    assert not torch.allclose(q[..., :4], x[..., :4])


def test_xpos_decays_with_distance() -> None:
    enc = make("xpos", heads=1, head_dim=16, scale_base=8)
    x = torch.ones(1, 1, 1, 16)
    norms = [
        enc.rotate(x, x, torch.tensor([d]), torch.tensor([0]))[0].norm()
        * enc.rotate(x, x, torch.tensor([d]), torch.tensor([0]))[1].norm()
        for d in (0, 8, 16)
    ]
    assert norms[0] > norms[1] > norms[2]


def test_sinusoidal_embedding_values() -> None:
    enc = make("sinusoidal", scale=1.0)
    x = torch.zeros(1, 3, 32)
    out = enc.embed(x, torch.arange(3))
    assert out[0, 2, 0].item() == pytest.approx(math.sin(2))
    assert out[0, 2, 1].item() == pytest.approx(math.cos(2))
    assert out[0, 1, 2].item() == pytest.approx(math.sin(1 / 10000 ** (2 / 32)))


def test_learned_refuses_positions_beyond_its_table() -> None:
    enc = make("learned", max_positions=16)
    enc.embed(torch.zeros(1, 16, 32), torch.arange(16))
    with pytest.raises(ValueError, match=r"at most 16 positions.*32"):
        enc.embed(torch.zeros(1, 32, 32), torch.arange(32))


@pytest.mark.parametrize("name", DISTANCE_BIAS_SCHEMES)
def test_bias_is_shift_invariant(name: str) -> None:
    enc = make(name)
    pos = torch.arange(40)
    assert torch.allclose(enc.bias(pos, pos), enc.bias(pos + 1000, pos + 1000))


@pytest.mark.parametrize("name", DISTANCE_BIAS_SCHEMES)
def test_distance_bias_matches_dense_bias(name: str) -> None:
    enc = make(name)
    pos = torch.arange(200)
    dense = enc.bias(pos, pos)
    table = enc.distance_bias(200)
    i, j = torch.tril_indices(200, 200)
    assert torch.allclose(dense[:, i, j], table[:, i - j])


@pytest.mark.parametrize("name", BIAS_SCHEMES)
def test_score_mod_matches_dense_bias(name: str) -> None:
    enc = make(name)
    mod = enc.score_mod()
    q_idx, k_idx = torch.tril_indices(50, 50)
    for h in range(HEADS):
        got = mod(torch.zeros(q_idx.shape), torch.tensor(0), torch.tensor(h), q_idx, k_idx)
        assert torch.allclose(got, enc.bias(torch.arange(50), torch.arange(50))[h, q_idx, k_idx], atol=1e-6)


@pytest.mark.parametrize("name", RELATIVE_SCHEMES)
def test_relative_schemes_declare_no_length_limit(name: str) -> None:
    assert make(name).max_positions is None


def test_fire_records_the_threshold_it_trained_to_with_its_multipliers_sign() -> None:
    # FIRE's threshold is |multiplier| × its initial value: a run that flipped the multiplier's sign has the same
    # threshold, and the record keeps both. A stack names each member's settings; schemes without any record none.
    fire = build("fire", num_heads=2, head_dim=8, init_threshold=16.0)
    with torch.no_grad():
        fire.threshold_multiplier.fill_(-3.5)
    assert fire.learned_settings() == {"threshold": 56.0, "threshold_multiplier": -3.5}
    stacked = build("fire+alibi", num_heads=2, head_dim=8)
    assert set(stacked.learned_settings()) == {"fire.threshold", "fire.threshold_multiplier"}
    assert build("alibi", num_heads=2, head_dim=8).learned_settings() == {}
