"""RoPE's evaluation-time scaling variants against frequencies written out by hand, and against transformers.

Setting throughout (unless a test says otherwise): base 10000, head_dim 8, so θ = 1, 0.1, 0.01, 0.001 for the
pairs i = 0 … 3 (wavelengths 2π, 20π, 200π, 2000π), training length L = 64, factor s = 8.
"""

from __future__ import annotations

import math

import pytest
import torch

from posenc.encodings.rope import SCALINGS, RoPE, rope_rotate, scaled_frequencies, yarn_correction_range

THETA = torch.tensor([1.0, 0.1, 0.01, 0.001], dtype=torch.float64)


def scaled(method: str, factor: float = 8, length: int = 64, head_dim: int = 8):
    rope = RoPE(2, head_dim)
    rope.set_context_scaling(method, factor, length)
    return rope


def test_yarn_follows_the_deployed_correction_range() -> None:
    # i(ρ) = 8 ln(64 / (2π ρ)) / (2 ln 10000): i(32) = −0.497 → floor −1 → clamp 0; i(1) = 1.008 → ceil 2
    assert yarn_correction_range(10000.0, 8, 64) == (0, 2)
    # the ramp γ_i = i / 2 = 0, ½, 1, 1: pair 0 kept, pair 1 half-interpolated, pairs 2 and 3 divided by 8
    expected = torch.tensor([1.0, 0.5 * 0.1 / 8 + 0.5 * 0.1, 0.01 / 8, 0.001 / 8], dtype=torch.float64)
    rope = scaled("yarn")
    torch.testing.assert_close(rope.inv_freq.double(), expected.float().double())
    assert rope.attention_scale == pytest.approx(0.1 * math.log(8) + 1)  # 1.2079


def test_yarn_and_its_paper_form_differ_on_the_fastest_pair() -> None:
    # head_dim 32, L 64, s 8: the paper ramps in r_0 = 64 / 2π = 10.19 turns, γ = (10.19 − 1)/31 = 0.296, so pair 0
    # keeps (1 − 0.296)/8 + 0.296 = 0.384 of its frequency; the deployed ramp starts at index 0 and keeps all of it
    paper = scaled("yarn_paper", head_dim=32).inv_freq[0].item()
    deployed = scaled("yarn", head_dim=32).inv_freq[0].item()
    assert paper == pytest.approx(0.3843, abs=1e-4) and deployed == 1.0


def test_yarn_clamps_the_ramp_to_the_rotated_channels() -> None:
    # At L = 10^8, i(1) = 8 ln(10^8 / 2π) / 18.42 = 7.20 → ceil 8 → clamped to r − 1 = 7
    assert yarn_correction_range(10000.0, 8, 10**8) == (5, 7)  # i(32) = 8 ln(10^8 / 64π) / 18.42 = 5.70 → 5


def test_llama3_keeps_short_waves_and_divides_long_ones() -> None:
    # L = 128: wavelengths below 128 / 4 = 32 kept (2π), beyond 128 divided by 8 (200π, 2000π); 20π = 62.8 between:
    # κ = (128 / 20π − 1) / 3 = 0.34573, θ' = (1 − κ) 0.1 / 8 + κ 0.1 = 0.042751
    kappa = (128 / (20 * math.pi) - 1) / 3
    expected = torch.tensor([1.0, (1 - kappa) * 0.0125 + kappa * 0.1, 0.00125, 0.000125], dtype=torch.float64)
    torch.testing.assert_close(expected[1], torch.tensor(0.042751, dtype=torch.float64), atol=1e-6, rtol=0)
    rope = scaled("llama3", length=128)
    torch.testing.assert_close(rope.inv_freq.double(), expected.float().double())
    assert rope.attention_scale == 1.0


def test_dynamic_ntk_follows_the_sequence_length() -> None:
    rope = scaled("dynamic_ntk")
    # n ≤ L: the trained frequencies
    for n in (32, 64):
        torch.testing.assert_close(rope.frequencies(torch.arange(n)).double(), THETA.float().double())
    # n = 128: base' = 10000 · (8 · 128/64 − 7)^(8/6) = 10000 · 9^(4/3), so θ'_i = θ_i · 9^(−i/3)
    expected = torch.tensor([1.0, 0.1 / 2.080084, 0.01 / 4.326749, 0.001 / 9], dtype=torch.float64)
    torch.testing.assert_close(rope.frequencies(torch.arange(128)).double(), expected, atol=1e-7, rtol=1e-5)
    # queries and keys of one sequence share the θ of its length
    x = torch.randn(1, 2, 128, 8)
    rotated_q, _ = rope.rotate(x, x, torch.arange(128), torch.arange(128))
    by_hand = rope_rotate(x, torch.arange(128), expected.float(), 8)
    torch.testing.assert_close(rotated_q, by_hand)


def test_dynamic_ntk_keeps_in_length_outputs_and_relative_positions() -> None:
    plain, rope = RoPE(2, 8), scaled("dynamic_ntk")
    x = torch.randn(1, 2, 64, 8)
    pos = torch.arange(64)
    torch.testing.assert_close(rope.rotate(x, x, pos, pos), plain.rotate(x, x, pos, pos))
    # one 300-position sequence: every query and key the same vector, so a score depends on positions alone
    q, k = torch.randn(1, 2, 1, 8).expand(1, 2, 300, 8), torch.randn(1, 2, 1, 8).expand(1, 2, 300, 8)
    rq, rk = rope.rotate(q, k, torch.arange(300), torch.arange(300))
    scores = rq[0] @ rk[0].transpose(-1, -2)  # (H, 300, 300)
    torch.testing.assert_close(scores[:, 250, 200], scores[:, 100, 50], atol=1e-4, rtol=1e-4)


def test_scaling_errors() -> None:
    rope = RoPE(2, 8)
    with pytest.raises(ValueError, match="choose one of pi, ntk, dynamic_ntk, yarn, yarn_paper, llama3"):
        rope.set_context_scaling("dynamic", 8, 64)
    with pytest.raises(ValueError, match="needs r ≥ 4"):
        RoPE(2, 2).set_context_scaling("dynamic_ntk", 8, 64)


def test_setting_again_replaces_the_previous_scaling() -> None:
    rope = scaled("yarn")
    rope.set_context_scaling("dynamic_ntk", 8, 64)
    assert rope.attention_scale == 1.0
    torch.testing.assert_close(rope.frequencies(torch.arange(64)).double(), THETA.float().double())


@pytest.mark.parametrize(("method", "rope_type"), [("yarn", "yarn"), ("llama3", "llama3"), ("dynamic_ntk", "dynamic")])
@pytest.mark.parametrize(("head_dim", "length", "factor"), [(8, 64, 8.0), (32, 64, 8.0), (64, 2048, 4.0)])
def test_matches_transformers_rope_init(method: str, rope_type: str, head_dim: int, length: int, factor: float) -> None:
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    from transformers import LlamaConfig

    scaling = {"rope_type": rope_type, "factor": factor}
    if rope_type == "llama3":
        scaling |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": length}
    config = LlamaConfig(
        hidden_size=2 * head_dim,
        num_attention_heads=2,
        head_dim=head_dim,
        rope_theta=10000.0,
        max_position_embeddings=length,
        rope_scaling=scaling,
    )
    init = rope_utils.ROPE_INIT_FUNCTIONS[rope_type]
    rope = scaled(method, factor=factor, length=length, head_dim=head_dim)
    for n in (length // 2, length, 3 * length):  # only dynamic NTK depends on n
        hf_freq, hf_scale = init(config, torch.device("cpu"), seq_len=n)
        ours = rope.frequencies(torch.arange(n))
        torch.testing.assert_close(ours, hf_freq.float(), rtol=1e-5, atol=1e-9)
        assert rope.attention_scale == pytest.approx(hf_scale)


def test_every_fixed_scaling_keeps_the_rotated_count() -> None:
    for method in set(SCALINGS) - {"dynamic_ntk"}:
        frequencies, multiplier = scaled_frequencies(10000.0, 8, method, 8.0, 64)
        assert frequencies.shape == (4,) and multiplier >= 1.0
        assert bool((frequencies <= THETA + 1e-12).all()), method  # scaling only ever slows a frequency
