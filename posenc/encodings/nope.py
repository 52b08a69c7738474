"""NoPE (Kazemnejad et al., 2023): no positional encoding; the causal mask alone reveals order."""

from __future__ import annotations

from posenc.encodings import register
from posenc.encodings.base import PositionalEncoding


@register
class NoPE(PositionalEncoding):
    """The identity scheme: every word of the contract is the base class's no-op."""

    name = "nope"
