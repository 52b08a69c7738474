"""FIRE (Li et al., 2024, "Functional Interpolation for Relative Positions Improves Long Context Transformers").

A learned function of the *normalised* relative position (the paper's Eq. 3–4), per layer, one output per head:

    b(i, j) = f_θ( ψ(i − j) / ψ(max(L, i)) ),   ψ(x) = log(c·x + 1)

f_θ is an MLP 1 → ``mlp_width`` (32) → H with ReLU; c > 0 is learned (initialised at 0.1); L is the learned
threshold (initialised at 512, parametrised as |multiplier| × 512 as in the paper's code) below which queries are
normalised by ψ(L) rather than by their own position ("progressive interpolation" then only starts past L, so
short sequences keep a plain relative bias). Beyond L the bias depends on the query position i as well as on
i − j: FIRE is not shift-invariant and not distance-only, so fast backends use its score_mod, not a table.

Its parameters feed an MLP, so none of the identities of ``learnable-bias-gradient.md`` applies: FIRE declares no
``bias_gradient_forms``, and ``auto`` keeps it off ``flex_learnable``. Nor can FlexAttention differentiate its
score_mod on a GPU: with the MLP's weights indexed by hidden unit, Inductor's joint-graph check refuses a trainable
tensor indexed several times per score; with one tensor per unit (as below) it fails to lower the gradients of the
scalars no index reads (torch 2.11, ``process_joint_outputs``); either way each score would add into ~100 trainable
values. FIRE declares ``score_mod_differentiable = False``: ``auto`` trains it through ``sdpa`` with its dense bias
in query chunks and evaluates it through ``flex``, and ``attention=flex`` refuses to train it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import Tensor, nn

from posenc.encodings import register
from posenc.encodings.base import PositionalEncoding
from posenc.encodings.forms import LengthScaled, ScoreMod
from posenc.runtime import full_precision

EPS = 1e-6  # keeps ψ(max(L, i)) away from 0 (the paper's code adds it to the normaliser)


@register
class FIRE(PositionalEncoding):
    """Learnable MLP over log-normalised relative positions."""

    name = "fire"
    adds_bias = True
    score_mod_differentiable = False  # Inductor cannot lower its backward (module docstring)
    # The paper trained at 2,048 with the threshold starting at 512: a quarter of the trained queries are normalised
    # by the threshold, the rest by their own position (the progressive interpolation training must see).
    length_settings: ClassVar[Mapping[str, LengthScaled]] = {
        "init_threshold": LengthScaled(1 / 4, "FIRE: 512 at L = 2,048", integer=False)
    }

    def __init__(
        self, num_heads: int, head_dim: int, mlp_width: int = 32, init_c: float = 0.1, init_threshold: float = 512.0
    ) -> None:
        super().__init__(num_heads, head_dim)
        self.mlp_width = mlp_width
        self.hidden = nn.Linear(1, mlp_width)
        self.out = nn.Linear(mlp_width, num_heads)
        self.c = nn.Parameter(torch.tensor(float(init_c)))
        self.register_buffer("init_threshold", torch.tensor(float(init_threshold)), persistent=False)
        self.threshold_multiplier = nn.Parameter(torch.tensor(1.0))

    def normalised(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """ψ(i − j) / ψ(max(L, i)) as fp32, broadcasting ``q_pos`` against ``k_pos`` (causal pairs only matter)."""
        c = self.c.float().abs()
        threshold = (self.threshold_multiplier.float() * self.init_threshold).abs()
        d = (q_pos - k_pos).to(torch.float32).clamp(min=0)
        normaliser = torch.log1p(c * torch.maximum(q_pos.to(torch.float32), threshold)) + EPS
        return torch.log1p(c * d) / normaliser

    @full_precision
    def mlp(self, x: Tensor) -> Tensor:
        """f_θ on fp32 inputs x (...) → (..., H)."""
        return self.out(torch.relu(self.hidden(x[..., None].to(self.hidden.weight.dtype)))).float()

    def bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        x = self.normalised(q_pos[:, None], k_pos[None, :])  # (Lq, Lk)
        return self.mlp(x).permute(2, 0, 1)  # (H, Lq, Lk)

    def score_mod(self, detached: bool = False, num_distances: int | None = None) -> ScoreMod:
        params = [
            self.c,
            self.threshold_multiplier,
            self.hidden.weight,
            self.hidden.bias,
            self.out.weight,
            self.out.bias,
        ]
        if detached:
            params = [p.detach() for p in params]
        c, multiplier, w1, b1, w2, b2 = params
        # The MLP unrolled over its hidden units, pointwise ops only (what a compiled score_mod needs): one tensor per
        # unit, each read whole or at the head, rather than an index by a constant unit number into shared weights.
        units = list(zip(w1[:, 0].unbind(), b1.unbind(), w2.unbind(1), strict=True))  # (), (), (H,) per unit
        init_threshold = self.init_threshold

        def fire(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            c_abs = c.float().abs()
            threshold = (multiplier.float() * init_threshold).abs()
            d = (q_idx - kv_idx).to(torch.float32).clamp(min=0)
            x = torch.log1p(c_abs * d) / (torch.log1p(c_abs * torch.maximum(q_idx.to(torch.float32), threshold)) + EPS)
            out = b2[h].float()
            for weight, offset, head_weights in units:
                out = out + head_weights[h].float() * torch.relu(weight.float() * x + offset.float())
            return score + out

        return fire

    def coverage(self, train_length: int) -> list[dict[str, object]]:
        threshold = float((self.threshold_multiplier.detach().float() * self.init_threshold).abs())
        if threshold < train_length - 1:
            return []
        return [
            {
                "parameter": "threshold",
                "unreached": 1,
                "of": 1,
                "note": f"the threshold starts at {threshold:g} ≥ L − 1 = {train_length - 1}: no trained query is "
                "normalised by its own position, so the progressive interpolation every longer window uses never "
                "trained",
            }
        ]

    def learned_settings(self) -> dict[str, float]:
        """The threshold as trained, and its multiplier (its sign: the threshold is |multiplier| × the initial one)."""
        multiplier = float(self.threshold_multiplier.detach().float())
        return {"threshold": abs(multiplier) * float(self.init_threshold), "threshold_multiplier": multiplier}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mlp_width={self.mlp_width}, init_threshold={float(self.init_threshold):g}"
