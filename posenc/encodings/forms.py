"""What a scheme hands the backends besides its bias: its score_mod's type and the forms of its attention or gradient.

Declarations only (the contract that uses them is ``base.py``): kept apart so that a backend can name a form without
importing the contract, and the contract stays one class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

# FlexAttention's score_mod signature: (score, batch, head, q_idx, kv_idx) -> score.
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class DerivativeForm:
    """∂b_h(i, j)/∂parameter[h] = scale[h] · f_h(i, j) with f ≥ 0 everywhere (Identity 1).

    ``log_factor`` is a score_mod that adds log f to the score (−∞ where f = 0), evaluated at absolute positions
    like ``score_mod``, in fp32, reading only detached tensors. ``parameter`` is per head (H,); ``scale`` (H,) is
    detached fp32. A derivative of mixed sign is declared as two forms whose scales have opposite signs.
    """

    parameter: Tensor
    scale: Tensor
    log_factor: ScoreMod


@dataclass(frozen=True)
class TableForm:
    """b_h(d) = table[h, index[min(d, horizon)]] for causal distances d ≥ 0 (Identity 2).

    ``index`` (horizon + 1,) int64 names the table entry of distances ``0 .. horizon``; every distance from
    ``horizon`` on uses ``index[horizon]``. Only the scheme's own part of the bias is described: in a stack,
    other members add their own biases on top.
    """

    table: Tensor
    index: Tensor

    @property
    def horizon(self) -> int:
        """Distance from which the table entry no longer changes: the band a backend must look at."""
        return self.index.numel() - 1


BiasGradientForm = DerivativeForm | TableForm


@dataclass(frozen=True)
class StickForm:
    """The attention is stick-breaking's: o_i = Σ_{j<i} A_ij v_j + (1 − Σ_j A_ij) · target, then ``finish``.

    A_ij = β_ij Π_{j<k<i} (1 − β_ik), β_ij = σ(q_i·k_j/√D). The remainder's target is each query's own value
    (``head_bias`` None) or the head's vector ``head_bias`` (H, D), a parameter the kernel differentiates;
    ``finish`` maps the output (B, H, Lq, D) as the scheme's ``attend`` does after (a norm per head, or nothing).
    """

    head_bias: Tensor | None
    finish: Callable[[Tensor], Tensor]
