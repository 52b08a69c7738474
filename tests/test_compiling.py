"""Compiled training on CPU: static block graphs for training and validation, uncompiled evaluation, no silent
fallback, and the FlexAttention kernel options a scheme's bias asks for.

What runs here is what CUDA runs minus code generation: ``CompileCounter``/``aot_eager`` trace the same graphs
(forward and backward) without inductor, so the shapes, guards and recompilations are the ones a GPU would see.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import HEAD_DIM, HEADS, make
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

import posenc.attention.flex as flex
import posenc.attention.tables as tables
from posenc.attention import get_backend
from posenc.attention.flex import FP32_KERNEL_OPTIONS, TABLE_KERNEL_OPTIONS, compiled_flex_attention, kernel_options
from posenc.attention.flex_learnable import _AttachBiasGradient
from posenc.encodings import available
from posenc.encodings.forms import TableForm
from posenc.model import Decoder
from posenc.training.compiling import compile_blocks, eager_blocks

KWARGS = {"vocab_size": 50, "dim": 32, "depth": 2, "heads": 4}


def _pair(encoding: object, attention: str) -> tuple[Decoder, Decoder]:
    torch.manual_seed(0)
    reference = Decoder(encoding, attention=attention, **KWARGS)
    model = Decoder(encoding, attention=attention, **KWARGS)
    model.load_state_dict(reference.state_dict())
    return model, reference


def _train_step(model: Decoder, tokens: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = model.loss(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss


def test_training_graphs_are_static_and_evaluation_compiles_nothing() -> None:
    torch._dynamo.reset()
    model, reference = _pair(["rope", "alibi"], "sdpa")
    keys = list(model.state_dict())
    counter = CompileCounter()
    compile_blocks(model, backend=counter)
    assert list(model.state_dict()) == keys  # checkpoints stay interchangeable
    train = torch.randint(0, 50, (4, 33))
    for m in (model, reference):
        _train_step(m, train)
    for got, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad, atol=1e-5, rtol=1e-4)
    with torch.no_grad():  # validation: a full batch and a last, smaller one
        for batch in (4, 3):
            model(train[:batch, :-1])
    compiled = counter.frame_count
    _train_step(model, train)
    with torch.no_grad():
        model(train[:3, :-1])
    assert counter.frame_count == compiled > 0  # every training and validation shape has its graph already
    with torch.no_grad(), eager_blocks(model):
        for length in (16, 64, 128, 130):
            tokens = torch.randint(0, 50, (2, length))
            torch.testing.assert_close(model(tokens), reference(tokens), atol=1e-5, rtol=1e-5)
    assert counter.frame_count == compiled  # evaluation compiled nothing
    with torch.no_grad():
        model(torch.randint(0, 50, (2, 17)))
    assert counter.frame_count > compiled  # static: a new shape outside eager_blocks is a new graph, not a symbolic one


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_aot_eager_traces_train_validation_and_evaluation_shapes(attention: str) -> None:
    # aot_eager runs aot_autograd (where the H100 crash came from) on the real Decoder: the training step, the
    # validation shapes, then the evaluation lengths uncompiled; losses and gradients equal the eager model's.
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, reference = _pair(["rope+alibi", "t5"], attention)
    counter = CompileCounterWithBackend("aot_eager")
    compile_blocks(model, backend=counter)
    train = torch.randint(0, 50, (2, 65))
    for _ in range(2):
        losses = [_train_step(m, train) for m in (model, reference)]
        torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=1e-5)
    for got, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad, atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        for batch in (2, 1):
            torch.testing.assert_close(model(train[:batch, :-1]), reference(train[:batch, :-1]), atol=1e-5, rtol=1e-5)
        compiled = counter.frame_count
        with eager_blocks(model):
            for length in (128, 256):
                tokens = torch.randint(0, 50, (1, length))
                torch.testing.assert_close(model(tokens), reference(tokens), atol=1e-5, rtol=1e-5)
    assert counter.frame_count == compiled
    assert not torch._dynamo.utils.counters["graph_break"]


def test_recompile_limit_raises_instead_of_running_eagerly() -> None:
    torch._dynamo.reset()
    model, _ = _pair("alibi", "sdpa")
    compile_blocks(model, backend="eager")
    with torch._dynamo.config.patch(recompile_limit=1), torch.no_grad():
        model(torch.randint(0, 50, (1, 8)))
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
            model(torch.randint(0, 50, (1, 9)))


def test_unfused_flex_attention_is_an_error_once_the_compiled_kernel_is_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    # The fallback this guards against is torch's own: flex_attention run outside a compiled graph warns once and
    # materialises the scores. After the compiled kernel is set up (the CUDA path) that warning raises.
    import torch.nn.attention.flex_attention as torch_flex

    monkeypatch.setattr(torch_flex, "_WARNINGS_SHOWN", set())
    q = torch.randn(1, HEADS, 16, HEAD_DIM)
    with warnings.catch_warnings(), torch._dynamo.config.patch(fail_on_recompile_limit_hit=False):
        compiled_flex_attention.cache_clear()
        compiled_flex_attention()
        assert torch._dynamo.config.fail_on_recompile_limit_hit
        with pytest.raises(UserWarning, match=flex.FALLBACK_WARNING):
            torch_flex.flex_attention(q, q, q)
    compiled_flex_attention.cache_clear()


def test_autograd_function_output_is_not_a_view() -> None:
    # aot_autograd replays an output that aliases an input as a view, regenerated at run time: the crash's path.
    enc = make("t5")
    q, k, v = (torch.randn(1, HEADS, 20, HEAD_DIM, requires_grad=True) for _ in range(3))
    pos = torch.arange(20)
    seen = []
    original = _AttachBiasGradient.forward

    def spy(ctx, out, lse, *args):  # both outputs (the attention's and its row lse) are copies of their inputs
        result = original(ctx, out, lse, *args)
        seen.append(
            all(r._base is None and r.data_ptr() != i.data_ptr() for r, i in zip(result, (out, lse), strict=True))
        )
        return result

    _AttachBiasGradient.forward = staticmethod(spy)
    try:
        get_backend("flex_learnable")(q, k, v, enc, pos, pos).sum().backward()
    finally:
        _AttachBiasGradient.forward = staticmethod(original)
    assert seen == [True] and enc.table.grad is not None


@pytest.mark.parametrize("name", [*available(), "alibi+kerple_log+t5", "rope+t5"])
def test_table_biases_get_tiles_for_the_main_flex_kernel(name: str) -> None:
    enc = make(name)
    declared = any(member.score_mod_reads_table for member in enc.members)
    if any(isinstance(f, TableForm) for m in enc.members for f in m.bias_gradient_forms() or []):
        assert declared  # a learned table is read through an index: the declaration must say so
    reads_table = declared or tables.reads_table(enc)  # a distance-only bias is read from its table by every backend
    options = kernel_options(enc, torch.zeros(1, dtype=torch.bfloat16))
    assert (options is not None) == reads_table
    assert kernel_options(enc, torch.zeros(1)) == FP32_KERNEL_OPTIONS  # fp32 tiles whatever the scheme
    if options is not None:
        blocks = [value for key, value in options.items() if "BLOCK" in key]
        assert all(128 % size == 0 for size in blocks)  # FlexAttention needs tiles dividing the mask's blocks
        # Below 128 queries torch would take its decoding kernel, which applies a fwd_BLOCK_M override after sizing
        # its boundary masks: the tiles must always go to the main Triton kernel.
        assert options["BACKEND"] == "TRITON"


def test_kernel_options_reach_flex_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = flex.flex_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("kernel_options"))
        return real(*args, **kwargs)

    monkeypatch.setattr(flex, "flex_attention", spy)
    pos = torch.arange(24)
    for name in ("alibi+t5", "t5"):
        enc = make(name)
        q, k, v = (torch.randn(1, HEADS, 24, HEAD_DIM, requires_grad=True) for _ in range(3))
        with torch.no_grad():
            get_backend("flex")(q, k, v, enc, pos, pos)
        get_backend("flex_learnable")(q, k, v, enc, pos, pos).sum().backward()  # CPU: lse and table via flex
    # fp32 queries on this machine: every call, forward and lse alike, carries the fp32 tiles
    assert len(calls) >= 4 and all(options == FP32_KERNEL_OPTIONS for options in calls)
    calls.clear()
    q16, k16, v16 = (t.detach().to(torch.bfloat16) for t in (q, k, v))
    # A distance-only bias is read from its table (table tiles); a bias computed per score keeps torch's defaults.
    per_score = next(n for n in available() if make(n).adds_bias and not make(n).adds_content_bias and not (
        tables.reads_table(make(n)) or any(m.score_mod_reads_table for m in make(n).members)))  # fmt: skip
    with torch.no_grad():
        get_backend("flex")(q16, k16, v16, make("t5"), pos, pos)
        get_backend("flex")(q16, k16, v16, make("alibi"), pos, pos)
        get_backend("flex")(q16, k16, v16, make(per_score), pos, pos)
    assert calls == [TABLE_KERNEL_OPTIONS, TABLE_KERNEL_OPTIONS, None]
