"""The fast paths equal the dense reference: flex_learnable's values and gradients (q, k, v and bias parameters),
the declarations it relies on (bias_gradient_forms, score_mod(detached=True)), auto's choice, the fused rotation,
and the compile setting (compiled training itself: test_compiling.py)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from conftest import BIAS_SCHEMES, HEAD_DIM, HEADS, SCHEMES, SUPPLIED_SCHEMES, layer_features, make
from torch.nn.attention.flex_attention import create_block_mask

import posenc.attention.bias_grad as bias_grad
from posenc.attention import get_backend
from posenc.attention.auto import choose
from posenc.attention.bias_grad import diagonal_sums, row_deltas
from posenc.attention.flex import _causal, build_causal_block_mask
from posenc.attention.flex_learnable import supports
from posenc.encodings import scheme_class, stack_members
from posenc.encodings.forms import DerivativeForm, TableForm
from posenc.encodings.kerple import KerpleLog
from posenc.model import Decoder
from posenc.training.compiling import compile_blocks, should_compile


def _learnable_schemes_and_stacks() -> list[str]:
    """Every registered scheme with a learnable bias, all of them stacked, and stacks with a fixed bias and a rotation.

    Derived from the registry and the contract, so a new learnable scheme is tested without an edit to this file.
    """
    learnable = [name for name in SCHEMES if make(name).learnable_bias]
    fixed = [name for name in BIAS_SCHEMES if name not in learnable and "+" not in name]
    rotary = [name for name in SCHEMES if make(name).rotates and not make(name).adds_bias]
    cases = list(learnable)
    readers = [name for name in learnable if make(name).reads_layer_input]
    together = [name for name in learnable if name not in readers[1:]]  # a stack reads the layer input once at most
    if len(together) > 1:
        cases.append("+".join(together))
    # Every scheme with gradient forms together: the stack flex_learnable takes (with content biases in it, the stack
    # above goes to sdpa), so derivative and table forms are differentiated side by side.
    with_forms = [name for name in together if supports(make(name))]
    if len(with_forms) > 1:
        cases.append("+".join(with_forms))
    cases += [f"{other}+{learnable[0]}" for other in fixed[:1]] + [f"{other}+{learnable[-1]}" for other in rotary[:1]]
    return cases


LEARNABLE = _learnable_schemes_and_stacks()


def _length_past_horizons(name: str) -> int:
    """A window longer than every table horizon the scheme declares, so the last table entry gets a gradient."""
    forms = make(name).bias_gradient_forms() or []
    return max([37] + [form.horizon + 37 for form in forms if isinstance(form, TableForm)])


def _auto_choices(name: str) -> list[str]:
    """Every backend ``auto`` may pick for this scheme (on CUDA and on CPU) that can differentiate on CPU.

    The eager reference is excluded, and so is ``flex``: torch has no CPU backward for FlexAttention. The learnable
    schemes ``auto`` sends to ``flex`` on CUDA (those declaring no gradient forms) are compared with eager there, in
    ``tests/test_gpu.py::test_auto_on_cuda_matches_eager`` (every scheme of the registry).
    """
    return sorted({choose(make(name), is_cuda=cuda) for cuda in (True, False)} - {"eager", "flex"})


def _grads(backend: str, name: str, length: int, first_pos: int = 0, **cfg) -> list[torch.Tensor]:
    """Output and gradients of q, k, v and every parameter under a non-uniform output gradient."""
    torch.manual_seed(7)
    enc = make(name, **cfg)
    pos = torch.arange(first_pos, first_pos + length)
    q, k, v = (torch.randn(2, HEADS, length, HEAD_DIM, requires_grad=True) for _ in range(3))
    features = layer_features(enc, 2, length, requires_grad=True)  # for a scheme that reads the layer's input
    rotated_q, rotated_k = enc.rotate(q, k, pos, pos)
    out = get_backend(backend)(rotated_q, rotated_k, v, enc, pos, pos, features=features)
    weights = torch.randn(out.shape)
    (out * weights).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad, *(p.grad for p in enc.parameters() if p.requires_grad)]


def test_learnable_cases_come_from_the_registry() -> None:
    assert LEARNABLE and all(make(name).learnable_bias for name in LEARNABLE)
    assert any("+" in name for name in LEARNABLE)  # stacks of them too
    assert any("+" in name and choose(make(name), is_cuda=True) == "flex_learnable" for name in LEARNABLE)


@pytest.mark.parametrize("name", LEARNABLE)
def test_every_backend_auto_may_choose_matches_eager_values_and_gradients(name: str) -> None:
    length = _length_past_horizons(name)
    expected = _grads("eager", name, length)
    assert len(expected) > 4  # the bias parameters are there and receive gradients
    for backend in _auto_choices(name):
        got = _grads(backend, name, length)
        assert len(got) == len(expected), backend
        for index, (value, reference) in enumerate(zip(got, expected, strict=True)):
            assert value is not None, (backend, index)
            # fp32 rounding scales with the tensor: a table entry that is minus the sum of the others (Identity 2)
            # carries the others' rounding, which next to a gradient of 16 is 1e-5 where the entry itself is ~0.
            atol = 1e-5 * max(1.0, reference.abs().max().item())
            torch.testing.assert_close(
                value, reference, atol=atol, rtol=1e-4, msg=lambda m, b=backend, i=index: f"{b}, tensor {i}: {m}"
            )


SUPPLIED = [*SUPPLIED_SCHEMES, *(f"rope+{name}" for name in SUPPLIED_SCHEMES)]


def _chunks_of_8(name: str) -> dict[str, Any]:
    """Options giving every member that takes a ``chunk`` size chunks of 8 keys (a stack's under the member's name)."""
    members = stack_members(name)
    chunked = [m for m in members if "chunk" in inspect.signature(scheme_class(m)).parameters]
    if len(members) == 1:
        return {"chunk": 8} if chunked else {}
    return {member: {"chunk": 8} for member in chunked}


@pytest.mark.parametrize("length", [5, 16, 37])  # under one chunk of 8, two whole chunks, and 4 chunks and a part
@pytest.mark.parametrize("name", SUPPLIED)
def test_a_supplied_attention_matches_its_dense_reference_values_and_gradients(name: str, length: int) -> None:
    options = _chunks_of_8(name)  # so that these lengths cross chunk boundaries
    expected = _grads("eager", name, length, **options)
    got = _grads(choose(make(name), is_cuda=False), name, length, **options)
    assert len(got) == len(expected) >= 4
    assert all(grad.abs().sum() > 0 for grad in expected[4:])  # the scheme's parameters, if any, receive gradients
    for index, (value, reference) in enumerate(zip(got, expected, strict=True)):
        assert value is not None, index
        torch.testing.assert_close(value, reference, atol=1e-5, rtol=1e-4, msg=lambda m, i=index: f"tensor {i}: {m}")


def test_t5_last_bucket_gradient_comes_from_the_row_sums() -> None:
    # Identity 2: the last bucket's gradient is minus the others' sum; it must be non-zero here and exact.
    got, expected = _grads("flex_learnable", "t5", 300)[-1], _grads("eager", "t5", 300)[-1]
    assert expected[:, -1].abs().min() > 1e-4
    torch.testing.assert_close(got[:, -1], expected[:, -1], atol=1e-5, rtol=1e-4)


def test_flex_learnable_respects_the_window_offset() -> None:
    for got, expected in zip(
        _grads("flex_learnable", "alibi+kerple_log+t5", 130, first_pos=900),
        _grads("eager", "alibi+kerple_log+t5", 130, first_pos=900),
        strict=True,
    ):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_band_in_many_chunks_and_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    # Small chunks and a small budget: windows straddle the horizon and the band runs in several groups.
    monkeypatch.setattr(bias_grad, "BAND_CHUNK", 8)
    monkeypatch.setattr(bias_grad, "BAND_MAX_ELEMENTS", 2 * HEADS * 8 * (8 + 14 - 1) * 3)
    cfg = {"num_buckets": 8, "max_distance": 20}  # horizon 14
    for got, expected in zip(_grads("flex_learnable", "t5", 61, **cfg), _grads("eager", "t5", 61, **cfg), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_diagonal_sums_equal_the_dense_diagonals() -> None:
    length, width = 45, 20
    enc = make("alibi+t5")
    pos = torch.arange(length)
    q, k, v, dout = (torch.randn(2, HEADS, length, HEAD_DIM, dtype=torch.float64) for _ in range(4))
    scores = q @ k.transpose(-1, -2) / HEAD_DIM**0.5 + enc.bias(pos, pos).double()
    scores = scores.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    probs = scores.softmax(-1)
    out = probs @ v
    dscores = probs * (dout @ v.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True))  # fp64 throughout
    expected = torch.stack([dscores.diagonal(-d, -2, -1).sum(dim=(0, 2)) for d in range(width)], dim=-1)
    got = diagonal_sums(q, k, v, scores.logsumexp(-1), dout, row_deltas(out, dout), enc.distance_bias(width))
    torch.testing.assert_close(got, expected.float(), atol=1e-5, rtol=1e-4)
    # Identity 2's premise: every row of dS sums to zero.
    torch.testing.assert_close(dscores.sum(-1), torch.zeros_like(dscores.sum(-1)), atol=1e-12, rtol=0)


@pytest.mark.parametrize("length", [1, 37, 128, 129, 300])
def test_causal_block_mask_is_create_block_masks(length: int) -> None:
    expected = create_block_mask(_causal, None, None, length, length, device="cpu")
    got = build_causal_block_mask(length, "cpu")
    assert got.seq_lengths == expected.seq_lengths
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name
    assert torch.equal(got.to_dense(), expected.to_dense())


DERIVATIVE_SCHEMES = [
    name for name in SCHEMES if any(isinstance(form, DerivativeForm) for form in make(name).bias_gradient_forms() or [])
]


@pytest.mark.parametrize("name", DERIVATIVE_SCHEMES)
def test_derivative_forms_are_the_bias_derivatives(name: str) -> None:
    enc = make(name)
    pos = torch.arange(30)
    q_idx, k_idx = torch.tril_indices(30, 30)
    forms = enc.bias_gradient_forms()
    assert all(isinstance(form, DerivativeForm) for form in forms)
    weights = torch.rand(q_idx.shape)  # random weights per (i, j): a wrong f cannot cancel out
    for form in forms:
        # Σ_ij w_ij ∂b[h, i, j]/∂θ[h]; a parameter moves only its own head, so one gradient covers every head.
        (derivative,) = torch.autograd.grad((enc.bias(pos, pos)[:, q_idx, k_idx] * weights).sum(), form.parameter)
        for h in range(HEADS):
            log_f = form.log_factor(torch.zeros(q_idx.shape), torch.tensor(0), torch.tensor(h), q_idx, k_idx)
            assert not log_f.isnan().any()  # f ≥ 0 everywhere (log f = -inf where it vanishes)
            declared = (weights * form.scale[h] * log_f.exp()).sum()
            torch.testing.assert_close(declared, derivative[h], atol=1e-4, rtol=1e-5)


def test_t5_table_form_reproduces_its_bias_past_the_horizon() -> None:
    enc = make("t5")
    (form,) = enc.bias_gradient_forms()
    assert isinstance(form, TableForm) and form.horizon == 113
    assert form.index[form.horizon - 1] != form.index[form.horizon]  # the horizon is the last bucket's start
    distances = torch.arange(400)
    via_form = form.table[:, form.index[distances.clamp(max=form.horizon)]]
    torch.testing.assert_close(via_form, enc.distance_bias(400))


@pytest.mark.parametrize("name", BIAS_SCHEMES)
def test_detached_score_mod_has_the_same_values_and_no_gradient(name: str) -> None:
    enc = make(name)
    q_idx, k_idx = torch.tril_indices(40, 40)
    args = (torch.zeros(q_idx.shape), torch.tensor(0), torch.tensor(1), q_idx, k_idx)
    live, detached = enc.score_mod()(*args), enc.score_mod(detached=True)(*args)
    torch.testing.assert_close(detached, live)
    assert not detached.requires_grad
    assert live.requires_grad == enc.learnable_bias


def test_stack_forms_are_its_members_forms() -> None:
    stack = make("alibi+kerple_log+t5")
    kinds = [type(form) for form in stack.bias_gradient_forms()]
    assert kinds == [DerivativeForm, DerivativeForm, TableForm]
    assert make("rope+alibi").bias_gradient_forms() == []


class _Undeclared(KerpleLog):
    """A learnable bias that declares no gradient form: only the slow generic path can train it."""

    def bias_gradient_forms(self) -> None:
        return None


def test_auto_picks_by_declaration() -> None:
    assert choose(make("kerple_log"), is_cuda=True) == "flex_learnable"
    assert choose(make("alibi+kerple_log+t5"), is_cuda=True) == "flex_learnable"
    assert choose(make("kerple_log", learnable=False), is_cuda=True) == "flex"  # a frozen bias is a fixed bias
    assert choose(make("rope+alibi"), is_cuda=True) == "flex"
    assert choose(make("xpos"), is_cuda=True) == "sdpa"
    assert choose(make("t5"), is_cuda=False) == "sdpa"
    undeclared = _Undeclared(HEADS, HEAD_DIM)
    assert choose(undeclared, is_cuda=True) == "flex"
    pos = torch.arange(8)
    q = torch.randn(1, HEADS, 8, HEAD_DIM)
    with pytest.raises(ValueError, match="declares bias_gradient_forms"):
        get_backend("flex_learnable")(q, q, q, undeclared, pos, pos)


@pytest.mark.parametrize("name", SCHEMES)
def test_flex_learnable_forward_matches_eager_for_every_scheme(name: str) -> None:
    enc = make(name)
    pos = torch.arange(29)
    q, k, v = (torch.randn(2, HEADS, 29, HEAD_DIM, requires_grad=True) for _ in range(3))
    # A score_mod cannot read q and k, nor replace the attention: both flex backends refuse, never drop it.
    if enc.adds_content_bias or enc.supplies_attention:
        for backend in ("flex", "flex_learnable"):
            with pytest.raises(ValueError, match=r"content-dependent bias|supplies its own attention"):
                get_backend(backend)(q, k, v, enc, pos, pos, features=layer_features(enc, 2, 29))
        return
    with torch.no_grad():  # inputs that require grad, as in evaluation of a training model
        got = get_backend("flex_learnable")(q, k, v, enc, pos, pos)
        flex = get_backend("flex")(q, k, v, enc, pos, pos)
        expected = get_backend("eager")(q, k, v, enc, pos, pos)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(flex, expected, atol=2e-5, rtol=1e-4)


def test_frozen_kerple_trains_through_flex_learnable_as_a_constant() -> None:
    got = _grads("flex_learnable", "kerple_log", 33, learnable=False)
    expected = _grads("eager", "kerple_log", 33, learnable=False)
    assert len(got) == 4
    for value, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(value, reference, atol=1e-5, rtol=1e-4)


def test_model_trains_the_same_through_flex_learnable() -> None:
    kwargs = {"vocab_size": 50, "dim": 32, "depth": 2, "heads": 4}
    torch.manual_seed(0)
    reference = Decoder(["rope+kerple_log", "t5"], attention="eager", **kwargs)
    model = Decoder(["rope+kerple_log", "t5"], attention="flex_learnable", **kwargs)
    model.load_state_dict(reference.state_dict())
    tokens = torch.randint(0, 50, (2, 41))
    losses = [m.loss(tokens[:, :-1], tokens[:, 1:]) for m in (model, reference)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=1e-5)
    for (name, got), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_rotation_is_not_compiled_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.compile called for a CPU rotation")

    monkeypatch.setattr(torch, "compile", refuse)
    pos = torch.arange(10)
    for name in ("rope", "xpos"):
        q = torch.randn(1, HEADS, 10, HEAD_DIM)
        rotated, _ = make(name).rotate(q, q, pos, pos)
        assert rotated.shape == q.shape and not torch.equal(rotated, q)


def test_compile_setting() -> None:
    assert should_compile(True, "cpu") and not should_compile(False, "gpu")
    assert should_compile("true", "cpu") and not should_compile("false", "gpu")
    assert should_compile("auto", "auto") == torch.cuda.is_available()
    assert not should_compile("auto", "cpu")
    with pytest.raises(ValueError, match="compile must be auto, true or false"):
        should_compile("yes", "gpu")


@pytest.mark.slow
def test_flex_learnable_survives_compiled_autograd() -> None:
    # aot_eager traces forward and backward the way inductor does (without generating code): the identity-valued
    # autograd node and its backward must trace without graph breaks and give the eager reference's gradients.
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    kwargs = {"vocab_size": 50, "dim": 32, "depth": 1, "heads": 4}
    reference = Decoder("alibi+kerple_log+t5", attention="eager", **kwargs)
    model = Decoder("alibi+kerple_log+t5", attention="flex_learnable", **kwargs)
    model.load_state_dict(reference.state_dict())
    compile_blocks(model, backend="aot_eager")
    tokens = torch.randint(0, 50, (2, 130))
    for m in (model, reference):
        m.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    assert not torch._dynamo.utils.counters["graph_break"]
    for got, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad, atol=1e-5, rtol=1e-4)
