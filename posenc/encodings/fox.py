"""FoX, the Forgetting Transformer's forget gate as published: read from the layer's input.

Lin et al., ICLR 2025, "Forgetting Transformer: Softmax Attention with a Forget Gate".

Every token t has a scalar forget gate per head, f_{h,t} = σ(w_h · x_t + b_h), with x_t the attention layer's input
(the residual stream after the attention norm, the vector q, k and v are projected from). The attention adds the
cumulative log-gates between key and query to the scores (the paper's Eq. 6–7):

    s_ij + Σ_{l = j+1}^{i} log f_{h,l} = s_ij + c_h(i) − c_h(j),   c_h(t) = Σ_{l ≤ t} log f_{h,l}

With a constant gate log f_h = −m_h this is exactly ALiBi. ``ForgetGateBias`` below is that bias for any source of
gates; ``fox`` reads them from x (its ``token_features``: the log-gates (B, L, H), which a KV cache keeps beside
the keys), ``alibi_dd`` (``alibi_dd.py``) from each head's key. The bias is c(i) − c(j): along a softmax row it varies
only through the key's −c(j), its ``key_bias``, so the fused path folds it into one extra channel of q·kᵀ.

Initialisation: ``init="paper"`` (the default) follows the published code's full gate, a linear layer of the model
width initialised like every other (weights N(0, 0.02), bias 0): every gate starts near σ(0) = 1/2, a decay of
log 2 per token. ``init="alibi"`` starts from w = 0 and σ(b_h) = e^(−m_h) with ALiBi's slopes m_h instead, as
``alibi_dd`` does.

A gate read from x rather than from a rotated key makes no use of positions: FoX is shift invariant, and stays so in
a stack with RoPE (``rope+fox``). The paper's "Pro" block (output gate, QK-norm, key and value shift) changes the
architecture, not the positions, and is not part of this scheme.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posenc.encodings import register
from posenc.encodings.alibi import alibi_slopes
from posenc.encodings.base import PositionalEncoding
from posenc.runtime import full_precision

INITS = ("paper", "alibi")
GATE_STD = 0.02  # the published code's initializer_range for the gate's linear layer


def alibi_gate_bias(num_heads: int) -> Tensor:
    """b_h with log σ(b_h) = −m_h, ALiBi's slope: b = −log(e^m − 1). The gate's bias for a start as ALiBi."""
    slopes = torch.tensor(alibi_slopes(num_heads), dtype=torch.float64)
    return (-torch.log(torch.expm1(slopes))).float()


class ForgetGateBias(PositionalEncoding):
    """Cumulative log forget gates as a content bias c(i) − c(j) (FoX Eq. 6–7); subclasses say where gates come from."""

    adds_content_bias = True

    def log_gates(self, k: Tensor, features: Tensor | None) -> Tensor:
        """Log f (B, H, Lk) fp32 of every key position, from the keys (B, H, Lk, D) or their ``features``.

        By default the features are the log-gates (B, Lk, H), read from the layer's input (FoX, CABLE); a scheme whose
        gates come from the keys (data-dependent ALiBi) computes them here instead.
        """
        return self.require_features(features).transpose(1, 2)

    def key_bias(self, k: Tensor, k_pos: Tensor, features: Tensor | None = None) -> Tensor:
        """−c(k_pos[j]) (B, H, Lk): along a row the bias c(i) − c(j) varies only through the key's −c(j)."""
        return -self.log_gates(k, features).cumsum(dim=-1)

    def content_bias(
        self,
        q: Tensor,
        k: Tensor,
        q_pos: Tensor,
        k_pos: Tensor,
        scores: Tensor | None = None,
        features: Tensor | None = None,
    ) -> Tensor:
        cumulative = -self.key_bias(k, k_pos, features)  # c(k_pos[j]) (B, H, Lk)
        # c(q_pos[i]) is the cumulative sum up to the last key at or before the query: the query's own key.
        last = torch.searchsorted(k_pos, q_pos, right=True) - 1  # (Lq,), ≥ 0 since each query sees itself
        at_query = cumulative[..., last.clamp(min=0)]  # (B, H, Lq)
        return at_query[..., :, None] - cumulative[..., None, :]  # (B, H, Lq, Lk); ≤ 0 on causal pairs


@register
class ForgettingTransformer(ForgetGateBias):
    """FoX: a per-head forget gate σ(w_h · x_t + b_h) from the layer's input; cumulative log-gates as the bias."""

    name = "fox"
    reads_layer_input = True

    def __init__(self, num_heads: int, head_dim: int, init: str = "paper") -> None:
        super().__init__(num_heads, head_dim)
        if init not in INITS:
            raise ValueError(f"fox's init must be one of {', '.join(INITS)}, got {init!r}")
        self.init = init
        dim = num_heads * head_dim  # the layer's input width: the model's
        if init == "paper":
            self.gate_weight = nn.Parameter(torch.randn(num_heads, dim) * GATE_STD)
            self.gate_bias = nn.Parameter(torch.zeros(num_heads))
        else:
            self.gate_weight = nn.Parameter(torch.zeros(num_heads, dim))
            self.gate_bias = nn.Parameter(alibi_gate_bias(num_heads))

    @full_precision
    def token_features(self, x: Tensor) -> Tensor:
        """Log f (B, L, H) in fp32 from the layer's input x (B, L, dim): what a KV cache keeps beside the keys."""
        return F.logsigmoid(F.linear(x.float(), self.gate_weight.float(), self.gate_bias.float()))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, init={self.init}, gate from the layer input"
