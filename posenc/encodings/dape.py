"""DAPE (Zheng et al., 2024, "DAPE: Data-Adaptive Positional Encoding for Length Extrapolation").

The positional bias is adapted to the content by a small MLP that reads, at every query–key pair, the attention
logits of all heads together with a position bias B (the paper's Eq. 6, with its KERPLE or ALiBi prior):

    scores = A + B + MLP([A; B]),   A_h = q_h · k_h / √d,   MLP: R^(2H) → R^(width) → R^H (LeakyReLU)

applied pointwise over (i, j), mixing heads but never positions, so causality is untouched. ``base`` names the
prior (any position-bias scheme of the registry, built with this scheme's heads: ``kerple_log`` as the paper's
main variant, or ``alibi``); its parameters, if any, train with the MLP. The bias depends on q and k, so it is a
content bias (eager, sdpa), and row i reads q_i and the keys up to i only. The MLP's correction is added to B
(the scheme keeps its prior, and the MLP learns what to change).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posenc.encodings import register, scheme_class
from posenc.encodings.base import PositionalEncoding
from posenc.runtime import full_precision


@register
class DAPE(PositionalEncoding):
    """A prior position bias plus an MLP over (logits, bias) of all heads."""

    name = "dape"
    adds_content_bias = True
    reads_scores = True

    def __init__(self, num_heads: int, head_dim: int, base: str = "kerple_log", mlp_width: int = 32) -> None:
        super().__init__(num_heads, head_dim)
        prior = scheme_class(base)(num_heads=num_heads, head_dim=head_dim)
        if not prior.adds_bias or prior.adds_content_bias or prior.rotates or prior.absolute:
            raise ValueError(f"dape's base must be a position-bias scheme (kerple_log, alibi, t5, ...), got {base!r}")
        self.prior = prior
        self.hidden = nn.Linear(2 * num_heads, mlp_width)
        self.out = nn.Linear(mlp_width, num_heads)

    def mlp(self, features: Tensor) -> Tensor:
        """The MLP over channels (B, 2H, Lq, Lk) → (B, H, Lq, Lk), fp32."""
        hidden = torch.einsum("bcqk,wc->bwqk", features, self.hidden.weight.float())
        hidden = F.leaky_relu(hidden + self.hidden.bias.float()[:, None, None])
        return torch.einsum("bwqk,hw->bhqk", hidden, self.out.weight.float()) + self.out.bias.float()[:, None, None]

    @full_precision
    def content_bias(
        self,
        q: Tensor,
        k: Tensor,
        q_pos: Tensor,
        k_pos: Tensor,
        scores: Tensor | None = None,
        features: Tensor | None = None,
    ) -> Tensor:
        logits = scores  # A, when the backend has it
        if logits is None:
            logits = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float()) / math.sqrt(q.shape[-1])
        prior = self.prior.bias(q_pos, k_pos).expand_as(logits)  # B (B, H, Lq, Lk)
        return prior + self.mlp(torch.cat((logits, prior), dim=1))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, base={self.prior.name}"
