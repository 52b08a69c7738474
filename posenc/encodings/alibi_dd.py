"""Data-dependent ALiBi: the forget gate of the Forgetting Transformer as a content-dependent attention bias.

Lin et al., 2025, "Forgetting Transformer: Softmax Attention with a Forget Gate" (FoX).

FoX gives every token t a scalar forget gate per head, f_t = σ(w_h · x_t + b_h), and adds the cumulative log-gates
between key and query to the scores (its Eq. 6–7):

    b_h(i, j) = Σ_{l = j+1}^{i} log f_{h,l} = F_h(i) − F_h(j),   F_h(p) = Σ_{l ≤ p} log f_{h,l}

With a constant gate log f_h = −m_h this is exactly ALiBi; a learned gate lets each token decide how much of the
past to forget. Here the gate is computed from the token's *key* vector of that head, f_t = σ(w_h · k_{h,t} + b_h),
rather than from x_t: k_{h,t} = W_{K,h} x_t, so this is FoX's gate with its weight restricted to
w_f = W_{K,h}ᵀ w_h (a vector in the span of that head's key projection, head_dim of the model's dim directions)
instead of a free vector. What it buys: everything the bias needs per token lives in the key, so a KV-cached
decoder, which calls attention with new queries over every cached key, computes exactly the same bias from the
cache alone. (In a stack with a rotary scheme the gate reads the rotated key, which makes it depend on absolute
position: such a stack is no longer shift-invariant.)

The gates' biases are initialised so that σ(b_h) = e^(−m_h) with ALiBi's slopes m_h and w_h = 0: the scheme
starts as ALiBi and learns its data dependence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posenc.encodings import register
from posenc.encodings.alibi import alibi_slopes
from posenc.encodings.base import PositionalEncoding
from posenc.runtime import full_precision


@register
class DataDependentALiBi(PositionalEncoding):
    """Per-token learned decay (a forget gate read from the key); cumulative log-gates as the bias."""

    name = "alibi_dd"
    adds_content_bias = True

    def __init__(self, num_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, head_dim)
        self.gate_weight = nn.Parameter(torch.zeros(num_heads, head_dim))
        # log σ(b) = −m  ⇔  b = −log(e^m − 1): the ALiBi slopes as the initial constant decay.
        slopes = torch.tensor(alibi_slopes(num_heads), dtype=torch.float64)
        self.gate_bias = nn.Parameter((-torch.log(torch.expm1(slopes))).float())

    @full_precision
    def log_gates(self, k: Tensor) -> Tensor:
        """Log f (B, H, Lk) in fp32 from keys (B, H, Lk, D)."""
        logits = torch.einsum("bhkd,hd->bhk", k.float(), self.gate_weight.float()) + self.gate_bias.float()[:, None]
        return F.logsigmoid(logits)

    def key_bias(self, k: Tensor, k_pos: Tensor) -> Tensor:
        """−F(k_pos[j]) (B, H, Lk): along a row the bias F(i) − F(j) varies only through the key's −F(j)."""
        return -self.log_gates(k).cumsum(dim=-1)

    def content_bias(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, scores: Tensor | None = None) -> Tensor:
        cumulative = -self.key_bias(k, k_pos)  # F(k_pos[j]) (B, H, Lk)
        # F(q_pos[i]) is the cumulative sum up to the last key at or before the query: the query's own key.
        last = torch.searchsorted(k_pos, q_pos, right=True) - 1  # (Lq,), ≥ 0 since each query sees itself
        at_query = cumulative[..., last.clamp(min=0)]  # (B, H, Lq)
        return at_query[..., :, None] - cumulative[..., None, :]  # (B, H, Lq, Lk); ≤ 0 on causal pairs

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, initial decay=ALiBi slopes (σ(b) = e^-m), gate from k"
