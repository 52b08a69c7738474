"""A sink (``model.sink``) through every backend equals the dense reference: values and every gradient.

q, k, v, each scheme parameter and the sink's own (its logit, or its tokens' keys and values), for every softmax scheme
of the registry and every sink form, on every backend that takes the scheme. FlexAttention's backward runs here through
its dense implementation on CPU tensors, with the backends on their CUDA branches (what a GPU runs, less the
compilation); the table kernels run under Triton's interpreter. Then the model: cached decoding with a sink equals the
full forward, the tokens move with the window, the formulas on hand-computed values, the refusals, and what the
attention statistics see.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import HEADS, SCHEMES, SUPPLIED_SCHEMES, make

import posenc.attention.flex as flex
from posenc.attention import get_backend, scheme_refusal
from posenc.attention.auto import choose
from posenc.attention.flex_learnable import supports
from posenc.attention.sink import SINKS, Sink
from posenc.decoding import KVCache
from posenc.encodings.base import PositionalEncoding
from posenc.evaluate.attention_stats import attention_statistics
from posenc.model import Decoder
from posenc.runtime import forced_cuda_path

HEAD_DIM = 16  # the table kernels take head dims from 16
LENGTH = 21
KINDS = SINKS[1:]
SOFTMAX_SCHEMES = [name for name in SCHEMES if not make(name).supplies_attention]
# What an attention layer holds: an absolute scheme acts once on the input, its layers see no position.
CASES = [*(name for name in SOFTMAX_SCHEMES if not make(name).absolute), "rope+alibi", "alibi+t5+kerple_log"]
FUSED = ("flex", "flex_learnable")  # run on their CUDA branches, FlexAttention's dense backward on CPU


def _accepts(backend: str, name: str) -> bool:
    """Whether ``backend`` trains the scheme at all, by what it declares (its refusals are tested elsewhere)."""
    enc = make(name, head_dim=HEAD_DIM)
    if scheme_refusal(backend, enc) is not None:
        return False
    if backend == "flex_learnable":
        return supports(enc)
    if backend == "flex":  # a learnable score_mod FlexAttention cannot differentiate trains elsewhere
        return not (enc.learnable_bias and not enc.score_mod_differentiable)
    return True


def _moved(module: torch.nn.Module) -> None:
    """Scheme and sink parameters away from their initialisation (a logit at 0, biases near it): every one matters."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            if isinstance(module, (PositionalEncoding, Sink)) or ".encoding." in name or ".sink." in name:
                param.add_(0.5 * torch.randn_like(param)).abs_()


def _grads(backend: str, name: str, kind: str) -> list[torch.Tensor]:
    """Output and the gradients of q, k, v, every scheme parameter and every sink parameter, tokens' keys rotated."""
    torch.manual_seed(11)
    enc = make(name, head_dim=HEAD_DIM)
    _moved(enc)
    enc.constrain_()
    sink = Sink(kind, HEADS, HEAD_DIM, tokens=2)
    _moved(sink)
    pos = torch.arange(LENGTH)
    q, k, v = (torch.randn(2, HEADS, LENGTH, HEAD_DIM, requires_grad=True) for _ in range(3))
    features = enc.token_features(torch.randn(2, LENGTH, HEADS * HEAD_DIM)) if enc.reads_layer_input else None
    keys, values, rotated_pos = sink.in_front(k, v, pos)
    rotated_q, keys = enc.rotate(q, keys, pos, rotated_pos)
    columns, keys, values = sink.columns(keys, values, rotated_pos)
    with forced_cuda_path() if backend in FUSED else torch.enable_grad():
        out = get_backend(backend)(rotated_q, keys, values, enc, pos, pos, features=features, sink=columns)
    (out * torch.randn(out.shape)).sum().backward()
    trained = [p for p in [*enc.parameters(), *sink.parameters()] if p.requires_grad]
    return [out.detach(), q.grad, k.grad, v.grad, *(p.grad for p in trained)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", CASES)
def test_every_backend_matches_the_dense_reference_with_a_sink(flex_backward_on_cpu: None, name: str, kind: str):
    expected = _grads("eager", name, kind)
    assert len(expected) >= 4 + (kind != "zero") and all(g is not None for g in expected)
    backends = [b for b in ("sdpa", "auto", *FUSED, "triton") if _accepts(b, name)]
    assert "sdpa" in backends
    for backend in backends:
        got = _grads(backend, name, kind)
        assert len(got) == len(expected), backend
        for index, (value, reference) in enumerate(zip(got, expected, strict=True)):
            atol = 2e-5 * max(1.0, reference.abs().max().item())
            torch.testing.assert_close(
                value, reference, atol=atol, rtol=1e-4, msg=lambda m, b=backend, i=index: f"{b}, tensor {i}: {m}"
            )


def _decoder(name: str, kind: str, attention: str = "eager", **kwargs) -> Decoder:
    kwargs = {"vocab_size": 40, "dim": 4 * HEAD_DIM, "depth": 2, "heads": 4, **kwargs}
    return Decoder(name, attention=attention, sink=kind, sink_tokens=2 if kind == "tokens" else 1, **kwargs)


@pytest.mark.parametrize("kind", KINDS)
def test_a_decoder_trains_its_sink_through_every_backend(flex_backward_on_cpu: None, kind: str) -> None:
    torch.manual_seed(2)
    reference = _decoder("rope+alibi", kind)
    _moved(reference)
    tokens = torch.randint(0, 40, (2, LENGTH))
    weights = torch.randn(2, LENGTH, 40)
    results = {}
    for backend in ("eager", "sdpa", *FUSED, "triton"):
        model = _decoder("rope+alibi", kind, attention=backend)
        model.load_state_dict(reference.state_dict())
        with forced_cuda_path() if backend in FUSED else torch.enable_grad():
            logits = model(tokens)
        (logits * weights).sum().backward()
        results[backend] = (logits.detach(), {key: p.grad for key, p in model.named_parameters()})
    expected, expected_grads = results.pop("eager")
    sink_grads = [grad for key, grad in expected_grads.items() if ".sink." in key]
    assert len(sink_grads) == {"zero": 0, "learned": 2, "tokens": 4}[kind]  # per layer: a logit, or keys and values
    assert all(grad.abs().sum() > 0 for grad in sink_grads)
    for backend, (logits, grads) in results.items():
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-4, msg=backend)
        for key, grad in expected_grads.items():
            torch.testing.assert_close(grads[key], grad, atol=1e-5, rtol=1e-4, msg=f"{backend}, {key}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", SOFTMAX_SCHEMES)
def test_cached_decoding_with_a_sink_matches_the_full_forward(name: str, kind: str) -> None:
    torch.manual_seed(3)
    encoding = {"name": "learned", "max_positions": 64} if name == "learned" else name
    model = _decoder(encoding, kind, attention="auto", dim=32).eval()
    _moved(model)
    tokens = torch.randint(0, 40, (2, 30))
    cache = KVCache(len(model.blocks))
    with torch.no_grad():
        full = model(tokens)
        cached = torch.cat([model(tokens[:, :9], cache=cache), *(model(tokens[:, i : i + 1], cache=cache) for i in
                            range(9, 30))], dim=1)  # fmt: skip
    torch.testing.assert_close(cached, full, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["alibi", "rope", "kerple_log", "nope"])
def test_sink_tokens_move_with_the_window(name: str) -> None:
    # At the window's first position, the tokens keep a relative scheme invariant to a shift of all positions.
    torch.manual_seed(4)
    model = _decoder(name, "tokens").eval()
    _moved(model)
    tokens = torch.randint(0, 40, (1, LENGTH))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, offset=300), model(tokens), atol=2e-5, rtol=1e-4)


def test_a_zero_sink_is_softmax_plus_one() -> None:
    q, k, v = (torch.randn(1, HEADS, 5, HEAD_DIM) for _ in range(3))
    pos = torch.arange(5)
    sink = Sink("zero", HEADS, HEAD_DIM)
    columns, _, _ = sink.columns(k, v, pos)
    got = get_backend("eager")(q, k, v, make("nope"), pos, pos, sink=columns)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)).masked_fill(~torch.ones(5, 5).tril().bool(), -math.inf)
    expected = scores.exp() @ v / (1 + scores.exp().sum(-1, keepdim=True))  # Miller's softmax-1: a zero logit
    torch.testing.assert_close(got, expected)
    assert list(sink.parameters()) == [] and "logit" not in sink.state_dict()  # a constant, in no checkpoint


def test_a_learned_sink_starts_at_zero_and_tokens_differ() -> None:
    assert torch.equal(Sink("learned", HEADS, HEAD_DIM).logit, torch.zeros(HEADS))
    tokens = Sink("tokens", HEADS, HEAD_DIM, tokens=3)
    assert tokens.keys.shape == tokens.values.shape == (HEADS, 3, HEAD_DIM)
    assert not torch.equal(tokens.keys[:, 0], tokens.keys[:, 1])  # identical tokens would train identically


def test_a_sink_token_is_biased_from_the_windows_first_position() -> None:
    enc = make("alibi")
    sink = Sink("tokens", HEADS, HEAD_DIM)
    k, v, pos = torch.zeros(1, HEADS, 6, HEAD_DIM), torch.zeros(1, HEADS, 6, HEAD_DIM), torch.arange(10, 16)
    columns, _, _ = sink.columns(*sink.in_front(k, v, pos))
    q = torch.randn(1, HEADS, 6, HEAD_DIM)
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / HEADS) for h in range(HEADS)])  # ALiBi's, for 4 heads
    expected = q @ sink.keys[None].transpose(-1, -2) / math.sqrt(HEAD_DIM) - slopes[:, None, None] * (pos - 10)[:, None]
    torch.testing.assert_close(columns.scores(q, enc, pos), expected)


@pytest.mark.parametrize("name", SUPPLIED_SCHEMES)
def test_a_scheme_that_supplies_its_attention_refuses_a_sink_with_its_reason(name: str) -> None:
    with pytest.raises(ValueError, match=r"^model.sink=learned adds a column .* use model.sink=none") as refusal:
        _decoder(name, "learned")
    assert "\n" not in str(refusal.value)
    if make(name).own_sink:
        assert make(name).own_sink in str(refusal.value)


@pytest.mark.parametrize("backend", ["scheme", "triton"])
def test_a_backend_running_a_schemes_own_attention_refuses_a_sink(backend: str) -> None:
    # What the model refuses before it is built, the backends refuse too when called with one.
    names = [name for name in SUPPLIED_SCHEMES if backend == "scheme" or make(name).stick_form() is not None]
    assert names
    pos = torch.arange(4)
    columns, _, _ = Sink("learned", HEADS, HEAD_DIM).columns(*(torch.zeros(1, HEADS, 4, HEAD_DIM),) * 2, pos)
    for name in names:
        q = torch.zeros(1, HEADS, 4, HEAD_DIM)
        with pytest.raises(ValueError, match="no softmax row for a sink"):
            get_backend(backend)(q, q, q, make(name, head_dim=HEAD_DIM), pos, pos, sink=columns)


def test_sink_tokens_count_only_with_tokens() -> None:
    with pytest.raises(ValueError, match=r"model\.sink_tokens=3 counts sink tokens"):
        Decoder("alibi", vocab_size=40, dim=32, heads=4, sink="learned", sink_tokens=3)


@pytest.mark.parametrize("kind", KINDS)
def test_the_statistics_see_the_sink(kind: str) -> None:
    torch.manual_seed(5)
    model = _decoder("alibi", kind)
    windows = torch.randint(0, 40, (2, 12))
    rows = attention_statistics(model, windows)
    maps = [model.attention_maps(windows, layer) for layer in range(2)]
    for row in rows:  # the keys' maps leave to the sink exactly what the statistics say it took
        keys = maps[row["layer"]][:, row["head"], 1:].sum(-1).mean().item()
        assert row["explicit"] == pytest.approx(1 - keys, abs=1e-5)
        assert row["explicit"] > 0.01
    plain = attention_statistics(_decoder("alibi", "none"), windows)
    assert all(row["explicit"] == 0 for row in plain)


def test_auto_sends_an_unbiased_scheme_with_a_sink_to_flex_on_cuda() -> None:
    assert choose(make("rope"), is_cuda=True, sink=True) == "flex"
    assert choose(make("rope"), is_cuda=True) == "sdpa"
    assert choose(make("rope"), is_cuda=False, sink=True) == "sdpa"
    assert choose(make("alibi"), is_cuda=True, sink=True) == choose(make("alibi"), is_cuda=True)


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_with_a_sink_stays_close_to_the_fp32_reference(kind: str) -> None:
    torch.manual_seed(6)
    sink = Sink(kind, HEADS, HEAD_DIM)
    _moved(sink)
    q, k, v = (torch.randn(2, HEADS, LENGTH, HEAD_DIM) for _ in range(3))
    pos = torch.arange(LENGTH)
    columns, keys, values = sink.columns(*sink.in_front(k, v, pos))
    expected = get_backend("eager")(q, keys, values, make("alibi"), pos, pos, sink=columns)
    low = [t.bfloat16() for t in (q, keys, values)]
    with torch.no_grad():
        got = get_backend("sdpa")(*low, make("alibi"), pos, pos, sink=columns)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("kind", KINDS)
def test_flex_evaluates_with_a_sink_on_cpu(kind: str) -> None:
    # Without gradients FlexAttention runs its forward on CPU (an evaluation with attention=flex): the same merge.
    torch.manual_seed(8)
    sink = Sink(kind, HEADS, HEAD_DIM)
    _moved(sink)
    q, k, v = (torch.randn(2, HEADS, LENGTH, HEAD_DIM) for _ in range(3))
    pos = torch.arange(LENGTH)
    columns, keys, values = sink.columns(*sink.in_front(k, v, pos))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=flex.FALLBACK_WARNING)
        got = get_backend("flex")(q, keys, values, make("alibi"), pos, pos, sink=columns)
        expected = get_backend("eager")(q, keys, values, make("alibi"), pos, pos, sink=columns)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
