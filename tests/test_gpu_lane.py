"""What a GPU would hit, seen on CPU: compiled blocks traced with the CUDA branches taken.

Two checks need no GPU (the Triton table kernels, compiled for each GPU, are the kernel lane's:
``tests/test_inductor_lane.py``):
- with the CUDA-only branches taken (``forced_cuda_path``), each compiled block is one graph with no break, and
  under ``torch.compile(backend="aot_eager")`` its values and gradients equal the dense reference;
- attention statistics over compiled blocks on the compiled FlexAttention path do not raise.

Marked ``lane``: ``pytest -m lane`` runs just these, e.g. in an environment with the GPU machine's torch and triton
(see the README's "GPU check").
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.attention.flex_attention as flex_module
from conftest import SCHEMES, make

import posenc.attention.flex as flex
from posenc.attention.auto import choose
from posenc.encodings.forms import DerivativeForm, TableForm
from posenc.evaluate.attention_stats import attention_statistics
from posenc.model import Decoder
from posenc.training.compiling import compile_blocks

pytestmark = pytest.mark.lane

VOCAB, DIM, HEADS, LENGTH = 50, 64, 2, 40


# ---- compiled blocks with the CUDA branches taken ---------------------------------------------------------------


@pytest.mark.parametrize("name", SCHEMES)
def test_compiled_block_is_one_graph_on_the_cuda_path(cuda_branches: None, name: str) -> None:
    block = Decoder(name, vocab_size=VOCAB, dim=DIM, depth=1, heads=HEADS).blocks[0]
    x = torch.randn(2, LENGTH, DIM, requires_grad=True)
    explained = torch._dynamo.explain(block)(x, torch.arange(LENGTH))
    reasons = "; ".join(str(reason.reason).splitlines()[0] for reason in explained.break_reasons)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), reasons


def _declares(form_type: type) -> list[str]:
    return [
        name
        for name in SCHEMES
        if any(isinstance(form, form_type) for form in make(name).bias_gradient_forms() or [])
        and choose(make(name), is_cuda=True) == "flex_learnable"
    ]


KINDS = {
    "fixed bias (flex)": next(n for n in SCHEMES if not make(n).learnable_bias and choose(make(n), True) == "flex"),
    "derivative forms (flex_learnable)": _declares(DerivativeForm)[0],
    "table (flex_learnable)": _declares(TableForm)[0],
}


def _reference_and_compiled(name: str) -> tuple[Decoder, Decoder]:
    """The dense reference and the same weights through ``auto`` with blocks compiled by ``aot_eager``."""
    reference = Decoder(name, vocab_size=VOCAB, dim=DIM, depth=2, heads=HEADS, attention="eager")
    model = Decoder(name, vocab_size=VOCAB, dim=DIM, depth=2, heads=HEADS, attention="auto")
    model.load_state_dict(reference.state_dict())
    compile_blocks(model, backend="aot_eager")
    return reference, model


@pytest.mark.parametrize("kind", list(KINDS))
def test_aot_eager_blocks_match_the_dense_reference(cuda_branches: None, kind: str) -> None:
    name = KINDS[kind]
    torch.manual_seed(3)
    reference, model = _reference_and_compiled(name)
    tokens = torch.randint(0, VOCAB, (2, LENGTH))
    weights = torch.randn(2, LENGTH, VOCAB)
    outputs = []
    for decoder in (reference, model):
        logits = decoder(tokens)
        (logits * weights).sum().backward()
        outputs.append((logits.detach(), {key: p.grad for key, p in decoder.named_parameters()}))
    (expected, expected_grads), (got, got_grads) = outputs
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    assert got_grads.keys() == expected_grads.keys()
    for key, grad in expected_grads.items():
        assert (grad is None) == (got_grads[key] is None), key
        if grad is not None:
            torch.testing.assert_close(got_grads[key], grad, atol=1e-5, rtol=1e-4, msg=key)


@pytest.mark.parametrize("name", ["rope", "kerple_log"])
def test_a_local_layer_compiles_to_one_graph_and_matches_the_dense_reference(cuda_branches: None, name: str) -> None:
    # A local layer on the CUDA path: flex with the window's block mask, traced into the block's graph, against eager.
    spec = {"name": [f"local-{name}", name], "window": 7}
    block = Decoder(spec, vocab_size=VOCAB, dim=DIM, depth=2, heads=HEADS).blocks[0]
    assert block.attn.window == 7
    explained = torch._dynamo.explain(block)(torch.randn(2, LENGTH, DIM, requires_grad=True), torch.arange(LENGTH))
    reasons = "; ".join(str(reason.reason).splitlines()[0] for reason in explained.break_reasons)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), reasons
    torch.manual_seed(4)
    reference = Decoder(spec, vocab_size=VOCAB, dim=DIM, depth=2, heads=HEADS, attention="eager")
    model = Decoder(spec, vocab_size=VOCAB, dim=DIM, depth=2, heads=HEADS, attention="auto")
    model.load_state_dict(reference.state_dict())
    compile_blocks(model, backend="aot_eager")
    tokens, weights = torch.randint(0, VOCAB, (2, LENGTH)), torch.randn(2, LENGTH, VOCAB)
    results = []
    for decoder in (reference, model):
        logits = decoder(tokens)
        (logits * weights).sum().backward()
        results.append((logits.detach(), {key: p.grad for key, p in decoder.named_parameters()}))
    (expected, expected_grads), (got, got_grads) = results
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    for key, grad in expected_grads.items():
        torch.testing.assert_close(got_grads[key], grad, atol=1e-5, rtol=1e-4, msg=key)


@pytest.mark.parametrize("kind", list(KINDS))
def test_attention_statistics_over_compiled_flex_blocks(
    cuda_branches: None, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    # Outside a compiled block the CUDA path calls the process-wide compiled FlexAttention; here it is compiled
    # without inductor (its values come from FlexAttention's dense implementation), which traces the same way.
    monkeypatch.setattr(
        flex, "compiled_flex_attention", lambda: torch.compile(flex_module.flex_attention, backend="aot_eager")
    )
    name = KINDS[kind]
    reference, model = _reference_and_compiled(name)
    windows = torch.randint(0, VOCAB, (3, LENGTH))
    expected = attention_statistics(reference, windows)
    got = attention_statistics(model, windows)
    assert [row.keys() for row in got] == [row.keys() for row in expected]
    for row, reference_row in zip(got, expected, strict=True):
        for key, value in reference_row.items():
            assert row[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
