"""CoPE (Golovneva et al., 2024, "Contextual Position Encoding: Learning to Count What's Important").

Positions are counted by the content: a query i gates every key j it may see, g_ij = σ(q_i · k_j / √d), and the
position of key j relative to i is the sum of the gates from j up to i (the paper's Eq. 3–4):

    p_ij = Σ_{t=j}^{i} g_it

p_ij is fractional, so the learned position embeddings e[0..P−1] are interpolated (Eq. 5), which the paper does
on the logits z_i[n] = q_i · e[n] rather than on the vectors:

    bias_ij = (p_ij − ⌊p_ij⌋) · z_i[⌈p_ij⌉] + (1 − p_ij + ⌊p_ij⌋) · z_i[⌊p_ij⌋]

with p clamped to P − 1 (``num_positions``; counts past it share the last embedding, which is what lets CoPE run
at any length). As in the paper's code, one embedding table per layer is shared by the heads, initialised at
zero, and the gates use the scaled scores of the attention itself. Row i reads q_i and the keys up to i only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import Tensor, nn

from posenc.encodings import register
from posenc.encodings.base import PositionalEncoding
from posenc.encodings.forms import LengthScaled
from posenc.runtime import full_precision


@register
class CoPE(PositionalEncoding):
    """Contextual positions from summed sigmoid gates; interpolated learned embeddings as a bias."""

    name = "cope"
    adds_content_bias = True
    reads_scores = True
    # A count over a window of L keys stays below L + 1, so L embeddings are every one training can reach; the
    # last one then holds every longer count.
    length_settings: ClassVar[Mapping[str, LengthScaled]] = {
        "num_positions": LengthScaled(1, "every count a trained window reaches", minimum=2)
    }

    def __init__(self, num_heads: int, head_dim: int, num_positions: int = 64) -> None:
        super().__init__(num_heads, head_dim)
        if num_positions < 2:
            raise ValueError(f"cope needs num_positions ≥ 2 (embeddings to interpolate between), got {num_positions}")
        self.num_embeddings = num_positions
        self.embeddings = nn.Parameter(torch.zeros(num_positions, head_dim))

    @full_precision
    def contextual_positions(
        self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, scores: Tensor | None = None
    ) -> Tensor:
        """p_ij (B, H, Lq, Lk) fp32: the gates of keys j..i summed; 0 on pairs the causal mask removes."""
        if scores is None:
            scores = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float()) / math.sqrt(q.shape[-1])
        gates = torch.sigmoid(scores)
        gates = gates.masked_fill(k_pos[None, :] > q_pos[:, None], 0.0)
        return gates.flip(-1).cumsum(-1).flip(-1)  # suffix sums over keys: Σ_{t ≥ j, t ≤ i} g_it

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
        positions = self.contextual_positions(q, k, q_pos, k_pos, scores).clamp(max=self.num_embeddings - 1)
        logits = torch.einsum("bhqd,nd->bhqn", q.float(), self.embeddings.float())  # z_i[n] (B, H, Lq, P)
        floor = positions.floor()
        weight = positions - floor  # interpolation weight of the upper neighbour
        index = floor.long()
        lower = logits.gather(-1, index)
        # ⌈p⌉ wherever the weight is not 0 (and where it is, the upper value does not count): one index tensor.
        upper = logits.gather(-1, (index + 1).clamp(max=self.num_embeddings - 1))
        return torch.lerp(lower, upper, weight)  # (1 − w) · z[⌊p⌋] + w · z[⌈p⌉] in one pass

    def coverage(self, train_length: int) -> list[dict[str, object]]:
        unreached = self.num_embeddings - (train_length + 1)
        if unreached <= 0:
            return []
        return [
            {
                "parameter": "embeddings",
                "unreached": unreached,
                "of": self.num_embeddings,
                "note": f"embeddings {train_length + 1}–{self.num_embeddings - 1} hold counts no window of "
                f"{train_length} reaches: they keep their initial value",
            }
        ]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, num_positions={self.num_embeddings}"
