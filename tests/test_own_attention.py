"""Schemes that supply their own attention: the contract (parametrised over the registry by declaration), the
refusals, auto's and cached decoding's choice, and stick-breaking's blocked path against its dense reference and its
formula on hand-computed values (PaTH's are in tests/test_fox_path.py; every scheme's fast path against its
reference, values and gradients, in tests/test_fast_attention.py)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import HEAD_DIM, HEADS, SCHEMES, SUPPLIED_SCHEMES, layer_features, make
from helpers import encoding_configs
from torch.utils._python_dispatch import TorchDispatchMode

import posenc.attention.triton_table as triton_table
from posenc.attention import available_backends, decoding_backend, get_backend
from posenc.attention.auto import choose
from posenc.encodings.stick_breaking import stick_breaking_attention
from posenc.lane.cases import cases, not_on_flex, skipped

ROTARY = next(n for n in SCHEMES if make(n).rotates and make(n).shift_invariant and not make(n).adds_bias)  # a rotation
CASES = [*SUPPLIED_SCHEMES, *(f"{ROTARY}+{name}" for name in SUPPLIED_SCHEMES)]
# Every config whose scheme declares stick-breaking's attention (both forms), and each such registered scheme under a
# rotation: by declaration, not by name.
STICK_FORMS = encoding_configs(HEADS, HEAD_DIM, lambda enc: enc.stick_form() is not None)
STICK_FORMS += [{"name": f"{ROTARY}+{name}"} for name in SUPPLIED_SCHEMES if make(name).stick_form() is not None]


def _grads(attend, name: str, length: int, first_pos: int = 0) -> list[torch.Tensor]:
    """Output and the gradients of q, k, v (through the scheme's rotation) under a non-uniform output gradient."""
    torch.manual_seed(7)
    enc = make(name)
    pos = torch.arange(first_pos, first_pos + length)
    q, k, v = (torch.randn(2, HEADS, length, HEAD_DIM, requires_grad=True) for _ in range(3))
    features = layer_features(enc, 2, length)
    rotated_q, rotated_k = enc.rotate(q, k, pos, pos)
    out = attend(rotated_q, rotated_k, v, enc, pos, pos, features)
    (out * torch.randn(out.shape)).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def _dense(q, k, v, enc, q_pos, k_pos, features=None) -> torch.Tensor:
    return get_backend("eager")(q, k, v, enc, q_pos, k_pos, features=features)


def test_some_registered_schemes_supply_their_own_attention() -> None:
    assert {"path", "stick_breaking"} <= set(SUPPLIED_SCHEMES)  # otherwise the tests below would test less


@pytest.mark.parametrize("name", CASES)
def test_weights_are_a_causal_distribution_in_fp32(name: str) -> None:
    enc = make(name)
    pos = torch.arange(20)
    q, k = enc.rotate(torch.randn(2, HEADS, 20, HEAD_DIM), torch.randn(2, HEADS, 20, HEAD_DIM), pos, pos)
    weights = enc.attention_weights(q, k, pos, pos, layer_features(enc, 2, 20))
    assert weights.dtype == torch.float32 and weights.shape == (2, HEADS, 20, 20)
    assert torch.all(weights >= 0) and torch.all(weights.triu(diagonal=1) == 0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, HEADS, 20))
    assert enc.bias(pos, pos) is None and enc.score_mod() is None  # nothing for a softmax backend to apply


@pytest.mark.parametrize("name", CASES)
def test_auto_and_cached_decoding_run_the_schemes_own_attention_and_sdpa_refuses_it(name: str) -> None:
    enc = make(name)
    assert choose(enc, is_cuda=True) == choose(enc, is_cuda=False) == "scheme"
    # A backend without query suffixes hands cached decoding to the scheme's attention, never to a softmax.
    assert {decoding_backend(backend, enc) for backend in ("flex", "flex_learnable", "triton", "auto")} == {"scheme"}
    expected = _grads(_dense, name, 29)
    for value, reference in zip(_grads(get_backend("scheme"), name, 29), expected, strict=True):
        torch.testing.assert_close(value, reference, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="attention=sdpa runs softmax"):
        _grads(get_backend("sdpa"), name, 29)


@pytest.mark.parametrize("name", CASES)
def test_query_suffix_over_cached_keys_gives_the_full_rows(name: str) -> None:
    enc = make(name)
    pos = torch.arange(100, 140)
    q, k, v = (torch.randn(2, HEADS, 40, HEAD_DIM) for _ in range(3))
    features = layer_features(enc, 2, 40)  # cached beside the keys: every key's, whatever the queries
    with torch.no_grad():
        full = enc.attend(q, k, v, pos, pos, features)
        weights = enc.attention_weights(q, k, pos, pos, features)
        for start in (39, 23, 1):
            rows = enc.attend(q[:, :, start:], k, v, pos[start:], pos, features)
            torch.testing.assert_close(rows, full[:, :, start:], atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(
                enc.attention_weights(q[:, :, start:], k, pos[start:], pos, features), weights[:, :, start:]
            )


@pytest.mark.parametrize("name", SUPPLIED_SCHEMES)
def test_shift_of_every_position_changes_nothing(name: str) -> None:
    torch.testing.assert_close(_grads(_dense, name, 30), _grads(_dense, name, 30, first_pos=1000))


@pytest.mark.parametrize("name", SUPPLIED_SCHEMES)
def test_a_later_token_never_changes_an_earlier_row(name: str) -> None:
    enc = make(name)
    pos = torch.arange(12)
    q, k, v = (torch.randn(1, HEADS, 12, HEAD_DIM) for _ in range(3))
    x = torch.randn(1, 12, HEADS * HEAD_DIM)  # the layer's input, for a scheme that reads it
    changed_k, changed_v, changed_x = k.clone(), v.clone(), x.clone()
    for tensor in (changed_k, changed_v):
        tensor[:, :, 8] += 1.0
    changed_x[:, 8] += 1.0
    with torch.no_grad():
        features, changed_features = (enc.token_features(t) for t in (x, changed_x))
        before = enc.attend(q, k, v, pos, pos, features)
        after = enc.attend(q, changed_k, changed_v, pos, pos, changed_features)
    torch.testing.assert_close(before[:, :, :8], after[:, :, :8])
    assert not torch.allclose(before[:, :, 8:], after[:, :, 8:])


# triton runs stick-breaking's attention in a fused kernel (tests/test_triton_stick.py) and refuses every other.
@pytest.mark.parametrize(
    "name, backend",
    [
        (name, backend)
        for name in SUPPLIED_SCHEMES
        for backend in ("sdpa", "flex", "flex_learnable", "triton")
        if backend != "triton" or make(name).stick_form() is None
    ],
)
def test_softmax_backends_refuse_it_in_one_line(name: str, backend: str) -> None:
    enc = make(name)
    pos = torch.arange(8)
    q = torch.randn(1, HEADS, 8, 16)
    call = triton_table.check_supported if backend == "triton" else get_backend(backend)
    with pytest.raises(ValueError, match=rf"attention={backend} runs softmax") as refusal:
        call(q, q, q, enc, pos, pos)
    assert "\n" not in str(refusal.value) and "attention=auto, scheme or eager" in str(refusal.value)


def test_the_scheme_backend_refuses_a_softmax_scheme_and_every_backend_is_covered() -> None:
    pos = torch.arange(8)
    q = torch.randn(1, HEADS, 8, HEAD_DIM)
    with pytest.raises(ValueError, match="attention=scheme runs a scheme's own attention, and alibi supplies none"):
        get_backend("scheme")(q, q, q, make("alibi"), pos, pos)
    # Every backend either refuses such a scheme (above) or runs it (eager, scheme, auto): none is left unchecked.
    assert set(available_backends()) == {"sdpa", "flex", "flex_learnable", "triton", "eager", "scheme", "auto"}


@pytest.mark.parametrize("name", SUPPLIED_SCHEMES)
def test_a_stack_adds_no_bias_and_no_second_attention_to_it(name: str) -> None:
    biased = next(n for n in SCHEMES if make(n).adds_bias)
    with pytest.raises(ValueError, match=f"{name} supplies its own attention, with no softmax score for {biased} "):
        make(f"{biased}+{name}")
    other = next(n for n in SUPPLIED_SCHEMES if n != name)
    with pytest.raises(ValueError, match=f"{name} supplies its own attention, with no softmax score for {other} "):
        make(f"{name}+{other}")
    assert make(f"{ROTARY}+{name}").supplies_attention


@pytest.mark.parametrize("name", SUPPLIED_SCHEMES)
def test_the_lane_says_why_it_compiles_nothing_for_it(name: str) -> None:
    assert "supplies its own attention" in not_on_flex(make(name)) and "supplies its own attention" in skipped()[name]
    with pytest.raises(ValueError, match=f"nothing to compile for {name}: it supplies its own attention"):
        cases([name])


# --- stick-breaking's blocked path ------------------------------------------------------------------------------


def _form_grads(attend, spec: dict, length: int, first_pos: int = 5) -> list[torch.Tensor]:
    """Output and the gradients of q, k, v and every parameter (made to matter) of a config's scheme."""
    torch.manual_seed(7)
    enc = make(spec["name"], **{key: value for key, value in spec.items() if key != "name"})
    with torch.no_grad():
        for parameter in enc.parameters():
            parameter.add_(torch.randn_like(parameter))
    pos = torch.arange(first_pos, first_pos + length)
    q, k, v = (torch.randn(2, HEADS, length, HEAD_DIM, requires_grad=True) for _ in range(3))
    out = attend(*enc.rotate(q, k, pos, pos), v, enc, pos, pos, None)
    return [out, *torch.autograd.grad((out * torch.randn(out.shape)).sum(), [q, k, v, *enc.parameters()])]


@pytest.mark.parametrize("spec", STICK_FORMS, ids=lambda spec: "-".join(map(str, spec.values())))
@pytest.mark.parametrize("tile", [(1, 1), (4, 3), (7, 16), (16, 7), (37, 64), None])
@pytest.mark.parametrize("length", [37, 64])
def test_blocked_form_matches_the_dense_reference_values_and_gradients(
    spec: dict, tile: tuple[int, int] | None, length: int
) -> None:
    # Tiles of one score, taller than wide, wider than tall, a whole window, and the default: the stick carried
    # from tile to tile of keys, and rows whose mask spans several tiles. The form's head vector and norm ride along.
    expected = _form_grads(_dense, spec, length)

    def blocked(q, k, v, enc, q_pos, k_pos, features):
        if tile is None:
            return enc.attend(q, k, v, q_pos, k_pos, features)
        form = enc.stick_form()
        return form.finish(stick_breaking_attention(q, k, v, q_pos, k_pos, form.head_bias, tile=tile))

    for value, reference in zip(_form_grads(blocked, spec, length), expected, strict=True):
        torch.testing.assert_close(value, reference, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("scale", [8.0, 40.0])
def test_large_scores_stay_finite_and_match_the_reference(scale: float) -> None:
    # Scores of hundreds: sticks taken whole (σ(−z) underflows), products that underflow; no inf or NaN anywhere.
    enc = make("stick_breaking")
    pos = torch.arange(50)
    grads = []
    for attend in (_dense, lambda q, k, v, enc, q_pos, k_pos: enc.attend(q, k, v, q_pos, k_pos)):
        torch.manual_seed(3)
        q, k, v = (torch.randn(2, HEADS, 50, HEAD_DIM) for _ in range(3))
        q, k = (t.mul(scale).requires_grad_() for t in (q, k))
        out = attend(q, k, v, enc, pos, pos)
        (out * torch.randn(out.shape)).sum().backward()
        grads.append([out.detach(), q.grad, k.grad])
    for value, reference in zip(*grads, strict=True):
        assert torch.isfinite(value).all()
        torch.testing.assert_close(value, reference, atol=1e-4 * max(1.0, reference.abs().max().item()), rtol=1e-3)


def test_blocked_path_never_holds_more_than_a_tile_of_scores() -> None:
    # No tensor of the forward or the backward spans more than a tile of `rows` queries × `keys` keys (or the
    # (B, H, L, D) inputs and outputs), where the dense reference's are (B, H, L, L).
    batch, length, rows, keys = 2, 96, 8, 16
    sizes = []

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            sizes.extend(t.numel() for t in (out if isinstance(out, tuple | list) else [out]) if torch.is_tensor(t))
            return out

    q, k, v = (torch.randn(batch, HEADS, length, HEAD_DIM, requires_grad=True) for _ in range(3))
    pos = torch.arange(length)
    with Sizes():
        stick_breaking_attention(q, k, v, pos, pos, tile=(rows, keys)).square().sum().backward()
    assert sizes and max(sizes) <= batch * HEADS * max(rows * keys, length * HEAD_DIM)


def test_bf16_autocast_is_close_to_fp32_and_keeps_the_arithmetic_in_fp32() -> None:
    enc = make("stick_breaking")
    pos = torch.arange(300)
    q, k, v = (torch.randn(2, HEADS, 300, HEAD_DIM) for _ in range(3))
    reference = enc.attend(q, k, v, pos, pos)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # fp32 inputs under autocast: the same arithmetic, in fp32.
        torch.testing.assert_close(enc.attend(q, k, v, pos, pos), reference, atol=1e-6, rtol=1e-6)
        low = [t.bfloat16().requires_grad_() for t in (q, k, v)]
        out = enc.attend(*low, pos, pos)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference, atol=3e-2, rtol=3e-2)
    out.float().square().sum().backward()
    assert all(t.grad.dtype == torch.bfloat16 and torch.isfinite(t.grad).all() for t in low)


# --- stick-breaking's formula on hand-computed values --------------------------------------------------------


def test_stick_breaking_weights_by_hand() -> None:
    # One head of width 1 (scale 1), z_ij = q_i · k_j. σ(log 3) = 3/4, σ(0) = 1/2, σ(−log 3) = 1/4.
    enc = make("stick_breaking", heads=1, head_dim=1)
    log3 = math.log(3.0)
    q = torch.tensor([0.0, -1.0, 1.0, 1.0]).view(1, 1, 4, 1)
    k = torch.tensor([log3, 0.0, log3, 5.0]).view(1, 1, 4, 1)
    pos = torch.arange(4)
    expected = torch.tensor(
        [
            [1.0, 0, 0, 0],  # no earlier key: the whole stick stays on the query's own value
            [1 / 4, 3 / 4, 0, 0],  # β_10 = σ(−log 3) = 1/4; the rest, 3/4, to token 1
            [3 / 4 * 1 / 2, 1 / 2, 1 / 8, 0],  # nearest first: β_21 = 1/2, then β_20 = 3/4 of the half left
            [3 / 4 * 1 / 4 * 1 / 2, 1 / 2 * 1 / 4, 3 / 4, 1 / 4 * 1 / 2 * 1 / 4],  # k_3 = 5 is never read
        ]
    )
    torch.testing.assert_close(enc.attention_weights(q, k, pos, pos)[0, 0], expected)
    v = torch.tensor([1.0, 10.0, 100.0, 1000.0]).view(1, 1, 4, 1)
    outputs = torch.tensor([1.0, 1 / 4 + 30 / 4, 3 / 8 + 5 + 100 / 8, 3 / 32 + 10 / 8 + 75 + 1000 / 32])
    for attend in (enc.attend, lambda *args: _dense(*args[:3], enc, *args[3:])):
        torch.testing.assert_close(attend(q, k, v, pos, pos)[0, 0, :, 0], outputs)


def test_stick_breaking_trained_form_puts_the_remainder_on_a_head_vector_and_normalises_heads() -> None:
    """The form the paper's models trained with: the remainder on a learned (H, D) vector, each head normalised."""
    enc = make("stick_breaking", heads=1, head_dim=1, remainder="head_bias")
    log3 = math.log(3.0)
    q = torch.tensor([0.0, -1.0, 1.0, 1.0]).view(1, 1, 4, 1)
    k = torch.tensor([log3, 0.0, log3, 5.0]).view(1, 1, 4, 1)
    v = torch.tensor([1.0, 10.0, 100.0, 1000.0]).view(1, 1, 4, 1)
    pos = torch.arange(4)
    with torch.no_grad():
        enc.head_bias.fill_(-7.0)
    # The weights by hand above less their diagonal (no key takes the remainder), which goes to −7 instead.
    remainder = torch.tensor([1.0, 3 / 4, 1 / 8, 1 / 32])
    outputs = torch.tensor([0.0, 1 / 4, 3 / 8 + 5, 3 / 32 + 10 / 8 + 75]) - 7.0 * remainder
    for attend in (enc.attend, lambda *args: _dense(*args[:3], enc, *args[3:])):
        torch.testing.assert_close(attend(q, k, v, pos, pos)[0, 0, :, 0], outputs)
    # Its values and every gradient against the dense form: the blocked-form test above, over every config.
    torch.manual_seed(3)
    trained = make("stick_breaking", remainder="head_bias", head_norm=True)
    for parameter in trained.parameters():
        parameter.data.normal_()
    pos = torch.arange(30)
    q, k, v = (torch.randn(2, HEADS, 30, HEAD_DIM) for _ in range(3))
    with torch.no_grad():  # new queries over cached keys: the full window's rows
        full, suffix = trained.attend(q, k, v, pos, pos), trained.attend(q[:, :, 20:], k, v, pos[20:], pos)
    torch.testing.assert_close(suffix, full[:, :, 20:], atol=1e-6, rtol=1e-5)
