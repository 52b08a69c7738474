"""Sandwich (Chi et al., 2023, "Dissecting Transformer Length Extrapolation via the Lens of Receptive Field Analysis").

A parameter-free bias from the inner product of sinusoidal position embeddings: with p_m the d'-dimensional
sin/cos embedding (ω_k = 10000^(−2k/d')), p_m · p_n = Σ_{k=1}^{d'/2} cos((m − n) ω_k), a function of the distance
alone. Sandwich subtracts d'/2 (so the bias is 0 at distance 0 and ≤ 0 elsewhere) and, as ALiBi does with its
slopes, compresses it per head by r_h = 8h/H (h = 1..H):

    b_h(d) = (Σ_{k=1}^{d'/2} cos(d · ω_k) − d'/2) / (8h/H)

The bias falls quickly over the first distances, then keeps falling slowly (roughly logarithmically) towards
−(d'/2)/r_h as ever slower cosines dephase: a decaying penalty like ALiBi's and KERPLE's, which is the paper's
point about their shared receptive field. ``dim`` is d' (the paper: 128).
"""

from __future__ import annotations

import torch
from torch import Tensor

from posenc.encodings import register
from posenc.encodings.base import PositionalEncoding
from posenc.encodings.forms import ScoreMod


@register
class Sandwich(PositionalEncoding):
    """Inner product of sinusoidal embeddings as a per-head distance bias; no parameters."""

    name = "sandwich"
    adds_bias = True
    score_mod_reads_table = True  # the (H, L) table its score_mod reads when the window length is known

    def __init__(self, num_heads: int, head_dim: int, dim: int = 128) -> None:
        super().__init__(num_heads, head_dim)
        if dim < 2 or dim % 2:
            raise ValueError(f"sandwich needs an even embedding dim ≥ 2, got dim={dim}")
        self.dim = dim
        k = torch.arange(1, dim // 2 + 1, dtype=torch.float64)
        self.register_buffer("frequencies", (10000.0 ** (-2 * k / dim)).float(), persistent=False)
        compression = 8.0 * torch.arange(1, num_heads + 1, dtype=torch.float32) / num_heads  # r_h = 8h/H
        self.register_buffer("compression", compression, persistent=False)

    def kernel(self, d: Tensor) -> Tensor:
        """Σ_k (cos(d ω_k) − 1) = Σ_k cos(d ω_k) − d'/2 for fp32 distances ``d`` (any shape), before the compression."""
        return (torch.cos(d[..., None] * self.frequencies) - 1).sum(-1)

    def bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        # Through the distance table: d'/2 cosines per distance, not per (i, j) pair (1 GiB of them at L = 2048).
        d = (q_pos[:, None] - k_pos[None, :]).clamp(min=0)  # (Lq, Lk); j > i is masked anyway
        return self.distance_bias(int(d.max()) + 1)[:, d]  # (H, Lq, Lk)

    def distance_bias(self, num_distances: int) -> Tensor:
        # The compression inside the sum, so the table's last operation is a reduction: Inductor (torch 2.11) cannot
        # hand FlexAttention a table whose last operation is elementwise ("convert FlexibleLayout to FixedLayout").
        d = torch.arange(num_distances, device=self.frequencies.device, dtype=torch.float32)
        return ((torch.cos(d[None, :, None] * self.frequencies) - 1) / self.compression[:, None, None]).sum(-1)

    def score_mod(self, detached: bool = False, num_distances: int | None = None) -> ScoreMod:
        if num_distances is not None:
            # d'/2 cosines per score, and again in the backward, cost more than the attention itself: with the
            # window's length known, one (H, L) table holds every distance the kernel can ask for.
            table = self.distance_bias(num_distances)
            last = num_distances - 1

            def sandwich_table(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
                # Clamped: the causal mask drops j > i afterwards, and padded rows of a tile may reach past L.
                return score + table[h, (q_idx - kv_idx).clamp(0, last)]

            return sandwich_table

        frequencies, compression, half = self.frequencies, self.compression, self.dim / 2

        def sandwich(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            d = (q_idx - kv_idx).to(torch.float32)
            inner = sum(torch.cos(d * frequencies[i]) for i in range(frequencies.numel()))
            return score + (inner - half) / compression[h]

        return sandwich

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, dim={self.dim}"
