"""Training as the GPU trains, on CPU: bf16-mixed autocast, eager and compiled, against an fp32 reference.

Autocast rewrites matmul-like ops (einsum, matmul, linear) to bf16 on CPU as it does on CUDA, whatever their inputs'
dtype: an ``.float()`` before them does not keep them in fp32. Two kinds of test, for every scheme of the registry:

- the pieces meant in fp32 (every bias form, content biases, key terms, the bias-gradient identities, the dense
  reference) give under autocast exactly what they give without it;
- a training step under autocast (the CPU path uncompiled, and the CUDA path's compiled blocks under
  ``torch.compile(backend="aot_eager")``) is within bf16's tolerance of the fp32 step: the loss within 2% and the
  scheme parameters' gradients within 25% in norm. bf16 keeps ~3 significant digits of every activation, which
  moves these gradients by up to ~13% here; a missing, zeroed or sign-flipped gradient moves them by 100% or more.
  These tests see a path that breaks under autocast; a bias computed in bf16 hides in that noise, and is what the
  first kind of test (and ``test_long_distances.py``) pins down.
"""

from __future__ import annotations

import pytest
import torch
from conftest import HEAD_DIM, HEADS, SCHEMES, layer_features, make

from posenc.attention import get_backend
from posenc.attention.bias_grad import derivative_sums, diagonal_sums, row_deltas
from posenc.attention.eager import attention_weights
from posenc.encodings.base import PositionalEncoding
from posenc.model import Decoder
from posenc.training.compiling import compile_blocks

LENGTH, VOCAB = 40, 50


def bf16_autocast() -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _forms(enc: PositionalEncoding, q_pos: torch.Tensor, k_pos: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every fp32 form of the scheme's bias this scheme has, from fp32 inputs."""
    torch.manual_seed(5)
    q = torch.randn(2, HEADS, len(q_pos), HEAD_DIM)
    k = torch.randn(2, HEADS, len(k_pos), HEAD_DIM)
    forms = {}
    with torch.no_grad():
        features = layer_features(enc, 2, len(k_pos))  # the keys' features of a scheme that reads the layer's input
        if features is not None:
            forms["token_features"] = features
        if enc.adds_bias:
            forms["bias"] = enc.bias(q_pos, k_pos)
            mod = enc.score_mod(num_distances=int(k_pos[-1]) + 1)
            forms["score_mod"] = mod(
                torch.zeros(HEADS, len(q_pos), len(k_pos)),
                torch.tensor(0),
                torch.arange(HEADS)[:, None, None],
                q_pos[None, :, None],
                k_pos[None, None, :],
            )
        if enc.distance_only:
            forms["distance_bias"] = enc.distance_bias(len(k_pos))
        if enc.adds_content_bias:
            forms["content_bias"] = enc.content_bias(q, k, q_pos, k_pos, features=features)
            key_term = enc.key_bias(k, k_pos, features)
            if key_term is not None:
                forms["key_bias"] = key_term
        if enc.supplies_attention:
            forms["attend"] = enc.attend(q, k, k, q_pos, k_pos, features)
        forms["attention_weights"] = attention_weights(q, k, enc, q_pos, k_pos, features)
        forms["eager"] = get_backend("eager")(q, k, k, enc, q_pos, k_pos, features=features)
    return forms


@pytest.mark.parametrize("name", [*SCHEMES, "rope+alibi+kerple_log", "alibi_dd+t5"])
def test_fp32_pieces_stay_fp32_under_autocast(name: str) -> None:
    enc = make(name)
    pos = torch.arange(300)  # past 256: bf16 would round distances
    expected = _forms(enc, pos, pos)
    with bf16_autocast():
        got = _forms(enc, pos, pos)
    assert got.keys() == expected.keys()
    for form, value in expected.items():
        assert got[form].dtype == value.dtype == torch.float32, form
        torch.testing.assert_close(got[form], value, atol=1e-6, rtol=1e-6, msg=lambda m, f=form: f"{f}: {m}")


def test_bias_gradient_identities_stay_fp32_under_autocast() -> None:
    enc = make("alibi+kerple_log+t5")
    torch.manual_seed(3)
    q, k, v, out, dout = (torch.randn(2, HEADS, 200, HEAD_DIM) for _ in range(5))
    lse = torch.randn(2, HEADS, 200).abs() + 3
    band = enc.distance_bias(120)
    out_f, lse_f = torch.randn_like(q), lse - 1  # what Identity 1's extra forward would give

    def identities() -> list[torch.Tensor]:
        deltas = row_deltas(out, dout)
        return [
            deltas,
            diagonal_sums(q, k, v, lse, dout, deltas, band),
            derivative_sums(lse, dout, deltas, out_f, lse_f),
        ]

    expected = identities()
    with bf16_autocast():
        got = identities()
    for value, reference in zip(got, expected, strict=True):
        assert value.dtype == torch.float32
        torch.testing.assert_close(value, reference, atol=1e-6, rtol=1e-6)


# ---- a training step under autocast, eager and compiled --------------------------------------------------------


def _step(model: Decoder, tokens: torch.Tensor, mixed: bool) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with bf16_autocast() if mixed else torch.autocast("cpu", enabled=False):
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    grads = {key: p.grad.float() for key, p in model.named_parameters() if ".encoding." in key and p.grad is not None}
    return loss.item(), grads


def _models(name: str, compiled: bool) -> tuple[Decoder, Decoder]:
    encoding = {"name": "learned", "max_positions": 64} if name == "learned" else name
    kwargs = {"vocab_size": VOCAB, "dim": HEADS * HEAD_DIM, "depth": 1, "heads": HEADS}
    reference = Decoder(encoding, attention="eager", **kwargs)
    model = Decoder(encoding, attention="auto", **kwargs)
    model.load_state_dict(reference.state_dict())
    with torch.no_grad():  # learnable biases start at or near zero: make them matter
        for key, param in reference.named_parameters():
            if ".encoding." in key:
                param.add_(0.3 * torch.randn_like(param)).abs_()
        model.load_state_dict(reference.state_dict())
    if compiled:
        compile_blocks(model, backend="aot_eager")
    return reference, model


def _compare(name: str, compiled: bool) -> None:
    torch.manual_seed(1)
    reference, model = _models(name, compiled)
    tokens = torch.randint(0, VOCAB, (2, LENGTH + 1))
    expected_loss, expected = _step(reference, tokens, mixed=False)
    loss, got = _step(model, tokens, mixed=True)
    assert loss == pytest.approx(expected_loss, rel=2e-2)
    assert got.keys() == expected.keys()
    if not expected:
        return  # no scheme parameter: the loss is the comparison
    # One vector of every scheme parameter's gradient: a parameter whose true gradient is ~0 (a per-head constant
    # added to every score, which softmax ignores) is compared at the scale of the others, not against its noise.
    got_all = torch.cat([got[key].flatten() for key in expected])
    expected_all = torch.cat([grad.flatten() for grad in expected.values()])
    error = (got_all - expected_all).norm() / expected_all.norm()
    assert error <= 0.25, f"scheme parameters' gradients: relative error {error:.3f} under bf16-mixed"


@pytest.mark.parametrize("name", SCHEMES)
def test_bf16_mixed_step_matches_fp32_on_the_cpu_path(name: str) -> None:
    _compare(name, compiled=False)


@pytest.mark.parametrize("name", SCHEMES)
def test_bf16_mixed_compiled_step_matches_fp32_on_the_cuda_path(cuda_branches: None, name: str) -> None:
    _compare(name, compiled=True)
