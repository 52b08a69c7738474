"""The ``triton`` backend equals ``eager``: values and gradients (q, k, v and every bias parameter).

Without a GPU the kernels run on CPU under Triton's interpreter (conftest.py sets ``TRITON_INTERPRET=1`` before
triton is first imported); with one, the same tests run the compiled kernels on CUDA. Shapes are small, and the
blocks are shrunk to 32 (one test: 16 × 32) so that lengths 16, 40 and 64 cover one partial block, several blocks
with a partial last one, and whole blocks, with the table gradient added from many tiles.
"""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import SCHEMES, make

import posenc.attention.auto as auto
import posenc.attention.triton_launch as triton_launch
import posenc.attention.triton_table as triton_table
from posenc.attention import get_backend
from posenc.attention.auto import choose
from posenc.bench import bias_values
from posenc.encodings.base import PositionalEncoding, distances
from posenc.model import Decoder

pytest.importorskip("triton", reason="attention=triton needs the triton package (Linux); not installed here")
KERNELS = triton_launch.kernels()
DEVICE = "cpu" if KERNELS.INTERPRETED else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip(
        "triton was imported before TRITON_INTERPRET=1 was set and there is no GPU: the kernels cannot run",
        allow_module_level=True,
    )

HEADS, HEAD_DIM = 3, 16  # tl.dot needs a head dim of at least 16 (conftest's is 8)
DISTANCE_SCHEMES = [name for name in SCHEMES if make(name).distance_only]


def _plain(name: str) -> bool:
    """No bias of any kind, softmax attention, and q, k of v's width: a rotation or nothing at all."""
    enc = make(name)
    return not (enc.adds_bias or enc.adds_content_bias or enc.supplies_attention) and enc.qk_width == 1


NO_BIAS_SCHEMES = [name for name in SCHEMES if _plain(name)]
WIDENING_SCHEMES = [name for name in SCHEMES if make(name).qk_width != 1]  # q, k wider than v: one kernel width fails
# What a softmax(q·kᵀ/√D + table) kernel cannot compute: biases that read q and k, attentions of the scheme's own but
# stick-breaking's (its fused kernel: tests/test_triton_stick.py).
REFUSED_SCHEMES = [
    name
    for name in SCHEMES
    if make(name).adds_content_bias or (make(name).supplies_attention and make(name).stick_form() is None)
]
ALL_DISTANCE_BIASES = "+".join(DISTANCE_SCHEMES)  # every distance-only scheme in one stack


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_launch, "BLOCK_M", 32)
    monkeypatch.setattr(triton_launch, "BLOCK_N", 32)


def _run(backend: str, name: str, length: int, dtype: torch.dtype = torch.float32, head_dim: int = HEAD_DIM):
    """Output and gradients of q, k, v and every trainable parameter under a non-uniform output gradient."""
    torch.manual_seed(7)
    enc = make(name, heads=HEADS, head_dim=head_dim).to(DEVICE)
    pos = torch.arange(length, device=DEVICE)
    q, k, v = (torch.randn(2, HEADS, length, head_dim, dtype=dtype).to(DEVICE).requires_grad_() for _ in range(3))
    rotated_q, rotated_k = enc.rotate(q, k, pos, pos)
    out = get_backend(backend)(rotated_q, rotated_k, v, enc, pos, pos)
    (out.float() * torch.randn(out.shape).to(DEVICE)).sum().backward()
    # Every trainable parameter, None where attention does not reach it (a learned APE's table, used at the input).
    return [out.detach(), q.grad, k.grad, v.grad, *(p.grad for p in enc.parameters() if p.requires_grad)]


def _assert_matches(
    name: str, length: int, atol: float = 1e-5, rtol: float = 1e-4, **kwargs: object
) -> list[torch.Tensor | None]:
    expected, got = _run("eager", name, length, **kwargs), _run("triton", name, length, **kwargs)
    assert len(got) == len(expected) >= 4
    for value, reference in zip(got, expected, strict=True):
        assert (value is None) == (reference is None)
        if reference is not None:
            torch.testing.assert_close(value.float(), reference.float(), atol=atol, rtol=rtol)
    return got


# Every scheme over one partial block and several blocks; the stack of them all also over whole blocks.
@pytest.mark.parametrize(
    "name, length", [(n, length) for n in DISTANCE_SCHEMES for length in (16, 40)] + [(ALL_DISTANCE_BIASES, 64)]
)
def test_values_and_gradients_match_eager(name: str, length: int) -> None:
    got = _assert_matches(name, length)
    assert all(value is not None for value in got)  # every bias parameter receives its gradient


@pytest.mark.parametrize("name", [*NO_BIAS_SCHEMES, "rope+t5"])
def test_schemes_without_a_bias_or_with_a_rotation(name: str) -> None:
    _assert_matches(name, 40)


@pytest.mark.parametrize("name", REFUSED_SCHEMES)
def test_refuses_content_dependent_biases_rather_than_dropping_them(name: str) -> None:
    pos = torch.arange(16, device=DEVICE)
    q, k, v = (torch.randn(1, HEADS, 16, HEAD_DIM, device=DEVICE) for _ in range(3))
    with pytest.raises(ValueError, match=r"content-dependent bias|supplies another attention"):
        get_backend("triton")(q, k, v, make(name), pos, pos)


@pytest.mark.parametrize("name", WIDENING_SCHEMES)
def test_refuses_q_and_k_wider_than_v(name: str) -> None:
    enc = make(name, heads=HEADS, head_dim=HEAD_DIM).to(DEVICE)
    pos = torch.arange(16, device=DEVICE)
    q, k = enc.rotate(*(torch.randn(1, HEADS, 16, HEAD_DIM, device=DEVICE) for _ in range(2)), pos, pos)
    with pytest.raises(ValueError, match="one head width"):
        get_backend("triton")(q, k, torch.randn(1, HEADS, 16, HEAD_DIM, device=DEVICE), enc, pos, pos)


def test_table_gradient_is_every_distances_diagonal_sum() -> None:
    # The fused reduction on its own: a free table (H, L), every entry's gradient against dense autograd.
    length = 40
    q, k, v = (torch.randn(2, HEADS, length, HEAD_DIM, device=DEVICE) for _ in range(3))
    table = torch.randn(HEADS, length, device=DEVICE, requires_grad=True)
    weights = torch.randn(2, HEADS, length, HEAD_DIM, device=DEVICE)
    (triton_table.table_attention(q, k, v, table)[0] * weights).sum().backward()
    got, table.grad = table.grad, None
    pos = torch.arange(length, device=DEVICE)
    distance = pos[:, None] - pos[None, :]
    scores = q @ k.transpose(-1, -2) / HEAD_DIM**0.5 + table[:, distance.clamp(min=0)]
    scores = scores.masked_fill(distance < 0, float("-inf"))
    (scores.softmax(-1) @ v * weights).sum().backward()
    assert table.grad.abs().min() > 0  # every distance is reached
    torch.testing.assert_close(got, table.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("block_m, block_n, length", [(16, 32, 64), (32, 16, 40)])
def test_unequal_blocks_and_many_tiles(
    monkeypatch: pytest.MonkeyPatch, block_m: int, block_n: int, length: int
) -> None:
    # Non-square tiles, taller or wider (GPU classes launch both): the skewed diagonal reduction of each, and
    # 4 × 2 tiles per head (2 × 3 with a partial last query block).
    monkeypatch.setattr(triton_launch, "BLOCK_M", block_m)
    monkeypatch.setattr(triton_launch, "BLOCK_N", block_n)
    _assert_matches(ALL_DISTANCE_BIASES if length == 64 else "kerple_log+t5", length)


def test_head_dims_that_pad_or_fill_the_block() -> None:
    _assert_matches("alibi+t5", 40, head_dim=24)  # padded to 32
    # 128 fills the largest block; fp16 there, as fp32 is refused past 64 (its tiles exceed an H100's shared memory)
    _assert_matches("alibi+t5", 40, head_dim=128, dtype=torch.float16, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_close(dtype: torch.dtype) -> None:
    if KERNELS.INTERPRETED and dtype == torch.bfloat16:
        with pytest.raises(ValueError, match="interpreter has no bf16"):  # refused, never silently wrong
            _run("triton", ALL_DISTANCE_BIASES, 40, dtype=dtype)
        return
    # Both read the same rounded q, k, v; the kernel also rounds P and dS to the input dtype for its products.
    _assert_matches(ALL_DISTANCE_BIASES, 40, atol=3e-2, rtol=3e-2, dtype=dtype)


def test_model_trains_the_same_through_triton() -> None:
    # q, k, v arrive as strided views of the fused projection: the kernels read them through their strides.
    kwargs = {"vocab_size": 50, "dim": 32, "depth": 2, "heads": 2}
    torch.manual_seed(0)
    reference = Decoder(["rope+kerple_log", "t5"], attention="eager", **kwargs)
    model = Decoder(["rope+kerple_log", "t5"], attention="triton", **kwargs)
    model.load_state_dict(reference.state_dict())
    model.to(DEVICE), reference.to(DEVICE)
    tokens = torch.randint(0, 50, (2, 41)).to(DEVICE)
    losses = [m.loss(tokens[:, :-1], tokens[:, 1:]) for m in (model, reference)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=1e-5)
    for (name, got), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad, atol=1e-5, rtol=1e-4, msg=name)


class _AbsoluteBias(PositionalEncoding):
    """A bias that depends on where the query is, not only on the distance: no table can hold it."""

    name = "absolute_bias_for_tests"
    adds_bias = True

    def bias(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        return (q_pos[:, None] * 0.01 - distances(q_pos, k_pos)).expand(self.num_heads, -1, -1)


def _qkv(length: int = 16, head_dim: int = HEAD_DIM, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.randn(1, HEADS, length, head_dim, dtype=dtype) for _ in range(3)]


def test_refuses_what_it_cannot_honour(monkeypatch: pytest.MonkeyPatch) -> None:
    attend = get_backend("triton")
    pos = torch.arange(16)
    with pytest.raises(ValueError, match="distance i - j alone"):
        attend(*_qkv(), _AbsoluteBias(HEADS, HEAD_DIM), pos, pos)
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="self-attention over one window"):
        attend(q[:, :, -1:], k, v, make("alibi", heads=HEADS, head_dim=HEAD_DIM), pos[-1:], pos)
    with pytest.raises(ValueError, match="self-attention over one window"):
        attend(q, k, v, make("alibi", heads=HEADS, head_dim=HEAD_DIM), pos, pos + 1)
    with pytest.raises(ValueError, match=r"head dims 16\.\.128, got 8"):
        attend(*_qkv(head_dim=8), make("alibi", heads=HEADS, head_dim=8), pos, pos)
    with pytest.raises(ValueError, match=r"in fp32 supports head dims up to 64.*bf16"):
        attend(*_qkv(head_dim=128), make("alibi", heads=HEADS, head_dim=128), pos, pos)
    with pytest.raises(ValueError, match="one dtype among fp32, bf16, fp16"):
        attend(*_qkv(dtype=torch.float64), make("alibi", heads=HEADS, head_dim=HEAD_DIM), pos, pos)
    enc = make("t5", heads=HEADS, head_dim=HEAD_DIM)
    monkeypatch.setattr(KERNELS, "INTERPRETED", False)  # CPU tensors for compiled kernels
    with pytest.raises(RuntimeError, match="runs on CUDA tensors"):
        attend(q, k, v, enc, pos, pos)
    monkeypatch.setitem(sys.modules, KERNELS.__name__, None)  # what importing looks like without triton
    with pytest.raises(RuntimeError, match="needs the triton package"):
        attend(q, k, v, enc, pos, pos)


def test_auto_picks_triton_only_where_a_measurement_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    # Unmeasured on a GPU: nothing recorded, so auto keeps its other choices on every GPU class.
    names = [*SCHEMES, ALL_DISTANCE_BIASES]
    before = {name: choose(make(name), is_cuda=True, capability=(9, 0)) for name in names}
    assert auto.MEASURED_FASTER == {} and "triton" not in before.values()
    assert all(choose(make(name), is_cuda=True) == before[name] for name in names)
    # A recorded measurement (learnable tables on sm_90) moves exactly those schemes, on that GPU class only.
    monkeypatch.setitem(auto.MEASURED_FASTER, (9, 0), frozenset({"learnable"}))
    for name in names:
        enc = make(name)
        picked = choose(enc, is_cuda=True, capability=(9, 0))
        assert picked == ("triton" if auto.kernel_kind(enc) == "learnable" else before[name]), name
        assert choose(enc, is_cuda=True, capability=(8, 0)) == before[name]
        assert choose(enc, is_cuda=False, capability=(9, 0)) != "triton"


def test_deterministic_table_gradient_is_the_same_bits_on_every_run() -> None:
    # The atomics add tiles in whatever order a GPU runs them; torch.use_deterministic_algorithms(True) (what
    # trainer.deterministic sets) switches to one store per block of distances and a fixed-order sum instead.
    # 40 positions: 2 query blocks of 32, the last partial, the second reaching the first block of distances.
    q, k, v, dout = (torch.randn(1, HEADS, 40, HEAD_DIM, device=DEVICE) for _ in range(4))
    table = torch.randn(HEADS, 40, device=DEVICE)
    out, lse = triton_table.table_attention(q, k, v, table)

    def table_gradient() -> torch.Tensor:
        return triton_table.table_attention_backward(dout, q, k, v, out, lse, table, True)[3]

    atomic = table_gradient()
    torch.use_deterministic_algorithms(True)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiled:
            first, second = table_gradient(), table_gradient()
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(first, second) and first.abs().min() > 0  # every distance reached
    torch.testing.assert_close(first, atomic, atol=1e-5, rtol=1e-4)
    # On CUDA, deterministic mode refuses a cuBLAS call unless CUBLAS_WORKSPACE_CONFIG was set before the first
    # one; a CPU build never checks. So the deterministic backward's own operators hold no matrix product.
    called = {event.name for event in profiled.events()}
    assert "aten::sum" in called and not called & CUBLAS_OPERATORS, called & CUBLAS_OPERATORS


CUBLAS_OPERATORS = {f"aten::{name}" for name in ("mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "dot")}


def test_the_kernels_are_custom_ops_with_fake_and_autograd_implementations() -> None:
    q, k, v = (torch.randn(1, 2, 20, HEAD_DIM, device=DEVICE, requires_grad=True) for _ in range(3))
    table = torch.randn(2, 20, device=DEVICE, requires_grad=True)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.posenc.table_attention.default, (q, k, v, table), test_utils=checks)
    out, lse = triton_table.table_attention(q, k, v, table)
    args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, table.detach(), True)
    torch.library.opcheck(torch.ops.posenc.table_attention_backward.default, args, test_utils=checks[0::2])


def test_a_compiled_block_through_the_kernels_is_one_graph() -> None:
    # The custom ops trace as single nodes: a block compiles whole, forward and backward, and trains as eager does.
    torch._dynamo.reset()
    kwargs = {"vocab_size": 50, "dim": 2 * HEAD_DIM, "depth": 1, "heads": 2}
    reference = Decoder("kerple_log", attention="eager", **kwargs).to(DEVICE)
    model = Decoder("kerple_log", attention="triton", **kwargs).to(DEVICE)
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


def test_the_bias_stage_checks_the_fused_kernels_values_and_catches_a_wrong_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What the GPU's bias stage runs before timing (there in bf16 at head dims 64 and 128, atomic and deterministic):
    # here under the interpreter, deterministic, at a length no tile divides. Every tensor is compared, KERPLE-log's
    # parameters' gradients among them.
    enc = make("kerple_log", heads=HEADS, head_dim=HEAD_DIM).to(DEVICE)
    result = bias_values.check(enc, 1, 39, HEAD_DIM, torch.float32, deterministic=True)
    assert result["ok"], result
    assert set(result["errors"]) == {"out", "dq", "dk", "dv", *(f"d{name}" for name, _ in enc.named_parameters())}
    off = lambda *args: get_backend("eager")(*args) * 1.001  # noqa: E731  a kernel off by a tenth of a percent
    monkeypatch.setattr(bias_values, "get_backend", lambda name: off if name == "triton" else get_backend(name))
    wrong = bias_values.check(enc, 1, 39, HEAD_DIM, torch.float32, deterministic=False)
    assert not wrong["ok"] and not wrong["errors"]["out"]["ok"]


def _windowed(backend: str, name: str, length: int, window: int) -> list[torch.Tensor]:
    torch.manual_seed(8)
    enc = make(name, heads=HEADS, head_dim=HEAD_DIM).to(DEVICE)
    with torch.no_grad():  # scheme parameters away from their start, so each one's gradient matters
        for param in enc.parameters():
            param.add_(0.3 * torch.randn_like(param)).abs_()
    pos = torch.arange(length, device=DEVICE)
    q, k, v = (torch.randn(2, HEADS, length, HEAD_DIM).to(DEVICE).requires_grad_() for _ in range(3))
    rotated_q, rotated_k = enc.rotate(q, k, pos, pos)
    out = get_backend(backend)(rotated_q, rotated_k, v, enc, pos, pos, window=window)
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad, *(p.grad for p in enc.parameters() if p.requires_grad)]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("window", [1, 7, 16, 33, 70])
def test_a_local_layer_skips_the_blocks_outside_its_window_and_matches_eager(
    monkeypatch: pytest.MonkeyPatch, window: int, deterministic: bool
) -> None:
    # 70 positions in tiles of 16 × 32 (square 16 when deterministic): query blocks whose first tiles hold no key in
    # their window, rows with no visible key in the first tile they read, a window of one, one past the length.
    monkeypatch.setattr(triton_launch, "BLOCK_M", 16)
    monkeypatch.setattr(triton_launch, "BLOCK_N", 32)
    name = "kerple_log+t5" if window % 2 else "alibi"
    expected = _windowed("eager", name, 70, window)
    torch.use_deterministic_algorithms(deterministic)
    try:
        got = _windowed("triton", name, 70, window)
    finally:
        torch.use_deterministic_algorithms(False)
    for index, (value, reference) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(value, reference, atol=2e-5, rtol=1e-4, msg=lambda m, i=index: f"tensor {i}: {m}")
