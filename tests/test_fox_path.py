"""FoX's and PaTH's formulas on hand-computed values, what they read from the layer's input, and PaTH's chunked path
over query suffixes (the registry tests cover the rest: backends, gradients, decoding, bf16, shift invariance)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import HEAD_DIM, HEADS, SCHEMES, layer_features, make

from posenc.attention import get_backend
from posenc.encodings.path import chunked_attention

# ---- FoX -----------------------------------------------------------------------------------------------------


def test_fox_sums_the_log_gates_of_the_tokens_after_the_key() -> None:
    enc = make("fox", heads=1, head_dim=2)
    with torch.no_grad():
        enc.gate_weight.copy_(torch.tensor([[1.0, 0.0]]))  # the gate reads x's first channel
        enc.gate_bias.zero_()
    x = torch.tensor([[[0.0, 5.0], [0.0, -5.0], [math.log(3.0), 7.0]]])  # gates σ: 1/2, 1/2, 3/4
    features = enc.token_features(x)
    torch.testing.assert_close(features[0, :, 0], torch.tensor([0.5, 0.5, 0.75]).log())
    k = torch.randn(1, 1, 3, 2)  # FoX's gate does not read the key
    bias = enc.content_bias(torch.zeros(1, 1, 3, 2), k, torch.arange(3), torch.arange(3), features=features)[0, 0]
    assert bias[2, 0].item() == pytest.approx(math.log(0.5) + math.log(0.75))  # c_2 − c_0: tokens 1 and 2
    assert bias[2, 1].item() == pytest.approx(math.log(0.75))
    assert bias[1, 0].item() == pytest.approx(math.log(0.5))
    assert bias[2, 2].item() == bias[0, 0].item() == 0.0


def test_fox_init_alibi_starts_as_alibi_and_the_paper_init_halves_every_gate() -> None:
    pos = torch.arange(20)
    i, j = torch.tril_indices(20, 20)
    x = torch.randn(2, 20, HEADS * HEAD_DIM)
    q = k = torch.randn(2, HEADS, 20, HEAD_DIM)
    enc = make("fox", init="alibi")
    got = enc.content_bias(q, k, pos, pos, features=enc.token_features(x))[..., i, j]
    torch.testing.assert_close(got, make("alibi").bias(pos, pos)[:, i, j].expand_as(got), atol=1e-5, rtol=1e-5)
    paper = make("fox")  # weights N(0, 0.02), bias 0: σ(w·x) ≈ 1/2 for an x of unit scale
    gates = paper.token_features(x)
    assert gates.shape == (2, 20, HEADS) and gates.dtype == torch.float32
    assert gates.mean().item() == pytest.approx(-math.log(2), abs=0.05)
    with pytest.raises(ValueError, match="fox's init must be one of paper, alibi"):
        make("fox", init="rope")


def test_alibi_dd_is_fox_with_its_gate_weight_in_the_key_projection() -> None:
    # alibi_dd's gate w_h · k_h = w_h · W_{K,h} x: FoX's gate with the weight W_{K,h}ᵀ w_h, the same bias.
    dim = HEADS * HEAD_DIM
    key_projection = torch.randn(dim, dim) / math.sqrt(dim)
    x = torch.randn(2, 15, dim)
    k = (x @ key_projection.T).unflatten(-1, (HEADS, HEAD_DIM)).transpose(1, 2)  # (B, H, L, D)
    dd, fox = make("alibi_dd"), make("fox")
    with torch.no_grad():
        dd.gate_weight.normal_()
        per_head = key_projection.unflatten(0, (HEADS, HEAD_DIM))  # (H, D, dim)
        fox.gate_weight.copy_(torch.einsum("hdm,hd->hm", per_head, dd.gate_weight))
        fox.gate_bias.copy_(dd.gate_bias)
    pos = torch.arange(15)
    expected = dd.content_bias(k, k, pos, pos)
    got = fox.content_bias(k, k, pos, pos, features=fox.token_features(x))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_fox_without_its_features_fails_in_one_line() -> None:
    q = torch.randn(1, HEADS, 4, HEAD_DIM)
    with pytest.raises(ValueError, match=r"fox reads the layer's input: pass features=encoding.token_features\(x\)"):
        get_backend("sdpa")(q, q, q, make("fox"), torch.arange(4), torch.arange(4))


# ---- PaTH ----------------------------------------------------------------------------------------------------


def _given_householders(enc, w: torch.Tensor, beta: torch.Tensor):
    """The scheme with w (B, H, L, D) and β (B, H, L) set directly instead of read from x."""
    enc.householders = lambda features: (w, beta)
    return enc


def test_path_multiplies_the_householders_after_the_key_in_order() -> None:
    # Two tokens after key 0: H_1 = I − 2 e1 e1ᵀ = diag(−1, 1) (a reflection), H_2 = I − u uᵀ with u = (1, 1)/√2
    # (β = 1: a projection), so H_1 H_2 = ½ [[−1, 1], [−1, 1]] while H_2 H_1 = ½ [[−1, −1], [1, 1]].
    w = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 1.0]]) / torch.tensor([1.0, 1.0, math.sqrt(2)])[:, None]
    beta = torch.tensor([0.0, 2.0, 1.0])
    enc = _given_householders(make("path", heads=1, head_dim=2), w[None, None], beta[None, None])
    q = torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, 0.0]])[None, None]
    k = torch.tensor([[2.0, 4.0], [1.0, 3.0], [-1.0, 2.0]])[None, None]
    # Row 2 by hand: k_0ᵀ H_1 H_2 q_2 = (2, 4) · ½ (−1, −1) = −3; k_1ᵀ H_2 q_2 = (1, 3) · ½ (1, −1) = −1;
    # k_2 · q_2 = −1.
    scores = torch.tensor([-3.0, -1.0, -1.0]) / math.sqrt(2)
    pos = torch.arange(3)
    weights = enc.attention_weights(q, k, pos, pos)
    torch.testing.assert_close(weights[0, 0, 2], scores.softmax(-1))
    v = torch.randn(1, 1, 3, 2)
    for chunk in (1, 2, 3):
        out = chunked_attention(q, k, v, w[None, None], beta[None, None], chunk)
        torch.testing.assert_close(out, weights @ v, atol=1e-6, rtol=1e-6)


def test_path_reads_unit_vectors_and_betas_from_the_input_through_a_causal_convolution() -> None:
    enc = make("path")
    x = torch.randn(2, 12, HEADS * HEAD_DIM)
    w, beta = enc.householders(enc.token_features(x))
    assert w.shape == (2, HEADS, 12, HEAD_DIM) and beta.shape == (2, HEADS, 12)
    # w / √(Σw² + 1e-6), as the published layer normalises: at most 1, and 1 once w is not tiny (here, at the start,
    # the two 0.02-scaled projections of a 32-wide input leave Σw² within two orders of 1e-6).
    assert torch.all((w.norm(dim=-1) > 0.5) & (w.norm(dim=-1) <= 1.0))
    with torch.no_grad():
        enc.w_down.mul_(10)
        enc.w_up.mul_(10)
    w, beta = enc.householders(enc.token_features(x))
    torch.testing.assert_close(w.norm(dim=-1), torch.ones(2, HEADS, 12), atol=1e-3, rtol=0)
    assert torch.all((beta > 0) & (beta < 2))
    changed = x.clone()
    changed[:, 5] += 1.0
    w_changed, beta_changed = enc.householders(enc.token_features(changed))
    # Width 3: token 5 moves w at 5, 6, 7 and no other; β reads its own token only.
    moved = (w_changed - w).abs().amax(dim=(0, 1, 3)) > 1e-6
    assert moved.tolist() == [t in (5, 6, 7) for t in range(12)]
    assert ((beta_changed - beta).abs().amax(dim=(0, 1)) > 1e-6).tolist() == [t == 5 for t in range(12)]


@pytest.mark.parametrize("chunk", [1, 3, 8, 64])
def test_path_chunked_rows_of_a_query_suffix_are_the_full_rows(chunk: int) -> None:
    # What cached decoding asks: new queries over every cached key, the keys' features kept beside them.
    enc = make("path", chunk=chunk)
    with torch.no_grad():
        for parameter in enc.parameters():
            parameter.add_(0.3 * torch.randn_like(parameter))
    pos = torch.arange(29)
    q, k, v = (torch.randn(2, HEADS, 29, HEAD_DIM) for _ in range(3))
    features = enc.token_features(torch.randn(2, 29, HEADS * HEAD_DIM))
    with torch.no_grad():
        full = enc.attend(q, k, v, pos, pos, features)
        torch.testing.assert_close(full, enc.attention_weights(q, k, pos, pos, features) @ v, atol=1e-5, rtol=1e-4)
        for start in (28, 20, 9, 1):
            rows = enc.attend(q[:, :, start:], k, v, pos[start:], pos, features)
            torch.testing.assert_close(rows, full[:, :, start:], atol=1e-5, rtol=1e-4)


def test_path_stacks_with_rotations_only() -> None:
    assert make("rope+path").supplies_attention and make("rope+path").reads_layer_input
    with pytest.raises(ValueError, match="path supplies its own attention, with no softmax score for alibi to act on"):
        make("alibi+path")
    with pytest.raises(ValueError, match="at most one scheme that reads the layer's input, got fox and path"):
        make("fox+path")
    widened = next(name for name in SCHEMES if make(name).qk_width != 1)  # q and k wider than the head (PoPE)
    enc = make(f"{widened}+path")
    pos = torch.arange(6)
    q, k = enc.rotate(*torch.randn(2, 1, HEADS, 6, HEAD_DIM), pos, pos)
    with pytest.raises(ValueError, match=r"path's Householder transformations act on q and k of the head's width"):
        enc.attend(q, k, torch.randn(1, HEADS, 6, HEAD_DIM), pos, pos, layer_features(enc, 1, 6))
