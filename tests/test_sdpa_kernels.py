"""SDPA runs its fast kernel for every scheme, and a fixed bias is built once for every layer and window sharing it."""

from __future__ import annotations

import pytest
import torch
from conftest import HEAD_DIM, HEADS, SCHEMES, layer_features, make
from torch.profiler import ProfilerActivity, profile

import posenc.attention.sdpa as sdpa
import posenc.attention.sdpa_content as sdpa_content
import posenc.attention.tables as tables
from posenc.attention import get_backend
from posenc.attention.tables import has_gradient_forms, reads_table
from posenc.model import Decoder

# sdpa refuses a scheme that supplies its own attention (tests/test_attention.py): every other scheme is its.
SDPA_SCHEMES = [n for n in [*SCHEMES, "rope+alibi"] if not make(n).supplies_attention]
FLASH_CPU = "aten::_scaled_dot_product_flash_attention_for_cpu"
MATH = "aten::_scaled_dot_product_attention_math"


def _sdpa_kernels(name: str, queries: int, keys: int, train: bool) -> set[str]:
    """Names of the SDPA ops ``sdpa`` ran for scheme ``name`` on CPU: forward and backward, or a no-grad forward."""
    enc = make(name)
    k_pos = torch.arange(keys)
    q_pos = k_pos if queries == keys else k_pos[-queries:]
    q = torch.randn(2, HEADS, queries, HEAD_DIM, requires_grad=train)
    k, v = (torch.randn(2, HEADS, keys, HEAD_DIM, requires_grad=train) for _ in range(2))
    with profile(activities=[ProfilerActivity.CPU]) as prof, torch.set_grad_enabled(train):
        rotated_q, rotated_k = enc.rotate(q, k, q_pos, k_pos)
        features = layer_features(enc, 2, keys, requires_grad=train)
        out = get_backend("sdpa")(rotated_q, rotated_k, v, enc, q_pos, k_pos, features=features)
        if train:
            out.sum().backward()
    return {event.name for event in prof.events() if "scaled_dot_product" in event.name}


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("queries", [33, 5], ids=["self-attention", "query-suffix"])
@pytest.mark.parametrize("name", [*SDPA_SCHEMES, "rope+alibi_dd", "alibi+cope"])
def test_sdpa_takes_the_cpu_flash_kernel(name: str, queries: int, train: bool) -> None:
    # A 3-D (H, Lq, Lk) mask sends SDPA to its math kernel, several times slower on CPU: masks must arrive 4-D.
    # A mask that needs a gradient (a learnable or content-dependent bias, training) can only go to the math
    # kernel, the one SDPA kernel that differentiates its mask, unless the bias is a distance table whose gradient
    # comes from its declared forms; every other case must take the flash kernel.
    # A content bias with a key term (key_bias) rides in q and k instead of a mask: the flash kernel again. One
    # that reads the scores (reads_scores) trains through a plain softmax of the scores it already has: no SDPA.
    enc = make(name)
    kernels = _sdpa_kernels(name, queries, keys=33, train=train)
    term = enc.key_bias(torch.zeros(1, HEADS, 2, HEAD_DIM), torch.arange(2), layer_features(enc, 1, 2))
    folded = enc.adds_content_bias and not enc.adds_bias and term is not None
    # A learnable distance table with gradient forms trains through the flash kernel both ways (``CpuTableAttention``).
    table_trained = train and queries == 33 and enc.learnable_bias and has_gradient_forms(enc)
    if train and enc.reads_scores:
        assert MATH not in kernels and FLASH_CPU not in kernels, kernels
    elif train and (enc.learnable_bias or enc.adds_content_bias) and not folded and not table_trained:
        assert MATH in kernels and FLASH_CPU not in kernels, kernels
    else:
        assert FLASH_CPU in kernels and MATH not in kernels, kernels


def _pair(name: str, depth: int = 3) -> tuple[Decoder, Decoder]:
    """The same weights behind ``sdpa`` and behind the ``eager`` reference."""
    encoding = {"name": "learned", "max_positions": 64} if name == "learned" else name
    kwargs = {"vocab_size": 50, "dim": HEADS * HEAD_DIM, "depth": depth, "heads": HEADS}
    fast = Decoder(encoding, attention="sdpa", **kwargs)
    reference = Decoder(encoding, attention="eager", **kwargs)
    reference.load_state_dict(fast.state_dict())
    return fast, reference


def _count_bias_calls(model: Decoder, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A one-element counter of dense biases built: gathered from a distance table, or the members' ``bias`` calls."""
    calls = [0]
    original_mask = tables.distance_mask

    def counted_mask(*args):
        calls[0] += 1
        return original_mask(*args)

    monkeypatch.setattr(tables, "distance_mask", counted_mask)
    for member_type in {type(member) for enc in model.layer_encodings for member in enc.members}:
        original = member_type.bias

        def counted(self, q_pos, k_pos, original=original):
            calls[0] += 1
            return original(self, q_pos, k_pos)

        monkeypatch.setattr(member_type, "bias", counted)
    return calls


@pytest.mark.parametrize("name", [n for n in SDPA_SCHEMES if make(n).adds_bias and not make(n).learnable_bias])
def test_fixed_bias_is_built_once_for_every_layer_and_window(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sdpa.MASKS.clear()
    model, _ = _pair(name)
    calls = _count_bias_calls(model, monkeypatch)
    # One dense bias per build: the table's gather, or one ``bias`` call per member of the stack.
    members = 1 if reads_table(model.layer_encodings[0]) else len(model.layer_encodings[0].members)
    tokens = torch.randint(0, 50, (2, 24))
    model(tokens).sum().backward()  # a training step: every layer shares one bias
    assert calls[0] == members
    with torch.no_grad():
        model(tokens)  # the next window of the same length: nothing rebuilt
        assert calls[0] == members
        model(tokens[:, :16])  # a new length: built once more
    assert calls[0] == 2 * members


@pytest.mark.parametrize("name", SDPA_SCHEMES)
def test_reused_bias_equals_the_reference_and_follows_parameter_changes(name: str) -> None:
    # No-grad forwards fill the cache (learnable biases included); a training forward after them must still give
    # every parameter its gradient, and a change of the parameters must never be answered with an old bias.
    fast, reference = _pair(name)
    tokens = torch.randint(0, 50, (2, 24))
    for _ in range(2):
        with torch.no_grad():
            torch.testing.assert_close(fast(tokens), reference(tokens), atol=2e-5, rtol=1e-4)
        for model in (fast, reference):
            model.zero_grad()
            model(tokens).square().mean().backward()
        for (param_name, got), expected in zip(fast.named_parameters(), reference.parameters(), strict=True):
            assert (got.grad is None) == (expected.grad is None), param_name
            if expected.grad is not None:
                torch.testing.assert_close(got.grad, expected.grad, atol=1e-5, rtol=1e-4, msg=param_name)
        with torch.no_grad():  # an optimiser-like in-place step on every parameter and buffer of the schemes
            for fast_enc, reference_enc in zip(fast.layer_encodings, reference.layer_encodings, strict=True):
                tensors = zip(
                    [*fast_enc.parameters(), *fast_enc.buffers()],
                    [*reference_enc.parameters(), *reference_enc.buffers()],
                    strict=True,
                )
                for got, expected in tensors:
                    if got.is_floating_point():
                        step = 0.05 * torch.randn_like(got)
                        got.add_(step)
                        expected.add_(step)


def test_schemes_never_share_a_bias_by_accident() -> None:
    # One warm cache, every biased scheme in turn at the same positions: each must see its own bias.
    tokens = torch.randint(0, 50, (2, 20))
    for name in [*SCHEMES, "rope+alibi"]:
        if make(name).adds_bias:
            fast, reference = _pair(name, depth=2)
            with torch.no_grad():
                torch.testing.assert_close(fast(tokens), reference(tokens), atol=2e-5, rtol=1e-4, msg=name)


def test_mask_cache_is_bounded_in_bytes() -> None:
    cache = sdpa.MaskCache(max_bytes=3 * 4 * 16)  # three 16-element fp32 masks
    for key in range(4):
        cache.get(key, lambda: torch.zeros(16))
    assert list(cache.masks) == [1, 2, 3]
    built = []
    assert cache.get("large", lambda: built.append(1) or torch.zeros(64)).numel() == 64
    assert "large" not in cache.masks and built == [1]
    assert cache.get(None, lambda: torch.ones(2)).tolist() == [1.0, 1.0] and None not in cache.masks


def test_content_bias_chunks_are_sized_from_the_gpus_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    # The CPU's cache-sized chunks would be ~800 SDPA calls per layer for a 16K window of 12 heads on an H100.
    class H100:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: H100)
    assert sdpa_content.content_chunk_elements(torch.device("cpu")) == sdpa_content.MAX_CONTENT_ELEMENTS
    on_gpu = sdpa_content.content_chunk_elements(torch.device("cuda", 0))
    assert on_gpu * 4 * sdpa_content.CONTENT_TEMPORARIES <= H100.total_memory // 4  # a bounded share of the memory
    assert -(-16384 // (on_gpu // (12 * 16384))) <= 64  # chunks per layer at 16K, 12 heads
