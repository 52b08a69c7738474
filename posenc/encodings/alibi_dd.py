"""Data-dependent ALiBi: the Forgetting Transformer's forget gate (``fox.py``) read from each head's key.

Lin et al., ICLR 2025, "Forgetting Transformer: Softmax Attention with a Forget Gate" (FoX). The bias is FoX's,
c(i) − c(j) with c(t) = Σ_{l ≤ t} log f_l (``ForgetGateBias``); only the gate's source differs. Here it is computed
from the token's *key* vector of that head, f_t = σ(w_h · k_{h,t} + b_h), rather than from x_t: k_{h,t} = W_{K,h} x_t,
so this is FoX's gate with its weight restricted to w_f = W_{K,h}ᵀ w_h (a vector in the span of that head's key
projection, head_dim of the model's dim directions) instead of a free vector. What it buys: everything the bias
needs per token lives in the key, so a KV cache needs nothing beside the keys. (In a stack with a rotary scheme the
gate reads the rotated key, which makes it depend on absolute position: such a stack is no longer shift-invariant;
``rope+fox`` is.)

The gates' biases are initialised so that σ(b_h) = e^(−m_h) with ALiBi's slopes m_h and w_h = 0: the scheme
starts as ALiBi and learns its data dependence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posenc.encodings import register
from posenc.encodings.fox import ForgetGateBias, alibi_gate_bias
from posenc.runtime import full_precision


@register
class DataDependentALiBi(ForgetGateBias):
    """Per-token learned decay (a forget gate read from the key); cumulative log-gates as the bias."""

    name = "alibi_dd"

    def __init__(self, num_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, head_dim)
        self.gate_weight = nn.Parameter(torch.zeros(num_heads, head_dim))
        self.gate_bias = nn.Parameter(alibi_gate_bias(num_heads))  # the ALiBi slopes as the initial constant decay

    @full_precision
    def log_gates(self, k: Tensor, features: Tensor | None = None) -> Tensor:
        """Log f (B, H, Lk) in fp32 from keys (B, H, Lk, D)."""
        logits = torch.einsum("bhkd,hd->bhk", k.float(), self.gate_weight.float()) + self.gate_bias.float()[:, None]
        return F.logsigmoid(logits)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, initial decay=ALiBi slopes (σ(b) = e^-m), gate from k"
