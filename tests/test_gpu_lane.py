"""What an H100 would hit, seen on CPU: kernels compiled for sm_90, compiled blocks traced with the CUDA branches taken.

Three checks need no GPU:
- every Triton kernel compiles ahead of time for an H100 (``GPUTarget("cuda", 90, 32)``; Triton's own ptxas ships in
  its wheel) with the launch configuration the backend uses, and fits the H100's shared memory; Triton's interpreter,
  which the value tests use on CPU, runs kernels as Python and would hide a kernel that does not compile;
- with the CUDA-only branches taken (``forced_cuda_path``), each compiled block is one graph with no break, and
  under ``torch.compile(backend="aot_eager")`` its values and gradients equal the dense reference;
- attention statistics over compiled blocks on the compiled FlexAttention path do not raise.

Marked ``lane``: ``pytest -m lane`` runs just these, e.g. in an environment with the GPU machine's torch and triton
(see the README's "GPU check").
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest
import torch
import torch._dynamo
import torch.nn.attention.flex_attention as flex_module
from conftest import SCHEMES, make

import posenc.attention.flex as flex
import posenc.attention.triton_table as triton_table
from posenc.attention import triton_aot
from posenc.attention.auto import choose
from posenc.encodings.base import DerivativeForm, TableForm
from posenc.evaluate.attention_stats import attention_statistics
from posenc.model import Decoder
from posenc.training.compiling import compile_blocks

pytestmark = pytest.mark.lane

VOCAB, DIM, HEADS, LENGTH = 50, 64, 2, 40


# ---- Triton kernels, compiled for sm_90 -------------------------------------------------------------------------


def test_triton_kernels_compile_for_h100_and_fit_its_shared_memory() -> None:
    pytest.importorskip("triton", reason="attention=triton needs the triton package (Linux)")
    # A subprocess: Triton chooses interpreter or compiler at import time, and this session imported it interpreted.
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "posenc.attention.triton_aot", "--json"],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": os.pathsep.join(sys.path)},
        timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(result.stdout.splitlines()[-1])
    compiled = {(row["kernel"], row["dtype"], row["block_d"]) for row in rows if "refused" not in row}
    refused = {(row["dtype"], row["block_d"]) for row in rows if "refused" in row}
    dtypes = {triton_aot.DTYPE_NAMES[dtype] for dtype in triton_table.DTYPES}
    for dtype, block_d in itertools.product(dtypes, triton_aot.block_dims()):
        kernels = {kernel for kernel, *shape in compiled if shape == [dtype, block_d]}
        assert kernels == {"forward", "backward_dq", "backward_dkdv"} or (dtype, block_d) in refused, (dtype, block_d)
    assert {"bf16", "fp32"} <= {dtype for _, dtype, _ in compiled}
    for row in rows:
        if "refused" not in row:
            assert row["shared"] <= triton_aot.H100_SHARED_MEMORY, row


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
