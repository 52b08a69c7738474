"""Cached incremental decoding equals the full forward, for every scheme, a stack and a schedule; the notebook maps."""

from __future__ import annotations

import pytest
import torch
from conftest import SCHEMES, SUPPLIED_SCHEMES, layer_features
from conftest import make as make_scheme
from helpers import HostReads

from posenc.attention import available_backends, decoding_backend, get_backend
from posenc.attention.eager import attention_weights
from posenc.decoding import KVCache
from posenc.model import Decoder

VOCAB = 40
TRAIN_LEN = 12  # the nominal training length: decoding goes to 4× it
COMPOSED = ["rope+alibi", ["alibi", "rope"]]


def tiny(encoding, **kwargs) -> Decoder:
    if encoding == "learned":
        encoding = {"name": "learned", "max_positions": 4 * TRAIN_LEN}
    # auto: sdpa on CPU for every scheme but one that supplies its own attention, which runs through its own (scheme)
    kwargs = {"vocab_size": VOCAB, "dim": 32, "depth": 2, "heads": 4, "attention": "auto", **kwargs}
    model = Decoder(encoding=encoding, **kwargs).eval()
    with torch.no_grad():  # learnable biases start at zero or near it: make them matter
        for name, param in model.named_parameters():
            if ".encoding." in name or "input_encoding" in name:
                param.add_(0.3 * torch.randn_like(param)).abs_()
    model.constrain_()
    return model


def cached_logits(model: Decoder, tokens: torch.Tensor, prompt: int, chunk: int = 1) -> torch.Tensor:
    """The prompt in one call, then ``chunk`` tokens per call over the cache."""
    cache = KVCache(len(model.blocks))
    with torch.no_grad():
        parts = [model(tokens[:, :prompt], cache=cache)]
        for start in range(prompt, tokens.shape[1], chunk):
            parts.append(model(tokens[:, start : start + chunk], cache=cache))
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("name", [*SCHEMES, *COMPOSED], ids=str)
def test_cached_decoding_matches_the_full_forward_past_the_training_length(name) -> None:
    model = tiny(name)
    tokens = torch.randint(0, VOCAB, (2, 4 * TRAIN_LEN))
    with torch.no_grad():
        full = model(tokens)
    torch.testing.assert_close(cached_logits(model, tokens, TRAIN_LEN), full, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(cached_logits(model, tokens, 5, chunk=7), full, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", available_backends())
def test_cached_decoding_works_from_a_model_built_with_any_backend(backend: str) -> None:
    # A backend that runs only schemes supplying their own attention gets one of those; every other, a stack of biases.
    name = f"rope+{SUPPLIED_SCHEMES[0]}" if backend == "scheme" else "rope+alibi"
    model = tiny(name, attention=backend, dim=64)  # head_dim 16: the smallest attention=triton takes
    tokens = torch.randint(0, VOCAB, (1, 3 * TRAIN_LEN))
    with torch.no_grad():
        full = model(tokens)
    torch.testing.assert_close(cached_logits(model, tokens, TRAIN_LEN), full, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("scheme", ["alibi", *SUPPLIED_SCHEMES])
def test_decoding_backend_follows_what_backends_declare(scheme: str) -> None:
    encoding = tiny(scheme).blocks[0].attn.encoding
    q, k, v = torch.randn(3, 1, 4, 5, 8).unbind(0)
    q, pos = q[:, :, -2:], torch.arange(5)
    features = layer_features(encoding, 1, 5)
    reference = attention_weights(q, k, encoding, pos[-2:], pos, features) @ v
    answered = []
    for name in available_backends():
        # The chosen backend takes a query suffix over the whole window, and agrees with the dense reference; one
        # that cannot run the scheme at all (a model built with it never gets to decode) says so in one line.
        chosen = decoding_backend(name, encoding)
        try:
            out = get_backend(chosen)(q, k, v, encoding, pos[-2:], pos, features=features)
        except ValueError as refusal:
            assert f"attention={chosen} runs softmax" in str(refusal) or "supplies none" in str(refusal)
            continue
        answered.append(chosen)
        torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    assert "eager" in answered and decoding_backend("auto", encoding) in answered
    assert decoding_backend("eager") == "eager" and decoding_backend("flex") != "flex"


def test_greedy_generation_is_the_argmax_of_the_full_forward() -> None:
    model = tiny("alibi")
    prompt = torch.randint(0, VOCAB, (2, 6))
    out = model.generate(prompt, max_new_tokens=12, temperature=0)
    assert out.shape == (2, 18) and torch.equal(out[:, :6], prompt)
    with torch.no_grad():
        for t in range(6, 18):
            assert torch.equal(model(out[:, :t])[:, -1].argmax(-1), out[:, t])


def test_sampling_is_seeded_and_top_k_limits_the_choice() -> None:
    model = tiny("rope")
    prompt = torch.randint(0, VOCAB, (3, 4))
    first = model.generate(prompt, 10, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(1))
    again = model.generate(prompt, 10, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(1))
    assert torch.equal(first, again)
    one = model.generate(prompt, 10, temperature=1.0, top_k=1)
    assert torch.equal(one, model.generate(prompt, 10, temperature=0))


def test_absolute_embeddings_refuse_to_decode_past_max_positions() -> None:
    model = tiny("learned")
    prompt = torch.randint(0, VOCAB, (1, 44))
    assert model.generate(prompt, 5, temperature=0).shape == (1, 49)  # 48 positions: the last token is not fed
    with pytest.raises(ValueError, match="learned supports at most 48 positions but got a sequence of 49"):
        model.generate(prompt, 6, temperature=0)


def test_generation_errors_are_clear() -> None:
    model = tiny("nope")
    with pytest.raises(ValueError, match="non-empty prompt"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="temperature must be"):
        model.generate(torch.zeros(1, 2, dtype=torch.long), 3, temperature=-1)


@pytest.mark.parametrize("name", [*SCHEMES, *COMPOSED], ids=str)
def test_attention_maps_are_the_layers_probabilities(name) -> None:
    model = tiny(name)
    tokens = torch.randint(0, VOCAB, (2, 12))
    maps = model.attention_maps(tokens, layer=1)
    assert maps.shape == (2, 4, 12, 12)
    torch.testing.assert_close(maps.sum(-1), torch.ones(2, 4, 12))
    assert torch.all(maps.triu(diagonal=1) == 0)
    # Replaying layer 1 with these probabilities reproduces the model's logits.
    attn = model.blocks[1].attn
    captured = {}
    hook = attn.register_forward_hook(lambda module, args, out: captured.update(x=args[0], out=out))
    with torch.no_grad():
        model(tokens)
    hook.remove()
    _, _, v, _, _, _ = attn.project(captured["x"], torch.arange(12))
    replay = attn.proj((maps @ v.float()).transpose(1, 2).flatten(2))
    torch.testing.assert_close(replay, captured["out"], atol=1e-5, rtol=1e-4)


def test_attention_maps_refuse_what_they_cannot_hold() -> None:
    model = tiny("alibi")
    with pytest.raises(ValueError, match="layer 3 does not exist"):
        model.attention_maps(torch.zeros(1, 4, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="too large to return"):
        model.attention_maps(torch.zeros(4, 4096, dtype=torch.long), 0)


@pytest.mark.parametrize("name", ["alibi", "rope", "t5"])
def test_decoding_steps_read_nothing_back_to_the_host(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # On a GPU, every value read into Python (the next position, a mask's key built from device tensors) stalls the
    # pipeline once per token and layer. After the prompt, a decoding step must read nothing.
    import posenc.attention.sdpa as sdpa

    model = tiny(name)
    tokens = torch.randint(0, VOCAB, (2, 3 * TRAIN_LEN))
    cache = KVCache(len(model.blocks))
    with torch.no_grad():
        model(tokens[:, :TRAIN_LEN], cache=cache)
        cached = len(sdpa.MASKS.masks)
        reads = HostReads(monkeypatch)
        for position in range(TRAIN_LEN, tokens.shape[1]):
            model(tokens[:, position : position + 1], cache=cache)
    assert reads.calls == [] and cache.length == tokens.shape[1]
    assert len(sdpa.MASKS.masks) == cached  # one-use masks of decoding steps are not kept


def test_unbiased_queries_over_cached_keys_keep_sdpa_off_boolean_masks() -> None:
    # A boolean mask (all true for one query) keeps SDPA off its flash kernel on a GPU: one query needs no mask, a
    # few queries over cached keys need causality aligned to the bottom right, which torch expresses itself.
    from torch.nn.attention.bias import CausalBias, CausalVariant
    from torch.overrides import TorchFunctionMode

    masks = []

    class Recording(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.nn.functional.scaled_dot_product_attention:
                masks.append((kwargs or {}).get("attn_mask"))
            return func(*args, **(kwargs or {}))

    enc, k_pos = make_scheme("rope"), torch.arange(20)
    k, v = torch.randn(2, 4, 20, 8), torch.randn(2, 4, 20, 8)
    for queries in (1, 5):
        q = torch.randn(2, 4, queries, 8)
        with Recording():
            got = get_backend("sdpa")(q, k, v, enc, k_pos[-queries:], k_pos)
        torch.testing.assert_close(got, get_backend("eager")(q, k, v, enc, k_pos[-queries:], k_pos))
    assert masks[0] is None
    assert isinstance(masks[1], CausalBias) and masks[1].variant == CausalVariant.LOWER_RIGHT
