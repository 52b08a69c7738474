"""T5 relative position bias (Raffel et al., 2020): a learned scalar per head and distance bucket.

Causal (unidirectional) bucketing of d = i - j ≥ 0, as in T5's ``_relative_position_bucket`` with
``bidirectional=False``: the first ``num_buckets / 2`` buckets hold one distance each; the rest cover distances
up to ``max_distance`` on a log scale, and every larger distance shares the last bucket.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import Tensor, nn

from posenc.encodings import register
from posenc.encodings.base import PositionalEncoding
from posenc.encodings.forms import LengthScaled, ScoreMod, TableForm


def t5_bucket(d: Tensor, num_buckets: int = 32, max_distance: int = 128) -> Tensor:
    """Bucket index (int64) of causal distances ``d`` (any integer dtype; negatives count as 0)."""
    n = d.clamp(min=0)
    max_exact = num_buckets // 2
    # log(n / max_exact) / log(max_distance / max_exact) ∈ [0, 1) maps distances max_exact..max_distance onto
    # the remaining buckets; n is clamped to ≥ 1 only to keep the log finite where the exact branch is taken.
    log_ratio = torch.log(n.to(torch.float32).clamp(min=1.0) / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (log_ratio * (num_buckets - max_exact)).to(torch.int64)
    large = large.clamp(max=num_buckets - 1)
    return torch.where(n < max_exact, n.to(torch.int64), large)


@register
class T5Bias(PositionalEncoding):
    """Learned bucketed relative bias (one table per layer)."""

    name = "t5"
    adds_bias = True
    score_mod_reads_table = True
    # T5 trained at 512 tokens with 32 buckets up to distance 128, so that every bucket falls inside the trained
    # distances (the last one from 113 on). Kept as ratios, a run at L = 64 gets 4 buckets up to 16.
    length_settings: ClassVar[Mapping[str, LengthScaled]] = {
        "num_buckets": LengthScaled(1 / 16, "T5: 32 at L = 512", minimum=4),
        "max_distance": LengthScaled(1 / 4, "T5: 128 at L = 512", minimum=4),
    }

    def __init__(self, num_heads: int, head_dim: int, num_buckets: int = 32, max_distance: int = 128) -> None:
        super().__init__(num_heads, head_dim)
        if num_buckets < 2 or max_distance <= num_buckets // 2:
            raise ValueError(
                f"need num_buckets ≥ 2 and max_distance > num_buckets/2, got {num_buckets}, {max_distance}"
            )
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        # HF T5 initialises the table with std d_model^-0.5.
        self.table = nn.Parameter(torch.randn(num_heads, num_buckets) * (num_heads * head_dim) ** -0.5)
        # Buckets of distances 0 .. horizon, where the horizon is the first distance of the last bucket (113 for
        # 32 buckets up to 128): buckets never decrease with distance and max_distance is already in the last.
        in_last = self.bucket(torch.arange(max_distance + 1)) == num_buckets - 1
        self.horizon = int(in_last.to(torch.int64).argmax())
        self.register_buffer("horizon_buckets", self.bucket(torch.arange(self.horizon + 1)), persistent=False)

    def bucket(self, d: Tensor) -> Tensor:
        return t5_bucket(d, self.num_buckets, self.max_distance)

    def bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        buckets = self.bucket(q_pos[:, None] - k_pos[None, :])  # (Lq, Lk)
        return self.table.float()[:, buckets]  # (H, Lq, Lk)

    def distance_bias(self, num_distances: int) -> Tensor:
        d = torch.arange(num_distances, device=self.table.device)
        return self.table.float()[:, self.bucket(d)]

    def score_mod(self, detached: bool = False, num_distances: int | None = None) -> ScoreMod:
        table, num_buckets, max_distance = self.table, self.num_buckets, self.max_distance
        if detached:
            table = table.detach()

        def t5(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return score + table[h, t5_bucket(q_idx - kv_idx, num_buckets, max_distance)].float()

        return t5

    def bias_gradient_forms(self) -> list[TableForm]:
        # Identity 2 (docs/learnable-bias-gradient.md): only distances below the horizon need dS; the last bucket
        # gets minus their sum.
        return [TableForm(self.table, self.horizon_buckets)]

    def coverage(self, train_length: int) -> list[dict[str, object]]:
        reached = set(self.bucket(torch.arange(max(train_length, 1))).tolist())
        unreached = [bucket for bucket in range(self.num_buckets) if bucket not in reached]
        if not unreached:
            return []
        # Every bucket is reached by some distance up to max_distance, which already sits in the last one.
        first = int((self.bucket(torch.arange(self.max_distance + 1)) >= unreached[0]).to(torch.int64).argmax())
        return [
            {
                "parameter": "table",
                "unreached": len(unreached),
                "of": self.num_buckets,
                "note": f"buckets {unreached[0]}–{unreached[-1]} of {self.num_buckets} (distances ≥ {first}) are never "
                f"reached at L = {train_length}: every score past distance {train_length - 1} reads a bias that "
                "never trained",
            }
        ]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_buckets={self.num_buckets}, max_distance={self.max_distance}"
