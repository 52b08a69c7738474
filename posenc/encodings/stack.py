"""A stack of schemes is itself a scheme: rotations apply in turn, biases add, score_mods add into one.

This is what makes hybrids like ``rope+alibi`` a config rather than code: the backbone and the backends see
one object honouring the contract and never learn that it has several members.
"""

from __future__ import annotations

import math

from torch import Tensor, nn

from posenc.encodings.base import PositionalEncoding
from posenc.encodings.forms import BiasGradientForm, ScoreMod, StickForm


class Stack(PositionalEncoding):
    """Several schemes applied together in one attention layer (and at the input, for absolute members)."""

    name = "stack"

    def __init__(self, members: list[PositionalEncoding]) -> None:
        if not members:
            raise ValueError("a stack needs at least one scheme")
        first = members[0]
        if any((m.num_heads, m.head_dim) != (first.num_heads, first.head_dim) for m in members):
            raise ValueError("every member of a stack must be built for the same num_heads and head_dim")
        super().__init__(num_heads=first.num_heads, head_dim=first.head_dim)
        self.parts = nn.ModuleList(members)
        finite = [m.max_positions for m in members if m.max_positions is not None]
        self.max_positions = min(finite) if finite else None
        # Instance attributes shadow the class-level declarations: a stack does what any member does.
        self.absolute = any(m.absolute for m in members)
        self.adds_bias = any(m.adds_bias for m in members)
        self.rotates = any(m.rotates for m in members)
        self.shift_invariant = all(m.shift_invariant for m in members)
        self.adds_content_bias = any(m.adds_content_bias for m in members)
        self.reads_scores = any(m.reads_scores for m in members)
        self.reads_layer_input = any(m.reads_layer_input for m in members)
        self.supplies_attention = any(m.supplies_attention for m in members)
        self.own_sink = next((m.own_sink for m in members if m.own_sink), "")
        self.score_mod_differentiable = all(m.score_mod_differentiable for m in members)
        self.qk_width = math.prod(m.qk_width for m in members)
        self.scales_with_length = any(m.scales_with_length for m in members)
        # The attention layer passes one scheme's features, so one member at most reads the layer's input. A member
        # that supplies its own attention has no softmax score for another member's bias to be added to: it stacks
        # with schemes that rotate q and k or embed the input only, and alone of its kind.
        readers = [m.label for m in members if m.reads_layer_input]
        if len(readers) > 1:
            raise ValueError(
                f"a stack holds at most one scheme that reads the layer's input, got {' and '.join(readers)}"
            )
        suppliers = [m for m in members if m.supplies_attention]
        if suppliers and (len(suppliers) > 1 or self.adds_bias or self.adds_content_bias):
            others = [
                m.label
                for m in members
                if m is not suppliers[0] and (m.adds_bias or m.adds_content_bias or m.supplies_attention)
            ]
            raise ValueError(
                f"{suppliers[0].label} supplies its own attention, with no softmax score for {', '.join(others)} to "
                "act on: stack it only with schemes that rotate q and k or embed the input"
            )

    @property
    def label(self) -> str:
        return "+".join(m.label for m in self.parts)

    @property
    def members(self) -> list[PositionalEncoding]:
        return [leaf for m in self.parts for leaf in m.members]

    @property
    def distance_only(self) -> bool:
        return all(m.distance_only for m in self.parts if m.adds_bias)

    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        for member in self.parts:
            x = member.embed(x, pos)
        return x

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        for member in self.parts:
            q, k = member.rotate(q, k, q_pos, k_pos)
        return q, k

    def bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
        biases = [b for b in (m.bias(q_pos, k_pos) for m in self.parts) if b is not None]
        if not biases:
            return None
        return sum(biases[1:], biases[0])

    def content_bias(
        self,
        q: Tensor,
        k: Tensor,
        q_pos: Tensor,
        k_pos: Tensor,
        scores: Tensor | None = None,
        features: Tensor | None = None,
    ) -> Tensor | None:
        biases = [m.content_bias(q, k, q_pos, k_pos, scores, features) for m in self.parts]
        biases = [b for b in biases if b is not None]
        if not biases:
            return None
        return sum(biases[1:], biases[0])

    def key_bias(self, k: Tensor, k_pos: Tensor, features: Tensor | None = None) -> Tensor | None:
        """The members' key terms summed, when every member with a content bias has one; ``None`` otherwise."""
        terms = [m.key_bias(k, k_pos, features) for m in self.parts if m.adds_content_bias]
        if not terms or any(term is None for term in terms):
            return None
        return sum(terms[1:], terms[0])

    def token_features(self, x: Tensor) -> Tensor | None:
        """The features of the one member that reads the layer's input (the others ignore ``features``)."""
        readers = [m for m in self.parts if m.reads_layer_input]
        return readers[0].token_features(x) if readers else None

    def _supplier(self) -> PositionalEncoding:
        return next(m for m in self.parts if m.supplies_attention)

    def attention_weights(
        self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, features: Tensor | None = None
    ) -> Tensor:
        return self._supplier().attention_weights(q, k, q_pos, k_pos, features)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, features: Tensor | None = None
    ) -> Tensor:
        return self._supplier().attend(q, k, v, q_pos, k_pos, features)

    def stick_form(self) -> StickForm | None:
        suppliers = [m for m in self.parts if m.supplies_attention]
        return suppliers[0].stick_form() if suppliers else None

    def score_mod(self, detached: bool = False, num_distances: int | None = None) -> ScoreMod | None:
        mods = [m.score_mod(detached=detached, num_distances=num_distances) for m in self.parts]
        mods = [mod for mod in mods if mod is not None]
        if not mods:
            return None
        if len(mods) == 1:
            return mods[0]

        # Each member's mod returns score + its bias, so chaining them adds every bias inside one kernel.
        def fused(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            for mod in mods:
                score = mod(score, b, h, q_idx, kv_idx)
            return score

        return fused

    def distance_bias(self, num_distances: int) -> Tensor:
        tables = [m.distance_bias(num_distances) for m in self.parts if m.adds_bias]
        return sum(tables[1:], tables[0])

    def bias_gradient_forms(self) -> list[BiasGradientForm] | None:
        # Biases add, so each member's parameters keep their own forms; one undeclared member undeclares the stack.
        forms: list[BiasGradientForm] = []
        for member in self.parts:
            member_forms = member.bias_gradient_forms()
            if member_forms is None:
                return None
            forms += member_forms
        return forms

    def set_context_scaling(self, method: str, factor: float, original_length: int) -> bool:
        scaled = [member.set_context_scaling(method, factor, original_length) for member in self.parts]
        return any(scaled)

    def learned_settings(self) -> dict[str, float]:
        return {f"{m.name}.{key}": value for m in self.members for key, value in m.learned_settings().items()}

    def constrain_(self) -> None:
        for member in self.parts:
            member.constrain_()

    def check_length(self, length: int) -> None:
        for member in self.parts:
            member.check_length(length)
