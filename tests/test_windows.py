"""Local (sliding-window) layers: every backend against the dense reference, the block mask, the rolling cache, layouts.

The reference itself is checked against a construction that does not share its code: a local softmax row is the
global row restricted to the window and renormalised (every score reads only its own query and key, and the keys
between them, all inside the window). Then every backend that takes a window, for every softmax scheme of the registry,
values and the gradients of q, k, v and every scheme parameter, with and without a sink; FlexAttention's block mask
against torch's own ``create_block_mask``; cached decoding with a rolling cache against the full forward; the layout
syntax, its options and its refusals.
"""

from __future__ import annotations

import pytest
import torch
from conftest import HEADS, SCHEMES, make
from test_sinks import FUSED, _accepts, _moved
from torch.nn.attention.flex_attention import create_block_mask

import posenc.attention.flex as flex
from posenc.attention import get_backend
from posenc.attention.auto import choose
from posenc.attention.eager import attention_weights
from posenc.attention.sink import Sink
from posenc.decoding import KVCache
from posenc.encodings.length import scale_to_length
from posenc.model import Decoder
from posenc.runtime import forced_cuda_path

HEAD_DIM = 16
LENGTH = 21
WINDOW = 6
SOFTMAX = [name for name in SCHEMES if not make(name).supplies_attention and not make(name).absolute]
# Schemes a local layer takes: not those that count the keys a row sees from positions alone (SSMax).
LOCAL = [name for name in SOFTMAX if not make(name).scales_with_length]
CASES = [*SOFTMAX, "rope+alibi"]


def _inputs(name: str, seed: int = 5):
    torch.manual_seed(seed)
    enc = make(name, head_dim=HEAD_DIM)
    _moved(enc)
    enc.constrain_()
    q, k, v = (torch.randn(2, HEADS, LENGTH, HEAD_DIM, requires_grad=True) for _ in range(3))
    features = enc.token_features(torch.randn(2, LENGTH, HEADS * HEAD_DIM)) if enc.reads_layer_input else None
    return enc, q, k, v, features


@pytest.mark.parametrize("name", CASES)
def test_a_local_row_is_the_global_row_cut_to_the_window_and_renormalised(name: str) -> None:
    enc, q, k, _, features = _inputs(name)
    pos = torch.arange(LENGTH)
    with torch.no_grad():
        rotated_q, rotated_k = enc.rotate(q, k, pos, pos)
        local = attention_weights(rotated_q, rotated_k, enc, pos, pos, features, window=WINDOW)
        full = attention_weights(rotated_q, rotated_k, enc, pos, pos, features)
    inside = (pos[:, None] - pos[None, :] >= 0) & (pos[:, None] - pos[None, :] < WINDOW)
    assert torch.equal(local[..., ~inside], torch.zeros_like(local[..., ~inside]))
    cut = full * inside
    torch.testing.assert_close(local, cut / cut.sum(-1, keepdim=True), atol=1e-6, rtol=1e-5)


def _grads(backend: str, name: str, window: int, sink_kind: str | None = None) -> list[torch.Tensor]:
    enc, q, k, v, features = _inputs(name)
    pos = torch.arange(LENGTH)
    rotated_q, keys = enc.rotate(q, k, pos, pos)
    values, columns, sink_params = v, None, []
    if sink_kind is not None:
        sink = Sink(sink_kind, HEADS, HEAD_DIM, tokens=2)
        _moved(sink)
        keys, values, rotated_pos = sink.in_front(k, v, pos)
        rotated_q, keys = enc.rotate(q, keys, pos, rotated_pos)
        columns, keys, values = sink.columns(keys, values, rotated_pos)
        sink_params = list(sink.parameters())
    with forced_cuda_path() if backend in FUSED else torch.enable_grad():
        out = get_backend(backend)(
            rotated_q, keys, values, enc, pos, pos, features=features, sink=columns, window=window
        )
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
    trained = [p for p in [*enc.parameters(), *sink_params] if p.requires_grad]
    return [out.detach(), q.grad, k.grad, v.grad, *(p.grad for p in trained)]


def _backends(name: str) -> list[str]:
    # flex_learnable refuses a window (tested below); auto picks among the rest. triton runs under Triton's
    # interpreter here (tests/test_triton_table.py: many tiles, deterministic mode).
    return [b for b in ("sdpa", "auto", "flex", "triton") if _accepts(b, name)]


def _assert_all_close(got: list[torch.Tensor], expected: list[torch.Tensor], backend: str) -> None:
    assert len(got) == len(expected), backend
    for index, (value, reference) in enumerate(zip(got, expected, strict=True)):
        atol = 2e-5 * max(1.0, reference.abs().max().item())
        torch.testing.assert_close(
            value, reference, atol=atol, rtol=1e-4, msg=lambda m, b=backend, i=index: f"{b}, tensor {i}: {m}"
        )


@pytest.mark.parametrize("name", CASES)
def test_every_backend_matches_the_dense_reference_in_a_local_layer(flex_backward_on_cpu: None, name: str) -> None:
    expected = _grads("eager", name, WINDOW)
    assert all(g is not None for g in expected)
    backends = _backends(name)
    assert "sdpa" in backends
    for backend in backends:
        _assert_all_close(_grads(backend, name, WINDOW), expected, backend)


@pytest.mark.parametrize("window", [1, LENGTH])
@pytest.mark.parametrize("sink_kind", ["learned", "tokens"])
@pytest.mark.parametrize("name", ["rope+alibi", "kerple_log", "fox"])
def test_a_local_layer_with_a_sink_matches_the_reference(
    flex_backward_on_cpu: None, name: str, sink_kind: str, window: int
) -> None:
    # A window of one leaves each query itself and the sink; one as long as the sequence hides nothing.
    expected = _grads("eager", name, window, sink_kind)
    for backend in _backends(name):
        _assert_all_close(_grads(backend, name, window, sink_kind), expected, backend)
    if window == LENGTH:
        _assert_all_close(expected[:1], _grads("eager", name, None, sink_kind)[:1], "eager, global")


@pytest.mark.parametrize("window", [1, 100, 128, 129, 200, 256, 300, 400])
def test_the_window_block_mask_is_torchs_own(window: int) -> None:
    length = 300  # three blocks, the last cut short
    ours = flex.causal_block_mask(length, "cpu", window)
    theirs = create_block_mask(flex.windowed(window), None, None, length, length, device="cpu")
    for field in ("kv_num_blocks", "full_kv_num_blocks"):
        assert torch.equal(getattr(ours, field), getattr(theirs, field)), field
    for counts, ours_idx, theirs_idx in [
        (ours.kv_num_blocks, ours.kv_indices, theirs.kv_indices),
        (ours.full_kv_num_blocks, ours.full_kv_indices, theirs.full_kv_indices),
    ]:
        for row, count in enumerate(counts[0, 0].tolist()):
            assert sorted(ours_idx[0, 0, row, :count].tolist()) == sorted(theirs_idx[0, 0, row, :count].tolist())
    if window <= 128:  # the first key block is wholly outside the last query block's window: skipped
        assert 0 not in ours.kv_indices[0, 0, 2, : ours.kv_num_blocks[0, 0, 2]].tolist()


def test_flex_skips_blocks_yet_matches_the_reference_past_one_block() -> None:
    torch.manual_seed(6)
    enc = make("alibi", head_dim=HEAD_DIM)
    q, k, v = (torch.randn(1, HEADS, 300, HEAD_DIM) for _ in range(3))
    pos = torch.arange(300)
    with torch.no_grad():
        expected = get_backend("eager")(q, k, v, enc, pos, pos, window=100)
        got = get_backend("flex")(q, k, v, enc, pos, pos, window=100)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)


def _layout(name: str, **kwargs) -> Decoder:
    kwargs = {"vocab_size": 40, "dim": 32, "depth": 2, "heads": HEADS, "attention": "auto", **kwargs}
    encoding = {"name": [f"local-{name}", name], "window": WINDOW}
    if name == "learned":
        encoding[name] = {"max_positions": 64}
    return Decoder(encoding, **kwargs)


@pytest.mark.parametrize("name", LOCAL)
def test_cached_decoding_with_a_rolling_cache_matches_the_full_forward(name: str) -> None:
    torch.manual_seed(7)
    model = _layout(name).eval()
    _moved(model)
    tokens = torch.randint(0, 40, (2, 30))
    cache = KVCache(len(model.blocks))
    with torch.no_grad():
        full = model(tokens)
        steps = [model(tokens[:, :9], cache=cache), *(model(tokens[:, i : i + 1], cache=cache) for i in range(9, 30))]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=2e-5, rtol=1e-4)
    assert cache.layers[0].k.shape[-2] == WINDOW - 1  # the local layer keeps what its next window reaches
    assert cache.layers[1].k.shape[-2] == 30  # the global layer keeps everything


def test_a_rolling_cache_keeps_sink_tokens_at_the_first_position() -> None:
    torch.manual_seed(8)
    model = _layout("alibi", sink="tokens").eval()
    _moved(model)
    tokens = torch.randint(0, 40, (1, 25))
    cache = KVCache(len(model.blocks))
    with torch.no_grad():
        full = model(tokens)
        steps = [model(tokens[:, :4], cache=cache), *(model(tokens[:, i : i + 1], cache=cache) for i in range(4, 25))]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=2e-5, rtol=1e-4)


def test_a_local_layer_changes_the_output_and_a_layout_reads_options_by_kind() -> None:
    torch.manual_seed(9)
    options = {"rope": {"base": 1_000_000}, "local-rope": {"base": 10_000}}
    model = Decoder({"name": ["local-rope", "rope"], "window": 4, **options}, vocab_size=40, dim=32, depth=2)
    assert model.layer_windows == [4, None]
    assert [enc.base for enc in model.layer_encodings] == [10_000, 1_000_000]
    assert model.label == "local-rope,rope"
    plain = Decoder({"name": ["local-rope", "rope"], "window": 100, **options}, vocab_size=40, dim=32, depth=2)
    plain.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 40, (1, 12))
    with torch.no_grad():
        assert not torch.allclose(model(tokens), plain(tokens))
        torch.testing.assert_close(model(tokens[:, :4]), plain(tokens[:, :4]))  # within the window: the same


@pytest.mark.parametrize(
    ("encoding", "message"),
    [
        ({"name": ["local-rope", "rope"]}, r"has local layers: give their window"),
        ({"name": ["rope", "nope"], "window": 8}, r"no layer of .* is local"),
        ({"name": ["side-rope", "rope"], "window": 8}, r"layer kind 'side' .* must be one of global, local"),
        ({"name": ["local-rope", "rope"], "window": 0.25}, r"is a fraction of the training length"),
        ({"name": ["local-rope", "rope"], "window": 0}, r"must be an integer ≥ 1"),
        ({"name": ["local-stick_breaking", "rope"], "window": 8}, r"supplies its own attention .* global layers"),
        ({"name": ["local-ssmax", "rope"], "window": 8}, r"number of keys it sees.* global layers"),
    ],
)
def test_a_layout_refuses_what_it_cannot_build_in_one_line(encoding: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Decoder(encoding, vocab_size=40, dim=32, depth=2)


@pytest.mark.parametrize("backend", ["triton", "flex_learnable", "scheme"])
def test_backends_without_a_window_refuse_it(backend: str) -> None:
    name = "kerple_log" if backend == "flex_learnable" else "stick_breaking"  # triton: its stick-breaking kernel
    enc = make(name, head_dim=HEAD_DIM)
    q = k = v = torch.randn(1, HEADS, 8, HEAD_DIM)
    pos = torch.arange(8)
    with pytest.raises(ValueError, match=rf"attention={backend} cannot run a local \(sliding-window\) layer"):
        get_backend(backend)(q, k, v, enc, pos, pos, window=4)


def test_auto_picks_a_backend_that_takes_a_window() -> None:
    assert choose(make("rope"), is_cuda=True, local=True) == "flex"  # block skipping, where SDPA needs a mask
    assert choose(make("kerple_log"), is_cuda=True, local=True) == "sdpa"  # flex's own backward of a table fails
    assert choose(make("kerple_log"), is_cuda=True, training=False, local=True) == "flex"
    assert choose(make("alibi"), is_cuda=True, local=True) == "flex"
    assert choose(make("kerple_log"), is_cuda=True) == "flex_learnable"
    assert choose(make("rope"), is_cuda=False, local=True) == "sdpa"


@pytest.mark.parametrize(
    ("window", "value", "rule"),
    [(None, 32, "L/2 (Gemma 2: 4,096 at L = 8,192)"), (0.25, 16, "0.25·L (given as a fraction)"), (9, 9, "given")],
)
def test_a_run_resolves_the_window_from_its_length(window: float | None, value: int, rule: str) -> None:
    spec = {"name": ["local-rope", "local-t5", "rope"], "window": window, "local-t5": {"num_buckets": None}}
    resolved, record = scale_to_length(spec, 64)
    assert resolved["window"] == value and record["window"] == {"value": value, "rule": rule}
    assert resolved["local-t5"]["num_buckets"] == 4  # a local layer's own options scale as the member's do
    assert scale_to_length({"name": ["rope", "nope"]}, 64)[1] == {}


LAYOUTS = ["gemma3", "rnope_swa", "irope", "swan"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_deployed_layout_builds_as_its_config_says(layout: str) -> None:
    from posenc.bench.step import encoding_spec

    spec = encoding_spec(layout, 64)  # as a run training at L = 64 reads it: the window in keys
    model = Decoder(spec, vocab_size=40, dim=32, depth=12, heads=HEADS)
    kinds = ["local" if window else "global" for window in model.layer_windows]
    entries = spec["name"]
    assert kinds == [("local" if e.startswith("local-") else "global") for e in entries] * (12 // len(entries))
    assert set(model.layer_windows) - {None} == {spec["window"]} and spec["window"] >= 1
    if layout == "gemma3":  # 1,024 of 32,768; base 10k local, 1M global
        assert spec["window"] == 2
        assert [enc.base for enc in model.layer_encodings[:6]] == [10_000] * 5 + [1_000_000]


def test_a_layout_too_deep_for_the_model_is_refused() -> None:
    from posenc.bench.step import encoding_spec

    with pytest.raises(ValueError, match=r"cycles over 4 layers and leaves no global layer: .* at least 6"):
        Decoder(encoding_spec("gemma3", 64), vocab_size=40, dim=32, depth=4)


def test_llama4_temperature_is_its_formula_on_the_global_layers_only() -> None:
    from posenc.encodings.ssmax import TemperatureTuning
    from posenc.evaluate.runner import attention_scaling

    enc = TemperatureTuning(HEADS, HEAD_DIM, floor=4)
    q = torch.ones(1, HEADS, 12, HEAD_DIM)
    pos = torch.arange(12)
    scaled, _ = enc.rotate(q, q, pos, pos)
    expected = [1 + 0.1 * torch.log(torch.tensor((i + 1) // 4 + 1.0)).item() for i in range(12)]
    torch.testing.assert_close(scaled[0, 0, :, 0], torch.tensor(expected))  # 1 for i < 3, then the log of stretches

    model = _layout("rope", attention="sdpa")
    before = [block.attn.encoding for block in model.blocks]
    info = {"label": "local-rope,rope", "train_len": 16}
    with attention_scaling(model, {"attention_scale": "llama4"}, info) as scaled_info:
        during = [block.attn.encoding for block in model.blocks]
    assert scaled_info["label"] == "local-rope,rope · llama4"
    assert during[0] is before[0]  # the local layer as trained
    assert [type(part).__name__ for part in during[1].members] == ["RoPE", "TemperatureTuning"]
    assert during[1].members[1].floor == WINDOW
    assert [block.attn.encoding for block in model.blocks] == before
    with (
        pytest.raises(ValueError, match=r"has no local layer: use it with a layout"),
        attention_scaling(Decoder("rope", vocab_size=40, dim=32, depth=2), {"attention_scale": "llama4"}, info),
    ):
        pass


def test_maps_statistics_and_the_logit_probe_see_a_local_layer_as_it_attends() -> None:
    from posenc.attention.window import visible
    from posenc.evaluate.attention_stats import attention_statistics
    from posenc.training.stability import max_attention_logit

    torch.manual_seed(10)
    model = _layout("alibi", attention="sdpa").eval()
    tokens = torch.randint(1, 40, (2, 24))
    tokens[:, 0] = 0  # a first token whose key stands out: most queries that would score it highest are past W
    with torch.no_grad():
        model.token_embedding.weight[0] *= 30
    pos = torch.arange(24)
    maps = model.attention_maps(tokens, 0)
    outside = (pos[:, None] - pos[None, :]) >= WINDOW
    assert torch.equal(maps[..., outside], torch.zeros_like(maps[..., outside]))
    torch.testing.assert_close(maps.sum(-1), torch.ones(maps.shape[:-1]))
    # The statistics read the same rows: queries 1..L-1, averaged over the batch, per head.
    rows = {(row["layer"], row["head"]): row for row in attention_statistics(model, tokens)}
    distance = (pos[:, None] - pos[None, :]).clamp(min=0).float()
    for head in range(HEADS):
        torch.testing.assert_close(rows[0, head]["sink"], maps[:, head, 1:, 0].mean().item(), atol=1e-6, rtol=1e-5)
        expected = (maps[:, head, 1:] * distance[1:]).sum(-1).mean().item()
        torch.testing.assert_close(rows[0, head]["distance"], expected, atol=1e-5, rtol=1e-5)
        assert rows[0, head]["distance"] < WINDOW
    # The probe's largest logit is over the pairs each layer attends to: a local layer's window, not its whole row.
    model = Decoder({"name": "local-alibi", "window": WINDOW}, vocab_size=40, dim=32, depth=2, heads=HEADS).eval()
    with torch.no_grad():
        model.token_embedding.weight[0] *= 30
    largest = {True: -float("inf"), False: -float("inf")}
    with torch.no_grad():
        x = model.token_embedding(tokens)
        for block in model.blocks:
            q, k, *_ = block.attn.project(block.attn_norm(x), pos)
            scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
            for windowed in (True, False):
                seen = visible(pos, pos, block.attn.window if windowed else None)
                largest[windowed] = max(largest[windowed], scores.masked_fill(~seen, -float("inf")).max().item())
            x = block(x, pos)
    torch.testing.assert_close(max_attention_logit(model, tokens), largest[True], atol=1e-5, rtol=1e-5)
    assert largest[True] < largest[False]  # the window hides the pair that scores highest: the check has teeth


@pytest.mark.parametrize("window", [1, 100, 300])
@pytest.mark.parametrize("name", ["rope", "alibi", "kerple_log", "fox", "cope"])
def test_sdpa_chunks_a_local_layer_by_its_window_and_matches_the_reference(name: str, window: int) -> None:
    # 300 queries in chunks of 128 (a local layer's chunks follow its window), each over the keys its window reaches:
    # no bias, a fixed bias, a learnable table, a folded key term and a content bias.
    def run(backend: str) -> list[torch.Tensor]:
        torch.manual_seed(12)
        enc = make(name, head_dim=HEAD_DIM)
        q, k, v = (torch.randn(1, HEADS, 300, HEAD_DIM, requires_grad=True) for _ in range(3))
        pos = torch.arange(300)
        features = enc.token_features(torch.randn(1, 300, HEADS * HEAD_DIM)) if enc.reads_layer_input else None
        rotated_q, rotated_k = enc.rotate(q, k, pos, pos)
        out = get_backend(backend)(rotated_q, rotated_k, v, enc, pos, pos, features=features, window=window)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(3))).sum().backward()
        return [out.detach(), q.grad, k.grad, v.grad, *(p.grad for p in enc.parameters() if p.requires_grad)]

    got, expected = run("sdpa"), run("eager")
    # A window of one leaves each row a single key: the gates' gradients are 0 in exact arithmetic and rounding here
    # (a softmax of one score), summed over the positions; the tolerance is the largest gradient's, not their own.
    scale = max(1.0, *(reference.abs().max().item() for reference in expected))
    for index, (value, reference) in enumerate(zip(got, expected, strict=True)):
        atol = (1e-3 if window == 1 else 1e-4) * scale
        torch.testing.assert_close(value, reference, atol=atol, rtol=1e-4, msg=lambda m, i=index: f"{i}: {m}")


@pytest.mark.parametrize("window", [1, 100])
@pytest.mark.parametrize("sink_kind", ["learned", "tokens"])
@pytest.mark.parametrize("name", ["rope", "alibi", "kerple_log"])
def test_sdpa_chunks_a_local_layer_with_a_sink_by_its_window(name: str, sink_kind: str, window: int) -> None:
    # 300 queries in chunks of 128, each over the sink's columns and the keys its window reaches, against eager.
    def run(backend: str) -> list[torch.Tensor]:
        torch.manual_seed(13)
        enc, sink = make(name, head_dim=HEAD_DIM), Sink(sink_kind, HEADS, HEAD_DIM, tokens=2)
        _moved(sink)
        q, k, v = (torch.randn(1, HEADS, 300, HEAD_DIM, requires_grad=True) for _ in range(3))
        pos = torch.arange(300)
        keys, values, rotated_pos = sink.in_front(k, v, pos)
        rotated_q, keys = enc.rotate(q, keys, pos, rotated_pos)
        columns, keys, values = sink.columns(keys, values, rotated_pos)
        out = get_backend(backend)(rotated_q, keys, values, enc, pos, pos, sink=columns, window=window)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(3))).sum().backward()
        trained = [p for p in [*enc.parameters(), *sink.parameters()] if p.requires_grad]
        return [out.detach(), q.grad, k.grad, v.grad, *(p.grad for p in trained)]

    got, expected = run("sdpa"), run("eager")
    scale = max(1.0, *(reference.abs().max().item() for reference in expected))
    for index, (value, reference) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(value, reference, atol=1e-4 * scale, rtol=1e-4, msg=lambda m, i=index: f"{i}: {m}")
