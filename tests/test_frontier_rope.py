"""p-RoPE, HoPE, Resonance RoPE, PoPE and SSMax: each formula on hand-computed values, shift invariance, every
backend against the dense reference (values and gradients), cached decoding, and the log-n evaluation switch."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import HEAD_DIM, HEADS, make

from posenc.attention import get_backend
from posenc.decoding import KVCache
from posenc.encodings.ssmax import LengthScaling
from posenc.evaluate.runner import attention_scaling
from posenc.model import Decoder

NEW = ["p_rope", "hope", "resonance_rope", "pope", "ssmax"]
LENGTH = 37


def _scores(enc, q, k, q_pos, k_pos) -> torch.Tensor:
    """Scaled scores (B, H, Lq, Lk) as every backend forms them: rotated q · k / √(width of q)."""
    rotated_q, rotated_k = enc.rotate(q, k, q_pos, k_pos)
    return rotated_q @ rotated_k.transpose(-1, -2) / math.sqrt(rotated_q.shape[-1])


# ---- the formulas on hand-computed values ----------------------------------------------------------------------


def test_p_rope_keeps_the_highest_fraction_of_frequencies() -> None:
    # head 8: pairs θ = 1, 0.1, 0.01, 0.001; p = 0.75 keeps ⌊0.75 · 4⌋ = 3, p = 0.5 keeps 2.
    torch.testing.assert_close(make("p_rope").inv_freq, torch.tensor([1.0, 0.1, 0.01, 0.0]))
    torch.testing.assert_close(make("p_rope", p=0.5).inv_freq, torch.tensor([1.0, 0.1, 0.0, 0.0]))
    torch.testing.assert_close(make("p_rope", p=1.0).inv_freq, make("rope").inv_freq)
    with pytest.raises(ValueError, match="must be in"):
        make("p_rope", p=1.5)


def test_still_pairs_carry_no_position() -> None:
    enc = make("p_rope", p=0.5)
    q = torch.randn(1, HEADS, 5, HEAD_DIM)
    rotated, _ = enc.rotate(q, q, torch.arange(100, 105), torch.arange(100, 105))
    still = [2, 3, 6, 7]  # pairs (i, i + 4) for i = 2, 3 in the rotate-half layout
    torch.testing.assert_close(rotated[..., still], q[..., still])
    assert not torch.allclose(rotated[..., [0, 4]], q[..., [0, 4]])


def test_hope_cuts_at_one_period_within_the_training_length() -> None:
    # wavelengths 2π/θ = 6.28, 62.8, 628, 6283: L = 64 keeps two, L = 62 one, L = 700 three.
    torch.testing.assert_close(make("hope", train_length=64).inv_freq, torch.tensor([1.0, 0.1, 0.0, 0.0]))
    assert make("hope", train_length=62).rotating_pairs == 1
    assert make("hope", train_length=700).rotating_pairs == 3
    # the reproduction's head (32 channels) at L = 64: pairs 0..4 rotate (wavelengths 6.3 .. 62.8), 11 are still
    assert make("hope", head_dim=32, train_length=64).rotating_pairs == 5


def test_hope_keeps_its_cut_under_a_context_scaling() -> None:
    enc = make("hope", train_length=64)
    enc.set_context_scaling("pi", 4.0, 64)
    torch.testing.assert_close(enc.inv_freq, torch.tensor([0.25, 0.025, 0.0, 0.0]))


def test_resonance_rounds_every_wavelength() -> None:
    # 2π/θ = 6.283, 62.83, 628.3, 6283.2 → 6, 63, 628, 6283
    expected = torch.tensor([2 * math.pi / w for w in (6, 63, 628, 6283)])
    torch.testing.assert_close(make("resonance_rope").inv_freq, expected)
    enc = make("resonance_rope")
    pos = torch.tensor([5, 5 + 6, 5 + 63])  # one period of pair 0 later, one of pair 1 later
    cos, sin = enc.angles(pos)
    torch.testing.assert_close(cos[1, 0], cos[0, 0], atol=1e-5, rtol=0)
    torch.testing.assert_close(sin[2, 1], sin[0, 1], atol=1e-5, rtol=0)


def test_resonance_rounds_after_the_context_scaling() -> None:
    # PI ×4 first (wavelengths 25.13, 251.3, ...), then rounding: 25, 251, 2513, 25133 — not 4 × (6, 63, ...).
    enc = make("resonance_rope")
    enc.set_context_scaling("pi", 4.0, 64)
    torch.testing.assert_close(enc.inv_freq, torch.tensor([2 * math.pi / w for w in (25, 251, 2513, 25133)]))
    enc.set_context_scaling("yarn", 8.0, 64)
    wavelengths = 2 * math.pi / enc.inv_freq.double()
    torch.testing.assert_close(wavelengths, wavelengths.round(), atol=1e-3, rtol=0)
    assert enc.attention_scale == pytest.approx(0.1 * math.log(8) + 1)  # YaRN's temperature stays


def test_pope_score_is_the_papers_polar_form() -> None:
    enc = make("pope", heads=1, head_dim=2)
    with torch.no_grad():
        enc.phase_bias.copy_(torch.tensor([[-0.5, -4.0]]))
    q, k = torch.tensor([[[[0.3, -1.2]]]]), torch.tensor([[[[1.5, 0.4]]]])
    score = _scores(enc, q, k, torch.tensor([7]), torch.tensor([3]))
    softplus = lambda x: math.log1p(math.exp(x))  # noqa: E731
    theta = [1.0, 10000**-0.5]  # base^(−c/D), c = 0, 1, D = 2
    expected = sum(
        softplus(qc) * softplus(kc) * math.cos(4 * t - d)
        for qc, kc, t, d in zip((0.3, -1.2), (1.5, 0.4), theta, (-0.5, -4.0), strict=True)
    ) / math.sqrt(2)  # the paper's 1/√D of the head, not 1/√(2D) of the widened q
    assert score.item() == pytest.approx(expected, rel=1e-5)


def test_pope_keeps_its_phase_in_range() -> None:
    enc = make("pope")
    with torch.no_grad():
        enc.phase_bias.copy_(torch.linspace(-9.0, 3.0, HEADS * HEAD_DIM).view(HEADS, HEAD_DIM))
    enc.constrain_()
    assert enc.phase_bias.min() >= -2 * math.pi and enc.phase_bias.max() <= 0


def test_pope_must_come_last_in_a_stack_with_a_rotation() -> None:
    pos = torch.arange(4)
    q = torch.randn(1, HEADS, 4, HEAD_DIM)
    assert make("rope+pope").rotate(q, q, pos, pos)[0].shape[-1] == 2 * HEAD_DIM
    with pytest.raises(ValueError, match="put that scheme last"):
        make("pope+rope").rotate(q, q, pos, pos)


def test_ssmax_scales_each_row_by_s_log_n() -> None:
    enc = make("ssmax", train_length=64)
    torch.testing.assert_close(enc.scale, torch.full((HEADS,), 1 / math.log(64)))
    with torch.no_grad():
        enc.scale.copy_(torch.tensor([0.5, 1.0, 2.0, 0.25]))
    q = torch.randn(1, HEADS, 4, HEAD_DIM)
    pos = torch.arange(4)
    rotated, k = enc.rotate(q, q, pos, pos)
    log_n = torch.tensor([1.0, 2.0, 3.0, 4.0]).log()  # query i sees i + 1 keys
    torch.testing.assert_close(rotated, q * (enc.scale[:, None] * log_n)[None, :, :, None])
    assert k is q


def test_ssmax_counts_the_keys_the_query_sees_not_its_position() -> None:
    enc = make("ssmax")
    q = torch.randn(1, HEADS, 1, HEAD_DIM)
    # a window starting at 100 (a shifted window) and a decoded token over a cache of 6 keys: n = 6 both times
    window, _ = enc.rotate(q, q, torch.tensor([105]), torch.arange(100, 106))
    cached, _ = enc.rotate(q, q, torch.tensor([5]), torch.arange(6))
    expected = q * (enc.scale[:, None, None] * math.log(6))
    torch.testing.assert_close(window, expected)
    torch.testing.assert_close(cached, expected)


def test_length_scaling_is_one_within_the_training_length() -> None:
    enc = LengthScaling(HEADS, HEAD_DIM, train_length=16)
    q = torch.randn(1, HEADS, 64, HEAD_DIM)
    pos = torch.arange(64)
    scaled, _ = enc.rotate(q, q, pos, pos)
    torch.testing.assert_close(scaled[:, :, :16], q[:, :, :16])  # n ≤ 16: untouched
    torch.testing.assert_close(scaled[:, :, 63], q[:, :, 63] * (math.log(64) / math.log(16)))  # log_16 64 = 1.5


# ---- the contract: shift invariance, backends, decoding --------------------------------------------------------


@pytest.mark.parametrize("name", NEW)
def test_scores_depend_on_relative_positions_only(name: str) -> None:
    enc = make(name)
    torch.manual_seed(2)
    q, k = torch.randn(2, HEADS, 10, HEAD_DIM), torch.randn(2, HEADS, 10, HEAD_DIM)
    pos = torch.arange(10)
    torch.testing.assert_close(
        _scores(enc, q, k, pos, pos), _scores(enc, q, k, pos + 1000, pos + 1000), atol=2e-4, rtol=1e-4
    )


def _attend(backend: str, name: str) -> list[torch.Tensor]:
    """Output and gradients of q, k, v and every scheme parameter through ``backend``."""
    torch.manual_seed(7)
    enc = make(name)
    with torch.no_grad():  # learnable parts away from their start, so that a dropped one shows
        for param in enc.parameters():
            param.add_(-0.7 * torch.rand_like(param))
    pos = torch.arange(LENGTH)
    q, k, v = (torch.randn(2, HEADS, LENGTH, HEAD_DIM, requires_grad=True) for _ in range(3))
    out = get_backend(backend)(*enc.rotate(q, k, pos, pos), v, enc, pos, pos)
    (out * torch.randn(out.shape)).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad, *(p.grad for p in enc.parameters())]


@pytest.mark.parametrize("name", ["pope", "ssmax", "rope+ssmax", "hope"])
def test_sdpa_matches_eager_values_and_every_gradient(name: str) -> None:
    expected, got = _attend("eager", name), _attend("sdpa", name)
    assert len(got) == len(expected) >= 4
    for value, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(value, reference, atol=2e-5, rtol=1e-4)


def _decoder(name: str, **kwargs) -> Decoder:
    model = Decoder(encoding=name, vocab_size=40, dim=32, depth=2, heads=4, **kwargs).eval()
    with torch.no_grad():
        for key, param in model.named_parameters():
            if ".encoding." in key:
                param.add_(-0.5 * torch.rand_like(param))
    return model


@pytest.mark.parametrize("name", ["pope", "rope+ssmax"])
def test_cached_decoding_matches_the_full_forward_at_4x(name: str) -> None:
    model = _decoder(name, attention="sdpa")
    tokens = torch.randint(0, 40, (2, 48))
    cache = KVCache(2)
    with torch.no_grad():
        full = model(tokens)
        steps = [model(tokens[:, :12], cache=cache)] + [model(tokens[:, i : i + 1], cache=cache) for i in range(12, 48)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=2e-5, rtol=1e-4)


# ---- the evaluation-time switch --------------------------------------------------------------------------------


def test_log_n_switch_scales_any_scheme_and_gives_the_layers_back() -> None:
    model = _decoder("alibi", attention="sdpa")
    tokens = torch.randint(0, 40, (1, 64))
    schemes = [block.attn.encoding for block in model.blocks]
    with torch.no_grad():
        plain = model(tokens)
        info = {"label": "alibi", "train_len": 16}
        with attention_scaling(model, {"attention_scale": "log_n"}, info) as scaled_info:
            scaled = model(tokens)
    assert scaled_info["label"] == "alibi · log_n" and scaled_info["attention_scale"] == "log_n"
    torch.testing.assert_close(scaled[:, :16], plain[:, :16])  # in length: the model as trained
    assert not torch.allclose(scaled[:, 16:], plain[:, 16:])
    assert [block.attn.encoding for block in model.blocks] == schemes
    assert all(".parts." not in key for key in model.state_dict())


def test_log_n_switch_refuses_what_it_cannot_do() -> None:
    info = {"label": "rope+ssmax", "train_len": 16}
    with (
        pytest.raises(ValueError, match="twice"),
        attention_scaling(_decoder("rope+ssmax"), {"attention_scale": "log_n"}, info),
    ):
        pass


def test_a_length_scaled_evaluation_is_checked_and_gets_its_own_directory() -> None:
    from helpers import compose_train

    from posenc.config import to_container
    from posenc.evaluate.__main__ import eval_dir_name
    from posenc.schema import TrainConfig, refusal

    trained = to_container(compose_train("+encoding=alibi").eval)
    assert trained["attention_scale"] is None  # off unless asked
    assert eval_dir_name({**trained, "attention_scale": "log_n"}, trained) == "eval_log_n"
    config = to_container(compose_train("+encoding=alibi"))
    assert refusal({**config, "eval": {**trained, "attention_scale": "log_n"}}, TrainConfig) is None
    assert refusal({**config, "eval": {**trained, "attention_scale": "logn"}}, TrainConfig) == (
        "eval.attention_scale=logn must be one of log_n, llama4 or null"
    )
