"""``attention=triton`` for stick-breaking (a scheme's ``stick_form``): its fused kernels equal the dense reference and
the blocked form, values and every gradient (q, k, v and each parameter), for every form a config or the registry
declares; the custom operators, one compiled graph, cached decoding beside it, auto's choice, and the refusals.

Without a GPU the kernels run on CPU under Triton's interpreter (conftest.py sets ``TRITON_INTERPRET=1``), in fp32 and
fp16 (the interpreter has no bf16 ``tl.dot``; the lane compiles bf16, tests/test_inductor_lane.py); with one, the same
tests run the compiled kernels. Tiles are shrunk to 16 so that lengths 16, 40 and 37 cover one block, several blocks
with a partial last one, and a length no tile divides.
"""

from __future__ import annotations

import pytest
import torch
from conftest import SCHEMES, make
from helpers import encoding_configs

import posenc.attention.auto as auto
import posenc.attention.triton_launch as triton_launch
import posenc.attention.triton_stick as triton_stick
from posenc.attention import get_backend
from posenc.decoding import KVCache
from posenc.encodings import build
from posenc.model import Decoder

pytest.importorskip("triton", reason="attention=triton needs the triton package (Linux); not installed here")
KERNELS = triton_launch.kernels("stick_forward")
DEVICE = "cpu" if KERNELS.INTERPRETED else "cuda"
HEADS, HEAD_DIM = 3, 16  # tl.dot needs a head dim of at least 16


# Every config whose scheme declares a stick form (the reference form and the trained one), and the registry's
# schemes that do, each also under a rotation: found by declaration, never by name.
ROTARY = next(n for n in SCHEMES if make(n).rotates and make(n).shift_invariant and not make(n).adds_bias)  # a rotation
STICK_NAMES = [name for name in SCHEMES if make(name).stick_form() is not None]
FORMS = encoding_configs(HEADS, HEAD_DIM, lambda enc: enc.stick_form() is not None)
FORMS += [{"name": f"{ROTARY}+{name}"} for name in STICK_NAMES]


def _ids(spec: dict) -> str:
    return "-".join(f"{value}" for value in spec.values())


def _scheme(spec: dict, head_dim: int = HEAD_DIM):
    options = {key: value for key, value in spec.items() if key != "name"}
    enc = build(spec["name"], num_heads=HEADS, head_dim=head_dim, **options).to(DEVICE)
    with torch.no_grad():  # the trained form starts its head vector at zero and its norm at identity: make them matter
        for parameter in enc.parameters():
            parameter.add_(torch.randn_like(parameter))
    return enc


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_launch, "BLOCK_M", 16)
    monkeypatch.setattr(triton_launch, "BLOCK_N", 16)


def _run(backend: str, spec: dict, length: int, dtype: torch.dtype = torch.float32, head_dim: int = HEAD_DIM,
         scale: float = 1.0) -> list[torch.Tensor]:  # fmt: skip
    """Output and the gradients of q, k, v and every parameter under a non-uniform output gradient."""
    torch.manual_seed(7)
    enc = _scheme(spec, head_dim)
    pos = torch.arange(length, device=DEVICE)
    q, k, v = (torch.randn(2, HEADS, length, head_dim).to(DEVICE, dtype) for _ in range(3))
    q, k = (t * scale for t in (q, k))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    rotated_q, rotated_k = enc.rotate(q, k, pos, pos)
    out = get_backend(backend)(rotated_q, rotated_k, v, enc, pos, pos)
    weights = torch.randn(out.shape).to(DEVICE)
    grads = torch.autograd.grad((out.float() * weights).sum(), [q, k, v, *enc.parameters()])
    return [out.detach(), *grads]


def _assert_matches(spec: dict, length: int, atol: float = 1e-5, rtol: float = 1e-4, **kwargs: object) -> None:
    got = _run("triton", spec, length, **kwargs)
    for reference_backend in ("eager", "scheme"):  # the dense reference, and the blocked form
        expected = _run(reference_backend, spec, length, **kwargs)
        assert len(got) == len(expected) >= 4
        for index, (value, reference) in enumerate(zip(got, expected, strict=True)):
            torch.testing.assert_close(
                value.float(), reference.float(), atol=atol, rtol=rtol, msg=lambda m, i=index: f"tensor {i}: {m}"
            )


def test_the_forms_come_from_the_configs_and_the_registry() -> None:
    labels = {build(s["name"], num_heads=HEADS, head_dim=HEAD_DIM, **{k: v for k, v in s.items() if k != "name"}).label
              for s in FORMS}  # fmt: skip
    assert {"stick_breaking", "stick_breaking_trained"} <= labels  # otherwise the tests below would test less
    assert not any(make(name).stick_form() for name in SCHEMES if not make(name).supplies_attention)


@pytest.mark.parametrize("length", [16, 40])
@pytest.mark.parametrize("spec", FORMS, ids=_ids)
def test_values_and_every_gradient_match_the_dense_reference_and_the_blocked_form(spec: dict, length: int) -> None:
    _assert_matches(spec, length)


@pytest.mark.parametrize("block_m, block_n", [(16, 32), (32, 16)])
def test_unequal_tiles_and_a_length_no_tile_divides(
    monkeypatch: pytest.MonkeyPatch, block_m: int, block_n: int
) -> None:
    # A query block's keys start inside a key block (taller tiles) or span several (wider), the stick carried across.
    monkeypatch.setattr(triton_launch, "BLOCK_M", block_m)
    monkeypatch.setattr(triton_launch, "BLOCK_N", block_n)
    _assert_matches(FORMS[-1], 37)


def test_head_dims_that_pad_or_fill_the_block_and_half_precision() -> None:
    _assert_matches(FORMS[0], 37, head_dim=24)  # padded to 32
    # 128 fills the largest block, in fp16 (fp32 is refused past 64); both sides read the same rounded inputs.
    _assert_matches(FORMS[0], 37, head_dim=128, dtype=torch.float16, atol=2e-2, rtol=2e-2)


def test_large_scores_stay_finite_and_close() -> None:
    # Scores in the tens: sticks taken whole (1 − β underflows), sums of log2 (1 − β) far below fp32's exponent range.
    got, expected = _run("triton", FORMS[0], 40, scale=3.0), _run("eager", FORMS[0], 40, scale=3.0)
    for value, reference in zip(got, expected, strict=True):
        assert torch.isfinite(value).all()
        torch.testing.assert_close(value, reference, atol=1e-4 * max(1.0, reference.abs().max().item()), rtol=1e-3)


def test_bf16_is_refused_under_the_interpreter_never_silently_wrong() -> None:
    if not KERNELS.INTERPRETED:
        pytest.skip("compiled kernels run bf16")
    with pytest.raises(ValueError, match="interpreter has no bf16"):
        _run("triton", FORMS[0], 16, dtype=torch.bfloat16)


def _model(spec: dict, attention: str) -> Decoder:
    torch.manual_seed(0)
    return Decoder(spec, vocab_size=50, dim=2 * HEAD_DIM, depth=2, heads=2, attention=attention).to(DEVICE)


@pytest.mark.parametrize("spec", FORMS[:2], ids=_ids)
def test_a_model_trains_the_same_and_decodes_from_its_cache(spec: dict) -> None:
    reference, model = _model(spec, "eager"), _model(spec, "triton")
    model.load_state_dict(reference.state_dict())
    tokens = torch.randint(0, 50, (2, 41)).to(DEVICE)
    losses = [m.loss(tokens[:, :-1], tokens[:, 1:]) for m in (model, reference)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=1e-5)
    for (name, got), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad, atol=1e-5, rtol=1e-4, msg=name)
    # Cached decoding takes the blocked form (the kernel is self-attention over one window): the same logits.
    cache = KVCache(len(model.blocks))
    with torch.no_grad():
        full = model(tokens)
        parts = [
            model(tokens[:, :9], cache=cache),
            *(model(tokens[:, i : i + 4], cache=cache) for i in range(9, 41, 4)),
        ]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=2e-5, rtol=1e-4)


def test_the_kernels_are_custom_ops_with_fake_and_autograd_implementations() -> None:
    q, k, v = (torch.randn(1, 2, 20, HEAD_DIM, device=DEVICE, requires_grad=True) for _ in range(3))
    head_bias = torch.randn(2, HEAD_DIM, device=DEVICE, requires_grad=True)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    for target in (head_bias, None):
        torch.library.opcheck(torch.ops.posenc.stick_attention.default, (q, k, v, target), test_utils=checks)
    out = triton_stick.stick_attention(q, k, v, None)
    args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach())
    torch.library.opcheck(torch.ops.posenc.stick_attention_backward.default, args, test_utils=checks[0::2])


def test_a_compiled_block_through_the_kernels_is_one_graph() -> None:
    torch._dynamo.reset()
    spec = FORMS[-1]
    reference, model = _model(spec, "eager"), _model(spec, "triton")
    model.load_state_dict(reference.state_dict())
    x = torch.randn(1, 24, 2 * HEAD_DIM, device=DEVICE)
    pos = torch.arange(24, device=DEVICE)
    compiled = torch.compile(model.blocks[0], backend="aot_eager", fullgraph=True)  # a graph break raises
    weights = torch.randn(1, 24, 2 * HEAD_DIM, device=DEVICE)
    (compiled(x, pos) * weights).sum().backward()
    (reference.blocks[0](x, pos) * weights).sum().backward()
    for (name, got), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        if expected.grad is not None:
            torch.testing.assert_close(got.grad, expected.grad, atol=1e-5, rtol=1e-4, msg=name)
    torch._dynamo.reset()


def test_auto_picks_the_kernel_only_where_a_measurement_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    names = [*SCHEMES, *(spec["name"] for spec in FORMS)]
    before = {name: auto.choose(make(name), is_cuda=True, capability=(9, 0)) for name in names}
    assert "triton" not in before.values()
    monkeypatch.setitem(auto.MEASURED_FASTER, (9, 0), frozenset({"stick"}))
    for name in names:
        enc = make(name)
        stick = enc.stick_form() is not None
        assert auto.choose(enc, is_cuda=True, capability=(9, 0)) == ("triton" if stick else before[name]), name
        assert auto.choose(enc, is_cuda=True, capability=(8, 0)) == before[name]
        assert auto.choose(enc, is_cuda=False, capability=(9, 0)) != "triton"
    # Deterministic algorithms: the kernel's atomics would vary, so auto keeps the blocked form.
    q = torch.randn(1, 2, 8, HEAD_DIM)
    torch.use_deterministic_algorithms(True)
    try:
        assert not auto.triton_fits(q, q, make(STICK_NAMES[0]))
    finally:
        torch.use_deterministic_algorithms(False)
    assert auto.triton_fits(q, q, make(STICK_NAMES[0]))


def test_refuses_in_one_line_what_it_cannot_honour() -> None:
    attend = get_backend("triton")
    pos = torch.arange(16, device=DEVICE)
    q, k, v = (torch.randn(1, HEADS, 16, HEAD_DIM, device=DEVICE, requires_grad=True) for _ in range(3))
    enc = _scheme(FORMS[0])
    with pytest.raises(ValueError, match="self-attention over one window"):
        attend(q[:, :, -1:], k, v, enc, pos[-1:], pos)
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(ValueError, match=r"atomics.*use attention=scheme") as refusal:
            attend(q, k, v, enc, pos, pos)
        with torch.no_grad():  # evaluation has no backward: nothing to refuse
            attend(q, k, v, enc, pos, pos)
    finally:
        torch.use_deterministic_algorithms(False)
    assert "\n" not in str(refusal.value)
    for name in SCHEMES:  # any other attention of a scheme's own: refused, never run as stick-breaking's
        other = make(name, heads=HEADS, head_dim=HEAD_DIM)
        if other.supplies_attention and other.stick_form() is None:
            with pytest.raises(ValueError, match=f"{name} supplies another attention; use attention=auto, scheme"):
                attend(q, k, v, other, pos, pos)
