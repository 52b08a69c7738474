"""KERPLE (Chi et al., 2022, "Kernelized Relative Positional Embedding for Length Extrapolation").

Two conditionally positive definite kernels turned into learnable per-head distance biases (the paper's
Eq. 5 and 6, d = i - j ≥ 0):

- ``kerple_log``:   b = -r1 · log(1 + r2 · d),   r1, r2 > 0
- ``kerple_power``: b = -r1 · d^r2,              r1 > 0, 0 < r2 ≤ 2

As in the paper's code, parameters are initialised uniformly (the log kernel: r1 ~ U(0, 2), r2 ~ U(0, 1); the
power kernel: r1 ~ U(0, 1), r2 ~ U(0, 2)) and kept in range by projection after every optimiser step
(clamped to ≥ 0.01, and r2 ≤ 2 for the power kernel) rather than by a reparametrisation.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from posenc.encodings import register
from posenc.encodings.base import PositionalEncoding, distances
from posenc.encodings.forms import DerivativeForm, ScoreMod

EPS = 1e-2


class _Kerple(PositionalEncoding):
    adds_bias = True
    r1_init_scale: float = 1.0
    r2_init_scale: float = 1.0
    r2_max: float | None = None

    def __init__(self, num_heads: int, head_dim: int, learnable: bool = True) -> None:
        super().__init__(num_heads, head_dim)
        self.r1 = nn.Parameter(torch.rand(num_heads) * self.r1_init_scale, requires_grad=learnable)
        self.r2 = nn.Parameter(torch.rand(num_heads) * self.r2_init_scale, requires_grad=learnable)
        self.constrain_()

    @torch.no_grad()
    def constrain_(self) -> None:
        self.r1.clamp_(min=EPS)
        self.r2.clamp_(min=EPS, max=self.r2_max)

    def kernel(self, d: Tensor, r1: Tensor, r2: Tensor) -> Tensor:
        """The bias for fp32 distances ``d`` with per-head parameters broadcast against it."""
        raise NotImplementedError

    def bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        d = distances(q_pos, k_pos).clamp(min=0)[None]  # (1, Lq, Lk); j > i is masked anyway
        return self.kernel(d, self.r1.float()[:, None, None], self.r2.float()[:, None, None])

    def distance_bias(self, num_distances: int) -> Tensor:
        d = torch.arange(num_distances, device=self.r1.device, dtype=torch.float32)[None]
        return self.kernel(d, self.r1.float()[:, None], self.r2.float()[:, None])

    def score_mod(self, detached: bool = False, num_distances: int | None = None) -> ScoreMod:
        r1, r2, kernel = self.r1, self.r2, self.kernel
        if detached:
            r1, r2 = r1.detach(), r2.detach()

        def kerple(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            d = (q_idx - kv_idx).clamp(min=0).to(torch.float32)
            return score + kernel(d, r1[h].float(), r2[h].float())

        return kerple

    def log_derivatives(self, d: Tensor, r2: Tensor) -> tuple[Tensor, Tensor]:
        """The logs of f_r1 and f_r2, where ∂b/∂r1 = -f_r1 and ∂b/∂r2 = -r1 · f_r2 (both f ≥ 0, -inf where f = 0)."""
        raise NotImplementedError

    def bias_gradient_forms(self) -> list[DerivativeForm]:
        # Both derivatives are -(a per-head scale) · (a non-negative function of d): Identity 1
        # (docs/learnable-bias-gradient.md) with scales -1 (r1) and -r1 (r2). The factors read r2 detached: forms are
        # evaluated as constants.
        r2, log_derivatives = self.r2.detach(), self.log_derivatives

        def log_factor(which: int) -> ScoreMod:
            def mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
                d = (q_idx - kv_idx).clamp(min=0).to(torch.float32)
                return score + log_derivatives(d, r2[h].float())[which]

            return mod

        minus_one = torch.full_like(self.r1, -1.0, dtype=torch.float32).detach()
        return [
            DerivativeForm(self.r1, minus_one, log_factor(0)),
            DerivativeForm(self.r2, -self.r1.detach().float(), log_factor(1)),
        ]


@register
class KerpleLog(_Kerple):
    """-r1 · log(1 + r2 · d): a logarithmic decay, the variant the paper found to extrapolate best."""

    name = "kerple_log"
    r1_init_scale = 2.0
    r2_init_scale = 1.0

    def kernel(self, d: Tensor, r1: Tensor, r2: Tensor) -> Tensor:
        return -r1 * torch.log1p(r2 * d)

    def log_derivatives(self, d: Tensor, r2: Tensor) -> tuple[Tensor, Tensor]:
        # ∂b/∂r1 = -log(1 + r2·d), ∂b/∂r2 = -r1 · d / (1 + r2·d); both factors vanish at d = 0 (log 0 = -inf).
        log1p = torch.log1p(r2 * d)
        return torch.log(log1p), torch.log(d) - log1p


@register
class KerplePower(_Kerple):
    """-r1 · d^r2 with 0 < r2 ≤ 2 (r2 = 1 is a learnable ALiBi)."""

    name = "kerple_power"
    r1_init_scale = 1.0
    r2_init_scale = 2.0
    r2_max = 2.0

    def kernel(self, d: Tensor, r1: Tensor, r2: Tensor) -> Tensor:
        # d^r2 at d = 0 is 0, but its derivative in r2 (d^r2 · ln d) is 0 · -inf: take it on d ≥ 1 only.
        powered = torch.where(d > 0, d.clamp(min=1.0) ** r2, torch.zeros_like(d * r2))
        return -r1 * powered

    def log_derivatives(self, d: Tensor, r2: Tensor) -> tuple[Tensor, Tensor]:
        # ∂b/∂r1 = -d^r2, ∂b/∂r2 = -r1 · d^r2 · ln d; distances are integers, so ln d ≥ 0 and the factor is 0 at
        # d ≤ 1 (where log gives -inf, the masked value the identity wants).
        log_d = torch.log(d)
        log_power = torch.where(d > 0, r2 * log_d, float("-inf"))
        return log_power, torch.where(d > 1, log_power + torch.log(log_d), float("-inf"))
