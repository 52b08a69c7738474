"""CABLE (Veisi et al., 2025, "Context-aware Biases for Length Extrapolation"): a learned bias per token and head.

Every token t gets, per head, a non-negative step from the layer's input, softplus(w_h · x_t + b_h), and a query at
i scores a key at j with the sum of the steps between them subtracted (the authors' code: b = cumsum(−softplus(h(x)))
over the sequence, bias b_i − b_j):

    s_ij − Σ_{l = j+1}^{i} softplus(w_h · x_l + b_h)

so the bias is an ALiBi whose slope each token sets for itself, fitted to the context. Since −softplus(z) =
log σ(−z), this is the Forgetting Transformer's cumulative log forget gate (``fox.py``) with the gate's weights
negated: the same family of biases, and at the authors' initialisation (weights N(0, 0.02), bias 0, symmetric in
sign) the same distribution of models, every step starting near log 2. The two papers differ in what they build
around it, not in the bias; this file keeps CABLE's own parameterisation so a run under its name is CABLE's.
The paper also adds the bias to another scheme (``rope+cable``, ``alibi+cable`` stack as any two do).

Not carried over: the authors' code leaves q · k unscaled (no 1/√D); the backbone's attention scales every scheme
alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from posenc.encodings import register
from posenc.encodings.fox import GATE_STD, ForgetGateBias
from posenc.runtime import full_precision, softplus


@register
class Cable(ForgetGateBias):
    """CABLE: per token and head a step softplus(w_h · x_t + b_h) from the layer input, summed from key to query."""

    name = "cable"
    reads_layer_input = True

    def __init__(self, num_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, head_dim)
        dim = num_heads * head_dim  # the layer's input width: the model's
        self.step_weight = nn.Parameter(torch.randn(num_heads, dim) * GATE_STD)
        self.step_bias = nn.Parameter(torch.zeros(num_heads))

    @full_precision
    def token_features(self, x: Tensor) -> Tensor:
        """−softplus(w · x + b) (B, L, H) in fp32: each token's log-gate, what a KV cache keeps beside the keys."""
        return -softplus(F.linear(x.float(), self.step_weight.float(), self.step_bias.float()))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, steps from the layer input"
