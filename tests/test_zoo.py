"""The newer schemes' formulas on hand-computed values, the content-bias contract (parametrised over every scheme
that declares one), partial schemes, and RoPE's evaluation-time scaling (PI, NTK, YaRN) down to the CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CONTENT_SCHEMES, HEAD_DIM, HEADS, layer_features, make
from helpers import FAST, compose_train

import posenc.attention.sdpa_content as sdpa_content
from posenc.attention import get_backend
from posenc.attention.auto import choose
from posenc.encodings.alibi import alibi_slopes
from posenc.encodings.base import PositionalEncoding
from posenc.evaluate.runner import evaluate_model
from posenc.model import Decoder
from posenc.runtime import forced_cuda_path
from posenc.train import train

# --- content-dependent biases: the contract every such scheme honours ----------------------------------------

CONTENT_CASES = [*CONTENT_SCHEMES, "alibi+cope", "rope+alibi_dd", "rope+fox"]


def _perturbed(name: str) -> PositionalEncoding:
    """The scheme with every parameter moved off its initial value (CoPE's zero table would hide a wrong row)."""
    enc = make(name)
    with torch.no_grad():
        for parameter in enc.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    return enc


def _attention_grads(backend: str, name: str, length: int) -> list[torch.Tensor]:
    torch.manual_seed(11)
    enc = _perturbed(name)
    pos = torch.arange(length)
    q, k, v = (torch.randn(2, HEADS, length, HEAD_DIM, requires_grad=True) for _ in range(3))
    features = layer_features(enc, 2, length, requires_grad=True)
    rotated_q, rotated_k = enc.rotate(q, k, pos, pos)
    out = get_backend(backend)(rotated_q, rotated_k, v, enc, pos, pos, features=features)
    (out * torch.randn(out.shape)).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad, *(p.grad for p in enc.parameters() if p.requires_grad)]


@pytest.mark.parametrize("name", CONTENT_CASES)
def test_chunked_sdpa_content_bias_matches_eager_values_and_gradients(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sdpa_content, "MAX_CONTENT_ELEMENTS", 2 * HEADS * 5 * 37)  # chunks of ≤ 5 queries
    monkeypatch.setattr(sdpa_content, "MAX_FOLDED_ROWS", 5)  # the same for a bias folded into q and k (key_bias)
    expected = _attention_grads("eager", name, 37)
    got = _attention_grads("sdpa", name, 37)
    assert len(got) == len(expected) > 4  # the scheme's parameters receive gradients
    for value, reference in zip(got, expected, strict=True):
        assert value is not None
        # fp32 rounding scales with the tensor: FoX's gate gradients sum x over every token, ~10 here (fp64: the
        # folded path is 3e-6 of that off, the dense reference 1e-6).
        atol = 1e-5 * max(1.0, reference.abs().max().item())
        torch.testing.assert_close(value, reference, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("name", CONTENT_CASES)
def test_query_suffix_over_all_keys_gives_the_full_rows(name: str) -> None:
    # What a KV-cached decoder does: new queries (positions q_pos) over every cached key (a prefix ⊇ q_pos).
    enc = _perturbed(name)
    pos = torch.arange(100, 130)
    q, k, v = (torch.randn(2, HEADS, 30, HEAD_DIM) for _ in range(3))
    features = layer_features(enc, 2, 30)  # cached beside the keys: every key's, whatever the queries
    full = enc.content_bias(q, k, pos, pos, features=features)
    causal = pos[None, :] <= pos[:, None]
    for start in (29, 17, 1):
        suffix = enc.content_bias(q[:, :, start:], k, pos[start:], pos, features=features)
        assert suffix.shape == (2, HEADS, 30 - start, 30)
        mask = causal[start:]
        torch.testing.assert_close(suffix[..., mask], full[:, :, start:][..., mask], atol=1e-5, rtol=1e-5)
        for backend in ("eager", "sdpa"):
            with torch.no_grad():
                rows = get_backend(backend)(q[:, :, start:], k, v, enc, pos[start:], pos, features=features)
                every = get_backend(backend)(q, k, v, enc, pos, pos, features=features)
            torch.testing.assert_close(rows, every[:, :, start:], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", CONTENT_CASES)
def test_a_declared_key_bias_is_the_content_bias_up_to_a_row_term(name: str) -> None:
    # key_bias lets sdpa fold the bias into q and k: it must equal content_bias minus something constant per row.
    enc = _perturbed(name)
    k_pos = torch.arange(50, 90)
    q, k = torch.randn(2, HEADS, 40, HEAD_DIM), torch.randn(2, HEADS, 40, HEAD_DIM)
    features = layer_features(enc, 2, 40)
    term = enc.key_bias(k, k_pos, features)
    if term is None:
        pytest.skip(f"{name} declares no key term")
    assert term.shape == (2, HEADS, 40) and term.dtype == torch.float32
    for start in (0, 25):  # self-attention, and a query suffix over every key
        q_pos = k_pos[start:]
        residual = enc.content_bias(q[:, :, start:], k, q_pos, k_pos, features=features) - term[:, :, None, :]
        causal = k_pos[None, :] <= q_pos[:, None]
        spread = (residual - residual[..., :1]).masked_fill(~causal, 0.0)
        assert spread.abs().max() < 1e-4


def test_some_registered_scheme_declares_a_key_bias() -> None:
    # Otherwise the folded path and its tests above would test nothing.
    k = torch.randn(1, HEADS, 6, HEAD_DIM)
    schemes = [make(name) for name in CONTENT_SCHEMES]
    assert any(enc.key_bias(k, torch.arange(6), layer_features(enc, 1, 6)) is not None for enc in schemes)


@pytest.mark.parametrize("name", CONTENT_SCHEMES)
def test_content_bias_is_causal_and_fp32(name: str) -> None:
    # Changing a later token (its key, and the layer input its features come from) never changes an earlier query's
    # causal entries.
    enc = _perturbed(name)
    pos = torch.arange(12)
    q, k = torch.randn(1, HEADS, 12, HEAD_DIM), torch.randn(1, HEADS, 12, HEAD_DIM)
    x = torch.randn(1, 12, HEADS * HEAD_DIM)
    changed, changed_x = k.clone(), x.clone()
    changed[:, :, 8] += 1.0
    changed_x[:, 8] += 1.0
    before = enc.content_bias(q, k, pos, pos, features=enc.token_features(x))
    after = enc.content_bias(q, changed, pos, pos, features=enc.token_features(changed_x))
    assert before.dtype == torch.float32
    i, j = torch.tril_indices(8, 8)
    torch.testing.assert_close(before[..., i, j], after[..., i, j])
    assert not torch.allclose(before[..., 8:, :9], after[..., 8:, :9])


@pytest.mark.parametrize("name", CONTENT_CASES)
def test_auto_keeps_content_biases_off_flex(name: str) -> None:
    enc = make(name)
    assert choose(enc, is_cuda=True) == choose(enc, is_cuda=False) == "sdpa"
    assert enc.learnable_bias and enc.bias_gradient_forms() is None  # trainable, and no identity applies
    q = torch.randn(1, HEADS, 8, HEAD_DIM)
    pos = torch.arange(8)
    for backend in ("flex", "flex_learnable"):
        with pytest.raises(ValueError, match=rf"attention={backend} cannot apply .*content-dependent bias"):
            get_backend(backend)(q, q, q, enc, pos, pos, features=layer_features(enc, 1, 8))


def test_fire_trains_off_flex_and_evaluates_on_it() -> None:
    # A learnable bias with no gradient forms whose score_mod FlexAttention cannot differentiate on a GPU (Inductor
    # does not lower its backward: the kernel lane): trained through sdpa on CUDA, evaluated through flex.
    fire = make("fire")
    assert fire.learnable_bias and fire.bias_gradient_forms() is None and not fire.distance_only
    assert not fire.score_mod_differentiable
    assert choose(fire, is_cuda=True, training=True) == "sdpa"
    assert choose(fire, is_cuda=True, training=False) == "flex"
    assert choose(fire, is_cuda=False) == "sdpa"
    q = torch.randn(1, HEADS, 8, HEAD_DIM, requires_grad=True)
    pos = torch.arange(8)
    with forced_cuda_path(), pytest.raises(ValueError, match="attention=flex cannot train fire's bias"):
        get_backend("flex")(q, q, q, fire, pos, pos)


# --- each scheme's formula on hand-computed values ----------------------------------------------------------


def test_sandwich_values() -> None:
    enc = make("sandwich", dim=4)  # ω_1 = 10000^(-1/2) = 0.01, ω_2 = 10000^(-1)
    bias = enc.bias(torch.arange(101), torch.arange(101))
    inner = math.cos(100 * 0.01) + math.cos(100 * 1e-4) - 2  # d = 100, minus d'/2
    for h in range(HEADS):
        assert bias[h, 100, 0].item() == pytest.approx(inner / (8 * (h + 1) / HEADS), abs=1e-6)
    assert torch.all(bias[:, torch.arange(101), torch.arange(101)] == 0)
    assert not list(enc.parameters())


def test_sandwich_score_mod_reads_a_table_once_the_length_is_known() -> None:
    # d'/2 = 64 cosines per score (and again in the backward) cost more than the attention; a backend that knows the
    # window's length gets a score_mod that gathers from an (H, L) table built once, with the same values.
    from torch.overrides import TorchFunctionMode

    class CountCosines(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            CountCosines.calls += func is torch.cos
            return func(*args, **(kwargs or {}))

    enc = make("sandwich")
    q_idx, kv_idx = torch.tril_indices(50, 50)
    args = (torch.zeros(HEADS, q_idx.numel()), torch.tensor(0), torch.arange(HEADS)[:, None], q_idx, kv_idx)
    mod = enc.score_mod(num_distances=50)
    with CountCosines():
        got = mod(*args)
    assert CountCosines.calls == 0 and enc.score_mod_reads_table
    torch.testing.assert_close(got, enc.score_mod()(*args))


def test_fire_values_and_threshold() -> None:
    enc = make("fire", mlp_width=1)
    with torch.no_grad():
        enc.c.fill_(1.0)
        enc.threshold_multiplier.fill_(2.0 / 512)  # L = 2
        enc.hidden.weight.fill_(1.0)
        enc.hidden.bias.zero_()
        enc.out.weight.copy_(torch.arange(1.0, HEADS + 1)[:, None])  # head h scales by h + 1
        enc.out.bias.zero_()
    bias = enc.bias(torch.arange(6), torch.arange(6))
    # ψ(x) = log(1 + x): i = 3, j = 1 → ψ(2) / ψ(max(2, 3)) = log 3 / log 4; i = 1 is below L: normalised by ψ(2).
    for h in range(HEADS):
        assert bias[h, 3, 1].item() == pytest.approx((h + 1) * math.log(3) / math.log(4), rel=1e-5)
        assert bias[h, 1, 0].item() == pytest.approx((h + 1) * math.log(2) / math.log(3), rel=1e-5)
    # Past the threshold the bias depends on the query position too (progressive interpolation).
    assert bias[0, 5, 3].item() != pytest.approx(bias[0, 3, 1].item())


def test_fire_is_shift_invariant_below_its_threshold() -> None:
    enc = make("fire")  # L = 512
    pos = torch.arange(40)
    torch.testing.assert_close(enc.bias(pos, pos), enc.bias(pos + 400, pos + 400))
    assert not torch.allclose(enc.bias(pos, pos), enc.bias(pos + 1000, pos + 1000))


def test_fire_score_mod_matches_its_bias_past_the_threshold() -> None:
    enc = make("fire", init_threshold=8.0)
    q_idx, k_idx = torch.tril_indices(30, 30)
    dense = enc.bias(torch.arange(30), torch.arange(30))
    for h in range(HEADS):
        got = enc.score_mod()(torch.zeros(q_idx.shape), torch.tensor(0), torch.tensor(h), q_idx, k_idx)
        torch.testing.assert_close(got, dense[h, q_idx, k_idx], atol=1e-5, rtol=1e-5)


def test_cope_counts_gates_and_interpolates() -> None:
    enc = make("cope", heads=1, head_dim=2, num_positions=4)
    x = 0.7
    with torch.no_grad():
        enc.embeddings.zero_()
        enc.embeddings[:, 0] = torch.arange(4.0) ** 2  # z_i[n] = x · n²: interpolation is visible
    q = torch.tensor([[x, 0.0]]).expand(5, 2)[None, None]  # q · k = 0: every gate is σ(0) = 1/2
    k = torch.tensor([[0.0, 1.0]]).expand(5, 2)[None, None]
    pos = torch.arange(5)
    positions = enc.contextual_positions(q, k, pos, pos)
    assert positions[0, 0, 3, 0].item() == pytest.approx(2.0)  # four gates of 1/2 from key 0 to query 3
    assert positions[0, 0, 3, 1].item() == pytest.approx(1.5)
    bias = enc.content_bias(q, k, pos, pos)[0, 0]
    assert bias[3, 0].item() == pytest.approx(x * 4.0)  # p = 2: e[2]
    assert bias[3, 1].item() == pytest.approx(x * (0.5 * 1 + 0.5 * 4))  # p = 1.5: halfway between e[1] and e[2]
    assert bias[3, 3].item() == pytest.approx(x * (0.5 * 0 + 0.5 * 1))  # p = 1/2
    # Seven gates at query 6 would count 3.5: clamped to the last embedding, P − 1 = 3.
    long_q, long_k = q[:, :, :1].expand(1, 1, 8, 2), k[:, :, :1].expand(1, 1, 8, 2)
    far = enc.content_bias(long_q, long_k, torch.arange(8), torch.arange(8))[0, 0]
    assert far[7, 0].item() == pytest.approx(x * 9.0)


def test_alibi_dd_starts_as_alibi() -> None:
    enc, alibi = make("alibi_dd"), make("alibi")
    pos = torch.arange(20)
    q, k = torch.randn(2, HEADS, 20, HEAD_DIM), torch.randn(2, HEADS, 20, HEAD_DIM)
    i, j = torch.tril_indices(20, 20)
    got = enc.content_bias(q, k, pos, pos)[..., i, j]
    torch.testing.assert_close(got, alibi.bias(pos, pos)[:, i, j].expand_as(got), atol=1e-5, rtol=1e-5)


def test_alibi_dd_sums_the_log_gates_between_key_and_query() -> None:
    enc = make("alibi_dd", heads=1, head_dim=1)
    with torch.no_grad():
        enc.gate_weight.fill_(1.0)
        enc.gate_bias.zero_()
    k = torch.tensor([0.0, 0.0, math.log(3.0)]).view(1, 1, 3, 1)  # gates σ(k) = 1/2, 1/2, 3/4
    bias = enc.content_bias(torch.zeros(1, 1, 3, 1), k, torch.arange(3), torch.arange(3))[0, 0]
    assert bias[2, 0].item() == pytest.approx(math.log(0.5) + math.log(0.75))  # gates of tokens 1 and 2
    assert bias[1, 0].item() == pytest.approx(math.log(0.5))
    assert bias[2, 2].item() == 0.0


def test_dape_adds_the_mlp_of_logits_and_prior_to_the_prior() -> None:
    enc = make("dape", heads=1, head_dim=1, base="alibi", mlp_width=1)
    with torch.no_grad():
        enc.hidden.weight.copy_(torch.tensor([[1.0, 0.0]]))  # reads A only
        enc.hidden.bias.zero_()
        enc.out.weight.fill_(0.5)
        enc.out.bias.fill_(0.25)
    prior = -(2.0**-8)  # ALiBi, one head, distance 1
    k = torch.tensor([3.0, 0.0]).view(1, 1, 2, 1)
    for q_value, hidden in ((2.0, 6.0), (-2.0, -0.06)):  # A = q · k = ±6; LeakyReLU's negative slope is 0.01
        q = torch.full((1, 1, 2, 1), q_value)
        bias = enc.content_bias(q, k, torch.arange(2), torch.arange(2))
        assert bias[0, 0, 1, 0].item() == pytest.approx(prior + 0.5 * hidden + 0.25, rel=1e-5)


def test_dape_refuses_a_base_without_a_position_bias() -> None:
    with pytest.raises(ValueError, match="dape's base must be a position-bias scheme"):
        make("dape", base="rope")


# --- partial schemes ----------------------------------------------------------------------------------------


def test_alibi_on_a_subset_of_heads() -> None:
    enc = make("alibi", heads=8, biased_heads=4)
    assert enc.slopes.tolist() == pytest.approx([1 / 4, 1 / 16, 1 / 64, 1 / 256, 0, 0, 0, 0])
    assert alibi_slopes(4) == pytest.approx(enc.slopes[:4].tolist())
    with pytest.raises(ValueError, match=r"biased_heads must be in 1\.\.8"):
        make("alibi", heads=8, biased_heads=9)


def test_rope_on_a_subset_of_heads() -> None:
    enc = make("rope", rotary_heads=1)
    x = torch.randn(1, HEADS, 6, HEAD_DIM)
    q, _ = enc.rotate(x, x, torch.arange(6), torch.arange(6))
    assert torch.equal(q[:, 1:], x[:, 1:]) and not torch.allclose(q[:, :1], x[:, :1])


# --- RoPE evaluation-time scaling ---------------------------------------------------------------------------


def test_rope_scaling_frequencies() -> None:
    base_freq = make("rope", head_dim=4).inv_freq.double()  # θ = 1, 0.01
    pi, ntk, yarn = (make("rope", head_dim=4) for _ in range(3))
    pi.set_context_scaling("pi", 8, 64)
    torch.testing.assert_close(pi.inv_freq.double(), base_freq / 8)
    ntk.set_context_scaling("ntk", 8, 64)  # base' = 10000 · 8^(4/2): θ'_1 = 0.01 / 8, θ'_0 = 1
    torch.testing.assert_close(ntk.inv_freq.double(), torch.tensor([1.0, 0.01 / 8], dtype=torch.float64))
    yarn.set_context_scaling("yarn_paper", 8, 64)
    ramp = (64 / (2 * math.pi) - 1) / 31  # θ_0 = 1 turns 10.2 times in 64 positions: partly kept
    expected = [(1 - ramp) / 8 + ramp, 0.01 / 8]  # θ_1 turns 0.1 times: interpolated
    torch.testing.assert_close(yarn.inv_freq.double(), torch.tensor(expected, dtype=torch.float64))
    assert yarn.attention_scale == pytest.approx(0.1 * math.log(8) + 1)
    x = torch.randn(1, HEADS, 3, 4)
    scaled, _ = yarn.rotate(x, x, torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    torch.testing.assert_close(scaled, x * yarn.attention_scale)  # position 0: only the temperature


def test_rope_scaling_errors() -> None:
    enc = make("rope")
    with pytest.raises(ValueError, match="unknown RoPE scaling 'ntkk'"):
        enc.set_context_scaling("ntkk", 8, 64)
    with pytest.raises(ValueError, match="factor must be ≥ 1"):
        enc.set_context_scaling("pi", 0.5, 64)
    assert not make("alibi").set_context_scaling("yarn", 8, 64)
    stack = make("rope+alibi")
    assert stack.set_context_scaling("pi", 2, 64) and stack.parts[0].scaling == ("pi", 2.0)


def test_evaluation_with_scaling_gets_its_own_label() -> None:
    model = Decoder("rope+alibi", vocab_size=20, dim=16, depth=1, heads=2).eval()
    eval_cfg = {"multiples": [1, 2], "mode": "nonoverlap", "rope_scaling": "yarn", "rope_scaling_factor": 4}
    info = {"label": "rope+alibi", "train_len": 8}
    results = evaluate_model(
        model, run_info=info, eval_cfg=eval_cfg, stream=torch.randint(0, 20, (200,)).numpy(), task=None
    )
    assert results["label"] == "rope+alibi · yarn×4"
    assert results["rope_scaling"] == {"method": "yarn", "factor": 4.0}
    assert model.layer_encodings[0].parts[0].scaling == ("yarn", 4.0)


def _evaluate(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "posenc.evaluate", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_evaluate_cli_with_rope_scaling(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    train(compose_train("+encoding=rope", *FAST, "eval.at_end=false"), run_dir)
    args = [str(run_dir), "eval.multiples=[1,2]", "eval.max_tokens=256", "eval.plots=false"]
    result = _evaluate(*args, "eval.rope_scaling=ntk", "eval.rope_scaling_factor=2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    saved = json.loads((run_dir / "eval_ntkx2_multiples1-2" / "results.json").read_text())
    assert saved["label"] == "rope · ntk×2" and saved["eval"]["rope_scaling"] == "ntk"
    assert not (run_dir / "eval").exists()
    half = _evaluate(*args, "eval.rope_scaling=yarn", cwd=tmp_path)
    assert half.returncode != 0 and "needs eval.rope_scaling_factor" in half.stderr
    assert "Traceback" not in half.stderr
