"""The backbone: shapes, causality, shift invariance, extrapolation, and composed schemes (schedules, stacks)."""

from __future__ import annotations

import pytest
import torch
from conftest import RELATIVE_SCHEMES, SCHEMES, SHIFT_INVARIANT

from posenc.encodings import build
from posenc.encodings.base import PositionalEncoding
from posenc.encodings.stack import Stack
from posenc.model import Decoder

VOCAB = 50
HYBRIDS = ["rope+alibi", ["rope", "rope", "rope", "nope"], ["rope+alibi", "nope"]]


def tiny(encoding, **kwargs) -> Decoder:
    if encoding == "learned":
        encoding = {"name": "learned", "max_positions": 32}
    # auto: sdpa on CPU for every scheme but one that supplies its own attention, which runs its own (scheme)
    kwargs = {"vocab_size": VOCAB, "dim": 32, "depth": 2, "heads": 4, "attention": "auto", **kwargs}
    return Decoder(encoding=encoding, **kwargs).eval()


@pytest.mark.parametrize("name", [*SCHEMES, *HYBRIDS], ids=str)
def test_output_shape(name) -> None:
    model = tiny(name, depth=4)
    assert model(torch.randint(0, VOCAB, (3, 17))).shape == (3, 17, VOCAB)


@pytest.mark.parametrize("name", [*SCHEMES, *HYBRIDS], ids=str)
def test_causality(name) -> None:
    model = tiny(name, depth=4)
    tokens = torch.randint(0, VOCAB, (2, 24))
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % VOCAB
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10], atol=1e-6, rtol=0)
    assert not torch.allclose(before[:, 10:], after[:, 10:])


@pytest.mark.parametrize("name", [*SHIFT_INVARIANT, *HYBRIDS], ids=str)
def test_relative_schemes_are_shift_invariant(name) -> None:
    model = tiny(name, depth=4)
    tokens = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), model(tokens, offset=300), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", [n for n in RELATIVE_SCHEMES if n not in SHIFT_INVARIANT] or [None], ids=str)
def test_a_scheme_that_says_it_is_not_shift_invariant_is_not(name) -> None:
    if name is None:
        pytest.skip("every scheme acting in attention is shift-invariant")
    model = tiny(name, depth=2)
    tokens = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        assert not torch.allclose(model(tokens), model(tokens, offset=300), atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["sinusoidal", "learned"])
def test_absolute_schemes_are_not_shift_invariant(name: str) -> None:
    model = tiny(name)
    tokens = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        assert not torch.allclose(model(tokens), model(tokens, offset=5), atol=1e-4)


@pytest.mark.parametrize("name", [s for s in SCHEMES if s != "learned"])
def test_runs_at_four_times_the_training_length(name: str) -> None:
    model = tiny(name)
    out = model(torch.randint(0, VOCAB, (1, 4 * 32)))
    assert torch.isfinite(out).all()


def test_learned_refuses_longer_sequences_clearly() -> None:
    model = tiny("learned")
    model(torch.randint(0, VOCAB, (1, 32)))
    with pytest.raises(ValueError, match="learned supports at most 32 positions but got a sequence of 128"):
        model(torch.randint(0, VOCAB, (1, 128)))


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flex", "auto"])
@pytest.mark.parametrize("name", ["alibi", "rope", "t5", "rope+alibi"])
def test_model_backends_agree(name: str, backend: str) -> None:
    torch.manual_seed(3)
    reference = tiny(name, attention="eager")
    model = tiny(name, attention=backend)
    model.load_state_dict(reference.state_dict())
    tokens = torch.randint(0, VOCAB, (2, 21))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens), atol=1e-4, rtol=1e-4)


# --- composed schemes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["alibi", "rope", "kerple_log", "t5", "xpos"])
def test_schedule_of_one_equals_the_scheme(name: str) -> None:
    torch.manual_seed(5)
    single = tiny(name)
    schedule = tiny([name])
    schedule.load_state_dict(single.state_dict())
    tokens = torch.randint(0, VOCAB, (2, 15))
    with torch.no_grad():
        assert torch.equal(schedule(tokens), single(tokens))


@pytest.mark.parametrize("name", ["alibi", "rope", "kerple_log", "t5", "xpos"])
def test_stack_of_one_equals_the_scheme(name: str) -> None:
    # One shared instance, used bare by one model and wrapped in a one-member Stack by the other.
    enc = build(name, num_heads=4, head_dim=8)
    torch.manual_seed(5)
    single = tiny(enc)
    stacked = tiny(Stack([enc]))
    stacked.load_state_dict(single.state_dict(), strict=False)
    tokens = torch.randint(0, VOCAB, (2, 15))
    with torch.no_grad():
        assert torch.equal(stacked(tokens), single(tokens))


def test_stack_of_one_absolute_scheme_equals_the_scheme() -> None:
    enc = build("sinusoidal", num_heads=4, head_dim=8)
    single, stacked = tiny(enc), tiny(Stack([enc]))
    stacked.load_state_dict(single.state_dict())
    tokens = torch.randint(0, VOCAB, (2, 15))
    with torch.no_grad():
        assert torch.equal(stacked(tokens), single(tokens))


def test_stack_bias_is_the_sum_and_rotation_is_in_turn() -> None:
    stack = build("rope+alibi+t5", num_heads=4, head_dim=8)
    rope, alibi, t5 = stack.parts
    pos = torch.arange(30)
    torch.testing.assert_close(stack.bias(pos, pos), alibi.bias(pos, pos) + t5.bias(pos, pos))
    q, k = torch.randn(1, 4, 30, 8), torch.randn(1, 4, 30, 8)
    expected = rope.rotate(q, k, pos, pos)
    for got, want in zip(stack.rotate(q, k, pos, pos), expected, strict=True):
        assert torch.equal(got, want)
    assert stack.label == "rope+alibi+t5" and stack.adds_bias and stack.rotates and stack.learnable_bias
    assert build("rope+nope", num_heads=4, head_dim=8).bias(pos, pos) is None


def test_stack_score_mod_is_one_fused_sum() -> None:
    stack = build("alibi+kerple_log", num_heads=4, head_dim=8)
    q_idx, k_idx = torch.tril_indices(20, 20)
    fused = stack.score_mod()(torch.zeros(q_idx.shape), torch.tensor(0), torch.tensor(2), q_idx, k_idx)
    torch.testing.assert_close(fused, stack.bias(torch.arange(20), torch.arange(20))[2, q_idx, k_idx])


def test_stack_options_go_to_their_member() -> None:
    stack = build("rope+alibi", num_heads=4, head_dim=8, rope={"base": 500})
    assert stack.parts[0].base == 500
    with pytest.raises(ValueError, match="nested under a member's name"):
        build("rope+alibi", num_heads=4, head_dim=8, base=500)


def test_stack_max_positions_is_the_smallest() -> None:
    assert build("learned+alibi", num_heads=4, head_dim=8, learned={"max_positions": 64}).max_positions == 64


def test_schedule_gives_each_layer_its_entry() -> None:
    model = tiny(["rope", "rope", "rope", "nope"], depth=8)
    assert [e.name for e in model.layer_encodings] == ["rope", "rope", "rope", "nope"] * 2
    assert model.label == "rope×3,nope"
    stacked = tiny(["rope+alibi", "nope"], depth=3)
    assert [e.label for e in stacked.layer_encodings] == ["rope+alibi", "nope", "rope+alibi"]
    assert len({id(e) for e in model.layer_encodings}) == 8  # each layer owns its instance


def test_schedule_layers_really_use_their_entry() -> None:
    # Replacing the NoPE layer's scheme changes the output; the model is not ignoring the schedule.
    torch.manual_seed(0)
    model = tiny(["rope", "nope"], depth=2)
    tokens = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        before = model(tokens)
        model.blocks[1].attn.encoding = build("alibi", num_heads=4, head_dim=8)
        assert not torch.allclose(before, model(tokens))


def test_schedule_options_are_keyed_by_member() -> None:
    model = tiny({"name": ["rope", "alibi"], "rope": {"base": 123}}, depth=2)
    assert model.layer_encodings[0].base == 123


def test_schedule_options_must_name_a_member() -> None:
    with pytest.raises(ValueError, match="must be nested under a member's name"):
        tiny({"name": ["rope", "nope"], "base": 500})


def test_schedule_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="absolute scheme 'learned' cannot sit in a per-layer schedule"):
        tiny(["rope", "learned"])
    with pytest.raises(ValueError, match="unknown positional scheme 'ropee'; available: alibi"):
        tiny(["rope", "ropee"])
    with pytest.raises(ValueError, match="empty per-layer schedule"):
        tiny([])
    with pytest.raises(ValueError, match="empty scheme name"):
        tiny("rope+")


def test_constrain_reaches_every_layer() -> None:
    model = tiny("kerple_log", depth=3)
    for enc in model.layer_encodings:
        with torch.no_grad():
            enc.r1.fill_(-3.0)
    model.constrain_()
    assert all(torch.all(enc.r1 == 0.01) for enc in model.layer_encodings)


def test_gpt2_init_sizes_the_backbone_and_ties_the_head() -> None:
    model = Decoder("nope", vocab_size=256, dim=128, depth=4, heads=4)
    assert model.head.weight is model.token_embedding.weight
    assert model.token_embedding.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    residual = 0.02 / (2 * 4) ** 0.5  # GPT-2's residual projections, scaled by 1/√(2·depth)
    assert model.blocks[1].attn.proj.weight.std().item() == pytest.approx(residual, rel=0.05)
    assert model.blocks[1].mlp[-1].weight.std().item() == pytest.approx(residual, rel=0.05)


def test_pytorch_init_keeps_module_defaults_with_an_untied_head() -> None:
    model = Decoder("nope", vocab_size=256, dim=128, depth=4, heads=4, init="pytorch", tie_embeddings=False)
    assert model.head.weight is not model.token_embedding.weight
    assert model.token_embedding.weight.std().item() == pytest.approx(1.0, rel=0.05)  # nn.Embedding: N(0, 1)
    for linear, fan_in in ((model.blocks[0].attn.qkv, 128), (model.blocks[1].mlp[-1], 512), (model.head, 128)):
        weight = linear.weight
        assert weight.abs().max().item() <= fan_in**-0.5  # nn.Linear: uniform in ±1/√fan_in
        assert weight.std().item() == pytest.approx((3 * fan_in) ** -0.5, rel=0.05)


@pytest.mark.parametrize("name", SCHEMES)
def test_init_leaves_scheme_parameters_alone(name: str) -> None:
    """Schemes initialise their own parameters: the backbone's init must not touch them."""
    states = []
    for init in ("gpt2", "pytorch"):
        torch.manual_seed(0)
        model = tiny(name, init=init, tie_embeddings=False)
        schemes = [(n, m) for n, m in model.named_modules() if isinstance(m, PositionalEncoding)]
        states.append({f"{n}.{k}": v for n, m in schemes for k, v in m.state_dict().items()})
    assert states[0].keys() == states[1].keys()
    for key, value in states[0].items():
        torch.testing.assert_close(value, states[1][key], atol=0, rtol=0)


def test_init_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match=r"model init must be one of gpt2, pytorch, got 'xavier'"):
        tiny("nope", init="xavier")
    with pytest.raises(ValueError, match=r"set model\.tie_embeddings=false with it"):
        tiny("nope", init="pytorch")
