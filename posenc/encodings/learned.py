"""Learned absolute position embeddings (GPT-2 style): a trainable vector per position up to ``max_positions``.

It cannot represent a position it never had a row for, so asked for a longer sequence it fails with a clear
message (``check_length``) instead of indexing out of range.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from torch import Tensor, nn

from posenc.encodings import register
from posenc.encodings.base import PositionalEncoding
from posenc.encodings.forms import LengthScaled


@register
class Learned(PositionalEncoding):
    """A ``max_positions`` × dim table added to the token embeddings."""

    name = "learned"
    absolute = True
    length_settings: ClassVar[Mapping[str, LengthScaled]] = {
        "max_positions": LengthScaled(1, "one row per trained position")
    }

    def __init__(self, num_heads: int, head_dim: int, max_positions: int = 1024, init_std: float = 0.02) -> None:
        super().__init__(num_heads, head_dim)
        if max_positions < 1:
            raise ValueError(f"max_positions must be positive, got {max_positions}")
        self.max_positions = int(max_positions)
        self.table = nn.Embedding(self.max_positions, num_heads * head_dim)
        nn.init.normal_(self.table.weight, std=init_std)

    def coverage(self, train_length: int) -> list[dict[str, object]]:
        if self.max_positions <= train_length:
            return []
        return [
            {
                "parameter": "table",
                "unreached": self.max_positions - train_length,
                "of": self.max_positions,
                "note": f"rows {train_length}–{self.max_positions - 1} are never trained at L = {train_length}: a "
                "longer window adds their initial values",
            }
        ]

    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        self.check_length(int(pos.max()) + 1 if pos.numel() else 0)
        return x + self.table(pos).to(x.dtype)
