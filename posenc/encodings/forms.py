"""What a scheme declares besides its bias: score_mod's type, its attention's or gradient's forms, L-scaled settings.

Declarations only (the contract that uses them is ``base.py``; the settings in units of the training length,
``LengthScaled``, are resolved in ``length.py``): kept apart so that a backend can name a form without importing the
contract, and the contract stays one class.
"""

from __future__ import annotations

import math
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


@dataclass(frozen=True)
class LengthScaled:
    """A setting worth ``ratio`` × the training length L (``paper`` says whose ratio), at least ``minimum``."""

    ratio: float
    paper: str
    minimum: float = 1
    integer: bool = True

    def at(self, train_length: int) -> int | float:
        """The setting's value for a run training at ``train_length``."""
        value = max(self.minimum, self.ratio * train_length)
        return math.ceil(value) if self.integer else float(value)

    @property
    def rule(self) -> str:
        """The rule in words, e.g. ``L/16 (T5: 32 at L = 512)``."""
        if self.ratio == 1:
            share = "L"
        elif self.ratio < 1 and (1 / self.ratio).is_integer():
            share = f"L/{int(1 / self.ratio)}"
        else:
            share = f"{self.ratio:g}·L"
        floor = f", at least {self.minimum:g}" if self.minimum > 1 else ""
        return f"{share}{floor} ({self.paper})"
