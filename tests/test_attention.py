"""Every backend equals the eager reference; flex is compared on its forward (CPU has no flex backward)."""

from __future__ import annotations

import pytest
import torch
from conftest import HEAD_DIM, HEADS, SCHEMES, layer_features, make

from posenc.attention import available_backends, get_backend
from posenc.attention.auto import choose
from posenc.encodings.base import PositionalEncoding

LENGTH = 37  # not a multiple of any block size


def _qkv(length: int = LENGTH, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(2, HEADS, length, HEAD_DIM, dtype=dtype) for _ in range(3))


def test_backend_registry() -> None:
    assert {"eager", "sdpa", "flex", "auto"} <= set(available_backends())
    with pytest.raises(ValueError, match=r"unknown attention backend 'fast'.*eager"):
        get_backend("fast")


def _refusal(enc, backend: str) -> str | None:
    """What a backend says, by the scheme's declarations, when it cannot run the scheme; ``None`` when it can."""
    if backend == "scheme" and not enc.supplies_attention:
        return "supplies none"
    if backend in ("sdpa", "flex") and enc.supplies_attention:  # not softmax(q·kᵀ/√D + bias): refused, never run
        return "supplies its own attention"
    if backend == "flex" and enc.adds_content_bias:  # a score_mod cannot read q and k: refused, never dropped
        return "content-dependent bias"
    return None


@pytest.mark.parametrize("backend", ["sdpa", "flex", "auto", "scheme"])
@pytest.mark.parametrize("name", [*SCHEMES, "rope+alibi", "alibi+t5+kerple_log"])
def test_backend_matches_eager_fp32(name: str, backend: str) -> None:
    enc = make(name)
    pos = torch.arange(LENGTH)
    q, k, v = _qkv()
    q, k = enc.rotate(q, k, pos, pos)
    features = layer_features(enc, 2, LENGTH)
    refusal = _refusal(enc, backend)
    if refusal is not None:
        with pytest.raises(ValueError, match=refusal):
            get_backend(backend)(q, k, v, enc, pos, pos, features=features)
        return
    with torch.no_grad():
        expected = get_backend("eager")(q, k, v, enc, pos, pos, features=features)
        got = get_backend(backend)(q, k, v, enc, pos, pos, features=features)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["alibi", "t5", "kerple_log"])
def test_sdpa_chunked_bias_matches_eager(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import posenc.attention.sdpa as sdpa

    monkeypatch.setattr(sdpa, "MAX_MASK_ELEMENTS", 5 * LENGTH)  # force 5-row query chunks
    enc = make(name)
    pos = torch.arange(LENGTH)
    q, k, v = _qkv()
    torch.testing.assert_close(
        sdpa.sdpa_attention(q, k, v, enc, pos, pos), get_backend("eager")(q, k, v, enc, pos, pos), atol=2e-5, rtol=1e-4
    )


@pytest.mark.parametrize("name", ["alibi", "kerple_power", "t5"])
def test_sdpa_gradients_match_eager(name: str) -> None:
    pos = torch.arange(LENGTH)
    grads = {}
    for backend in ("eager", "sdpa"):
        torch.manual_seed(1)
        enc = make(name)
        q, k, v = (t.requires_grad_() for t in _qkv())
        get_backend(backend)(q, k, v, enc, pos, pos).square().sum().backward()
        grads[backend] = [q.grad, k.grad, v.grad, *(p.grad for p in enc.parameters())]
    for got, expected in zip(grads["sdpa"], grads["eager"], strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["alibi", "kerple_log", "t5"])
def test_flex_respects_window_offset(name: str) -> None:
    enc = make(name)
    pos = torch.arange(500, 500 + LENGTH)
    q, k, v = _qkv()
    with torch.no_grad():
        torch.testing.assert_close(
            get_backend("flex")(q, k, v, enc, pos, pos),
            get_backend("eager")(q, k, v, enc, pos, pos),
            atol=2e-5,
            rtol=1e-4,
        )


def test_flex_refuses_cpu_training_clearly() -> None:
    enc = make("alibi")
    pos = torch.arange(8)
    q, k, v = (t.requires_grad_() for t in _qkv(8))
    with pytest.raises(RuntimeError, match=r"cannot train on CPU.*attention=sdpa"):
        get_backend("flex")(q, k, v, enc, pos, pos)


@pytest.mark.parametrize("name", ["alibi", "t5", "rope"])
def test_bf16_close_to_fp32(name: str) -> None:
    enc = make(name)
    pos = torch.arange(LENGTH)
    q, k, v = _qkv()
    reference = get_backend("eager")(q, k, v, enc, pos, pos)
    with torch.no_grad():
        low = get_backend("sdpa")(q.bfloat16(), k.bfloat16(), v.bfloat16(), enc, pos, pos)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), reference, atol=5e-2, rtol=5e-2)


def test_bias_is_added_before_the_mask() -> None:
    # A large positive bias on masked (future) entries must not leak: the mask comes after the bias. (Not a function
    # of the distance i − j ≥ 0 alone, so sdpa builds it from ``bias``, not from a distance table.)
    class FutureLover(PositionalEncoding):
        adds_bias = True

        def bias(self, q_pos, k_pos):
            return 1e4 * (k_pos[None, None, :] > q_pos[None, :, None]).float().expand(self.num_heads, -1, -1)

    enc = FutureLover(HEADS, HEAD_DIM)
    pos = torch.arange(6)
    q, k, v = _qkv(6)
    out = get_backend("eager")(q, k, v, enc, pos, pos)
    torch.testing.assert_close(out, get_backend("eager")(q, k, v, make("nope"), pos, pos))
    torch.testing.assert_close(get_backend("sdpa")(q, k, v, enc, pos, pos), out, atol=2e-5, rtol=1e-4)


def test_auto_choice() -> None:
    assert choose(make("nope"), is_cuda=True) == "sdpa"
    assert choose(make("alibi"), is_cuda=True) == "flex"
    assert choose(make("alibi"), is_cuda=False) == "sdpa"
