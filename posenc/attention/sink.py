"""An attention sink: a place for attention that reads no token, given to every layer whatever the scheme.

A softmax row must sum to 1, so a head with nothing to read puts its mass somewhere: trained without a place for it,
on the window's first token (the "sink" whose mass ``posenc.evaluate.attention_stats`` measures). Deployed models give
it a place; ``model.sink`` chooses one, the same for every layer, orthogonal to the scheme:

- ``none``: the softmax over the keys, as every scheme is compared;
- ``zero``: one more column of the scores, fixed at 0, with no value (softmax-1, "quiet attention"):
  p_ij = e^{s_ij} / (1 + Σ_j e^{s_ij}); what the column takes is dropped after the softmax;
- ``learned``: the same column with a logit per head s_h, initialised at 0, with no value, no positional bias and no
  rotation (gpt-oss's sinks);
- ``tokens``: k learnable key-value pairs per layer and head in front of the window's keys (StreamingLLM's sink tokens,
  Xiao et al., 2024, whose first tokens' keys and values stay in every layer's cache). The scheme sees them as keys
  at the window's first position: rotated there, biased by the distance from it, read by a content bias in front of
  every key (a scheme that reads the layer's input sees zero features for them: a sink token has no input). They are
  never queries and never scored. The window's first position is position 0 in every forward posenc runs (training,
  evaluation windows, the cached decoder), so a query at i is i from the sink, as from the first token; a forward at
  an offset carries its sink along, so a relative scheme stays invariant to a shift of all positions. StreamingLLM's
  four sink tokens sit at positions 0..3 of the cache; with k = 1 the two agree.

Each form is the softmax over [sink columns | keys] (``SinkColumns``: one logit column, or k token columns).
``eager`` computes exactly that (``attention_weights``: the columns in front of the keys) and is the reference. A
kernel that returns the row log-sum-exp ℓ_i = log Σ_j e^{s_ij} over the keys (flex, flex_learnable, triton) gets the
same output from its own, ``merge``: with the columns' scores z_ic and values u_c (u = 0 for a logit),

    o'_i = e^{ℓ_i − ℓ'_i} o_i + Σ_c e^{z_ic − ℓ'_i} u_c,    ℓ'_i = log(e^{ℓ_i} + Σ_c e^{z_ic}),

which for a logit is o'_i = o_i · σ(ℓ_i − s_h). Autograd differentiates it through ℓ into the kernel's backward,
where dℓ_i adds P_ij dℓ_i to dS_ij = P_ij (dO_i · v_j − Δ_i): the ordinary backward with Δ_i − dℓ_i in place of Δ_i.
``sdpa`` returns no ℓ: its columns go in front of the keys (``posenc.attention.sdpa``).

A scheme that supplies its own attention has no softmax row for a column to join, and a sink is refused with it in
one line (``refuse_sink``), with what the scheme says of its own (``own_sink``: stick-breaking's remainder, what no key
takes, already goes to a value of its own).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from posenc.encodings.base import PositionalEncoding
from posenc.runtime import full_precision

SINKS = ("none", "zero", "learned", "tokens")
TOKEN_INIT_STD = (
    0.02  # the sink tokens' keys and values, as the backbone's weights (GPT-2's): distinct, so k > 1 differ
)


@dataclass(frozen=True)
class SinkColumns:
    """One call's sink as backends read it: a logit per head, or the sink tokens.

    ``logit`` (H,); or the tokens' rotated ``keys`` (B, H, k, Dq), their ``values`` (B, H, k, D) and their position
    ``pos`` (k,): the window's first.
    """

    logit: Tensor | None = None
    keys: Tensor | None = None
    values: Tensor | None = None
    pos: Tensor | None = None

    @property
    def width(self) -> int:
        """Columns in front of the keys: one logit, or k tokens."""
        return 1 if self.keys is None else self.keys.shape[-2]

    def prepend(
        self, k: Tensor, v: Tensor | None, k_pos: Tensor, features: Tensor | None
    ) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
        """The tokens in front of the keys, values (if given), positions and (zero) features: what the scheme reads."""
        if self.keys is None or self.values is None or self.pos is None:
            raise ValueError("only sink tokens are keys: a logit sink has no key to put in front of the others")
        k = torch.cat((self.keys.to(k.dtype), k), dim=-2)
        if v is not None:
            v = torch.cat((self.values.to(v.dtype), v), dim=-2)
        if features is not None:
            features = torch.cat((features.new_zeros(features.shape[0], self.width, features.shape[-1]), features), 1)
        return k, v, torch.cat((self.pos, k_pos)), features

    def scores(self, q: Tensor, encoding: PositionalEncoding, q_pos: Tensor) -> Tensor:
        """The columns' fp32 scores (B, H, Lq, C) for a scheme whose bias reads positions only.

        A logit is the same for every query; a token's score is q · k_sink / √(q's width) plus the scheme's bias at
        the token's position, which depends on the two positions alone (a content bias reads every key in order: its
        callers put the tokens in front of the keys instead, ``prepend``).
        """
        batch, heads, length, width = q.shape
        if self.keys is None:
            return self.logit.float()[None, :, None, None].expand(batch, heads, length, 1)
        scores = torch.einsum("bhqd,bhkd->bhqk", q.float(), self.keys.float()) / math.sqrt(width)
        if encoding.adds_bias:
            scores = scores + encoding.bias(q_pos, self.pos)[None]
        return scores

    @full_precision
    def merge(self, out: Tensor, lse: Tensor, q: Tensor, encoding: PositionalEncoding, q_pos: Tensor) -> Tensor:
        """The output with the sink, from the keys' own attention: its ``out`` (B, H, Lq, D) and ``lse`` (B, H, Lq)."""
        scores = self.scores(q, encoding, q_pos)  # (B, H, Lq, C)
        total = torch.logaddexp(lse.float(), scores.logsumexp(dim=-1))  # ℓ'_i
        merged = out.float() * torch.exp(lse.float() - total)[..., None]
        if self.values is not None:
            weights = torch.exp(scores - total[..., None])
            merged = merged + torch.einsum("bhqk,bhkd->bhqd", weights, self.values.float())
        return merged.to(out.dtype)


class Sink(nn.Module):
    """One layer's sink (``model.sink``): a logit per head (``zero``: a constant), or ``tokens`` key-value pairs."""

    def __init__(self, kind: str, heads: int, head_dim: int, tokens: int = 1) -> None:
        super().__init__()
        if kind not in SINKS[1:]:
            raise ValueError(f"model.sink must be one of {', '.join(SINKS)}, got {kind!r}")
        if tokens < 1:
            raise ValueError(f"model.sink_tokens must be ≥ 1, got {tokens}")
        self.kind = kind
        self.tokens = tokens if kind == "tokens" else 0
        if kind == "learned":
            self.logit = nn.Parameter(torch.zeros(heads))
        elif kind == "zero":  # a constant: a buffer, so it moves with the model and no optimiser sees it
            self.register_buffer("logit", torch.zeros(heads), persistent=False)
        else:
            self.keys = nn.Parameter(torch.randn(heads, tokens, head_dim) * TOKEN_INIT_STD)
            self.values = nn.Parameter(torch.randn(heads, tokens, head_dim) * TOKEN_INIT_STD)

    def in_front(
        self, k: Tensor, v: Tensor, k_pos: Tensor, origin: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The unrotated tokens in front of the window's keys (B, H, k + Lk, D), values, positions: for the rotation.

        ``origin`` (1,): the window's first position, when the keys no longer start there (a local layer's rolling
        cache); the first key's position otherwise.
        """
        if not self.tokens:
            return k, v, k_pos
        batch = k.shape[0]
        keys = self.keys.to(k.dtype)[None].expand(batch, -1, -1, -1)
        values = self.values.to(v.dtype)[None].expand(batch, -1, -1, -1)
        pos = (k_pos[:1] if origin is None else origin).expand(self.tokens)  # the window's first position
        return torch.cat((keys, k), dim=-2), torch.cat((values, v), dim=-2), torch.cat((pos, k_pos))

    def columns(self, k: Tensor, v: Tensor, k_pos: Tensor) -> tuple[SinkColumns, Tensor, Tensor]:
        """The columns, and the window's own keys and values, from the rotated ``in_front`` keys (tokens) or not."""
        if not self.tokens:
            return SinkColumns(logit=self.logit), k, v
        count = self.tokens
        columns = SinkColumns(keys=k[:, :, :count], values=v[:, :, :count], pos=k_pos[:count])
        return columns, k[:, :, count:], v[:, :, count:]

    def extra_repr(self) -> str:
        return f"kind={self.kind}" + (f", tokens={self.tokens}" if self.tokens else "")


def refuse_sink(encoding: PositionalEncoding, sink: str) -> None:
    """Raise (ValueError, one line) when ``encoding`` cannot take ``model.sink=sink``: it supplies its own attention."""
    if sink == "none" or not encoding.supplies_attention:
        return
    own = f" ({encoding.own_sink})" if encoding.own_sink else ""
    raise ValueError(
        f"model.sink={sink} adds a column to a softmax over the keys, and {encoding.label} supplies its own attention, "
        f"with no such row{own}; use model.sink=none with it"
    )
