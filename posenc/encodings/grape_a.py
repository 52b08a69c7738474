"""GRAPE-A (Zhang et al., ICLR 2026, "Group Representational Position Encoding"), its additive form.

A position acts on q and k lifted to homogeneous coordinates by a unipotent G(n) = I + n ω A (A a rank-1 nilpotent
generator), which adds to each logit a bias linear in the distance: relative by construction, and ALiBi (a constant
gate) and FoX (a gate summed over the tokens between) are its exact special cases. This is the authors' key-gated
variant (their ``KeyGatedAdditiveBias``), which lets each key set how fast it fades:

    b_h(i, j) = −(i − j) · softplus(ω_h) · m_h · softplus(û_h · k_j / √D),   û_h = u_h / ‖u_h‖

with m_h ALiBi's slopes, ω_h initialised so that softplus(ω_h) = 1 and u_h ~ N(0, 1/D) (std 1/√D), as theirs. At
initialisation every gate is near softplus(0) = log 2, an ALiBi at 0.69 of its slopes. The bias reads each key and
each distance, so it is a content bias (eager, SDPA and the chunked content path); it is not of the form
r_i + t_j, so no fused kernel takes it. Their query-gated and path-integral variants are not carried over.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posenc.encodings import register
from posenc.encodings.alibi import alibi_slopes
from posenc.encodings.base import PositionalEncoding
from posenc.runtime import full_precision, softplus


@register
class GrapeA(PositionalEncoding):
    """Additive GRAPE, key-gated: ALiBi's linear bias with each key's rate set by softplus(û · k / √D)."""

    name = "grape_a"
    adds_content_bias = True

    def __init__(self, num_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, head_dim)
        self.register_buffer("slopes", torch.tensor(alibi_slopes(num_heads), dtype=torch.float32), persistent=False)
        self.omega = nn.Parameter(torch.full((num_heads,), math.log(math.expm1(1.0))))  # softplus(ω) = 1
        self.u = nn.Parameter(torch.randn(num_heads, head_dim) / math.sqrt(head_dim))

    @full_precision
    def gates(self, k: Tensor) -> Tensor:
        """softplus(û_h · k_j / √D) (B, H, Lk) fp32: how fast each key fades, per head."""
        direction = F.normalize(self.u.float(), dim=-1, eps=1e-6)
        return softplus(torch.einsum("bhld,hd->bhl", k.float(), direction) / math.sqrt(self.head_dim))

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
        distance = (q_pos[:, None] - k_pos[None, :]).clamp(min=0).to(torch.float32)  # future keys: masked anyway
        rate = softplus(self.omega.float()) * self.slopes  # (H,)
        return -distance * (rate[None, :, None] * self.gates(k))[:, :, None, :]  # (B, H, Lq, Lk)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, key-gated linear bias on ALiBi's slopes"
