"""GPU integration tests (``pytest -m gpu`` on a CUDA machine; skipped elsewhere).

The same comparisons as the CPU tests, but through compiled FlexAttention on CUDA (the path training uses), plus
bf16 closeness, the 64k batch-1 forward of every relative scheme, and speed against the issue's targets.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from posenc.attention import get_backend
from posenc.attention.auto import choose
from posenc.bench import attention_call, median_ms
from posenc.encodings import available, build, scheme_class
from posenc.lit import compile_blocks
from posenc.model import Decoder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

HEADS, HEAD_DIM = 12, 64  # the anchor benchmark's attention shape
LEARNABLE = ["kerple_log", "kerple_power", "t5", "alibi+kerple_log+t5"]
RELATIVE = [name for name in available() if not scheme_class(name).absolute] + ["rope+alibi", "alibi+kerple_log+t5"]


def _run(backend: str, name: str, length: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """Output and gradients (q, k, v, bias parameters) on CUDA, inputs made in fp32 then cast."""
    torch.manual_seed(seed)
    enc = build(name, num_heads=HEADS, head_dim=HEAD_DIM).cuda()
    pos = torch.arange(length, device="cuda")
    base = [torch.randn(2, HEADS, length, HEAD_DIM, device="cuda") for _ in range(3)]
    q, k, v = (t.to(dtype).requires_grad_() for t in base)
    weights = torch.randn(2, HEADS, length, HEAD_DIM, device="cuda")
    out = get_backend(backend)(q, k, v, enc, pos, pos)
    (out.float() * weights).sum().backward()
    return [out.float(), *(t.grad.float() for t in (q, k, v)), *(p.grad.float() for p in enc.parameters())]


@pytest.mark.parametrize("name", LEARNABLE)
def test_flex_learnable_matches_eager_on_cuda_fp32(name: str) -> None:
    got, expected = _run("flex_learnable", name, 300, torch.float32), _run("eager", name, 300, torch.float32)
    for value, reference in zip(got, expected, strict=True):
        torch.testing.assert_close(value, reference, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("name", LEARNABLE)
def test_flex_learnable_bf16_close_to_fp32(name: str) -> None:
    got, expected = _run("flex_learnable", name, 1024, torch.bfloat16), _run("eager", name, 1024, torch.float32)
    for value, reference in zip(got, expected, strict=True):
        # Relative to the tensor's scale: bf16 keeps ~3 significant digits; the bias is kept in fp32 throughout.
        assert (value - reference).norm() <= 3e-2 * reference.norm()


@pytest.mark.parametrize("name", ["alibi", "rope+alibi", "kerple_log", "t5"])
def test_flex_forward_keeps_long_distances_exact_in_bf16(name: str) -> None:
    # ALiBi distances past 256 are not exact in bf16: the bias must be computed in fp32 inside the kernel.
    torch.manual_seed(0)
    enc = build(name, num_heads=HEADS, head_dim=HEAD_DIM).cuda()
    pos = torch.arange(4096, device="cuda")
    q, k, v = (torch.randn(1, HEADS, 4096, HEAD_DIM, device="cuda") for _ in range(3))
    q, k = enc.rotate(q, k, pos, pos)
    with torch.no_grad():
        low = get_backend("auto")(q.bfloat16(), k.bfloat16(), v.bfloat16(), enc, pos, pos).float()
        reference = get_backend("sdpa")(q, k, v, enc, pos, pos)
    assert (low - reference).norm() <= 2e-2 * reference.norm()


@pytest.mark.parametrize("name", RELATIVE)
def test_64k_batch_one_forward_fits(name: str) -> None:
    length = 65536
    enc = build(name, num_heads=HEADS, head_dim=HEAD_DIM).cuda()
    q, k, v = (torch.randn(1, HEADS, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        out = attention_call(enc, choose(enc, is_cuda=True), q, k, v)()
    torch.cuda.synchronize()
    peak_gib = (torch.cuda.max_memory_allocated() - base) / 2**30
    assert torch.isfinite(out).all()
    # q, k, v are 96 MiB each: an O(L) path needs a small multiple of that; an L² one would need 96+ GiB.
    assert peak_gib < 2.0, f"{name} used {peak_gib:.2f} GiB above its inputs at 64k"


def test_compiled_model_trains_like_eager_and_does_not_recompile_per_length() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch.manual_seed(0)
    kwargs = {"vocab_size": 257, "dim": 256, "depth": 2, "heads": 4}
    reference = Decoder(["rope+kerple_log", "t5"], attention="eager", **kwargs).cuda()
    model = Decoder(["rope+kerple_log", "t5"], attention="auto", **kwargs).cuda()
    model.load_state_dict(reference.state_dict())
    counter = CompileCounterWithBackend("inductor")  # the real compiler, counted
    compile_blocks(model, backend=counter)
    tokens = torch.randint(0, 257, (2, 257), device="cuda")
    losses = [m.loss(tokens[:, :-1], tokens[:, 1:]) for m in (model, reference)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[0], losses[1], atol=1e-4, rtol=1e-4)
    for got, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad, atol=1e-4, rtol=1e-3)
    frames = []
    with torch.no_grad():
        for length in (256, 512, 1024, 2048, 4096):
            model(torch.randint(0, 257, (1, length), device="cuda"))
            frames.append(counter.frame_count)
    assert frames[1] == frames[-1], frames


def _fwd_bwd_ms(name: str, backend: str, length: int) -> float:
    enc = build(name, num_heads=HEADS, head_dim=HEAD_DIM).cuda()
    batch = 16384 // length
    q, k, v = (
        torch.randn(batch, HEADS, length, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    grad = torch.randn_like(q)
    call = attention_call(enc, backend, q, k, v)

    def step() -> None:
        call().backward(grad)
        for tensor in (q, k, v, *enc.parameters()):
            tensor.grad = None

    return median_ms(step, torch.device("cuda"), warmup=3, repeats=10)


def test_speed_against_the_issue_targets() -> None:
    """Forward+backward at L = 8192 (16k tokens, bf16, 12 × 64) as a ratio to SDPA flash without a bias.

    Asserted: RoPE and xPos within the issue's 1.3× target (the rotation is compiled); the learnable biases
    within its hard floor of 3× (the 1.5× target needs a fused kernel, see docs/benchmarks.md); ALiBi within 2×
    (the anchor measured FlexAttention ALiBi at 1.6× on this shape, above the 1.3× target, before any tuning).
    """
    length = 8192
    shape = (16384 // length, HEADS, length, HEAD_DIM)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)

    def flash() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
        q.grad = k.grad = v.grad = None

    flash_ms = median_ms(flash, torch.device("cuda"), warmup=3, repeats=10)
    limits = {"rope": 1.3, "xpos": 1.3, "alibi": 2.0, "kerple_log": 3.0, "kerple_power": 3.0, "t5": 3.0}
    ratios = {}
    for name in limits:
        backend = choose(build(name, num_heads=HEADS, head_dim=HEAD_DIM), is_cuda=True)
        ratios[name] = _fwd_bwd_ms(name, backend, length) / flash_ms
    print({name: round(ratio, 2) for name, ratio in ratios.items()})
    assert all(ratios[name] <= limit for name, limit in limits.items()), ratios
