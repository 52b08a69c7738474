"""Cached incremental decoding: each new token is one query over the cached keys, not a forward of the window.

The cache keeps every layer's keys *before* rotation, with their absolute positions, and each step calls the
scheme and the backend exactly as a full forward would, only with the new queries' positions (``q_pos``) over
all cached positions (``k_pos``, Lq ≠ Lk):

- rotations are applied at absolute positions to the new queries and to all cached keys together, so a scheme
  whose rotation depends on the whole key window (xPos centres its scaling on it) stays exact; re-rotating
  costs O(Lk · D) per layer and step, the same order as the attention itself;
- relative biases are built by the backend from ``q_pos`` and ``k_pos``, so they span every cached key;
- absolute embeddings see the new tokens' absolute positions, and the model's ``check_length`` refuses a
  continuation past ``max_positions`` before the first step.
- features a scheme reads from the layer's input (``token_features``: FoX's log-gates, PaTH's Householder vectors)
  are cached beside the keys, so a new query sees every cached key's features as the full forward does.

A local (sliding-window) layer keeps a rolling cache: after each step only the last W − 1 keys stay, the ones the
next query's window of W reaches, so its memory stays W keys however long the continuation runs (what deployed
local layers keep). The cache remembers the first position it held (``origin``): a sink token sits there, as in the
full forward, after the keys that shared it are gone.

Nothing here names a scheme: exactness follows from passing the contract the same positions as the full
forward. ``tests/test_decoding.py`` checks the logits against the full forward for every registered scheme.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class LayerCache:
    """One layer's cached keys (unrotated) and values (B, H, Lk, D), their positions (Lk,) and features (B, Lk, F).

    ``length`` counts the positions seen on the host: the decoder numbers positions 0, 1, 2, ... so it is also
    the next position, known without reading a device tensor back (a host sync per decoded token on a GPU).
    ``origin`` (1,) is the first position the cache held.
    """

    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.pos: Tensor | None = None
        self.features: Tensor | None = None
        self.origin: Tensor | None = None
        self.length = 0

    def extend(
        self, k: Tensor, v: Tensor, pos: Tensor, features: Tensor | None = None, window: int | None = None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Append the new keys, values, positions and features; return the whole cache in that order.

        With a ``window`` (a local layer), what is kept for the next step is the last ``window`` − 1 of them.
        """
        self.length += pos.shape[0]
        if self.k is None:  # the prompt: positions stay the queries' own tensor, so backends see self-attention
            self.k, self.v, self.pos, self.features, self.origin = k, v, pos, features, pos[:1]
            seen = (k, v, pos, features)
        else:
            seen = (
                torch.cat((self.k, k), dim=-2),
                torch.cat((self.v, v), dim=-2),
                torch.cat((self.pos, pos)),
                None if features is None else torch.cat((self.features, features), dim=1),
            )
            self.k, self.v, self.pos, self.features = seen
        if window is not None:
            self._roll(window - 1)
        return seen

    def _roll(self, keep: int) -> None:
        """Keep the last ``keep`` keys (a local layer's next query reaches no further back)."""
        first = max(0, self.pos.shape[0] - keep)
        if first:
            self.k, self.v, self.pos = self.k[:, :, first:], self.v[:, :, first:], self.pos[first:]
            self.features = None if self.features is None else self.features[:, first:]


class KVCache:
    """A ``LayerCache`` per layer; ``length`` is the next absolute position to decode."""

    def __init__(self, depth: int) -> None:
        self.layers = [LayerCache() for _ in range(depth)]

    @property
    def length(self) -> int:
        return self.layers[0].length


def sample_next(
    logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None = None
) -> Tensor:
    """Next tokens (B, 1) from last-position logits (B, V): argmax at temperature 0, else top-k sampling."""
    if temperature < 0:
        raise ValueError(f"temperature must be ≥ 0 (0 = greedy), got {temperature}")
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        if top_k < 1:
            raise ValueError(f"top_k must be ≥ 1 (or None for the whole vocabulary), got {top_k}")
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), num_samples=1, generator=generator)


@torch.no_grad()
def generate(
    model: nn.Module,
    tokens: Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """``tokens`` (B, L) continued by ``max_new_tokens`` tokens: (B, L + max_new_tokens).

    ``model`` is a ``Decoder``: ``model(tokens, cache=...)`` runs the new tokens over the cache.
    """
    if tokens.ndim != 2 or tokens.shape[1] == 0:
        raise ValueError(f"generate needs a non-empty prompt of shape (batch, length), got {tuple(tokens.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be ≥ 0, got {max_new_tokens}")
    if max_new_tokens == 0:
        return tokens
    model.check_length(tokens.shape[1] + max_new_tokens - 1)  # the last sampled token is never fed back
    was_training = model.training
    model.eval()
    try:
        cache = KVCache(len(model.blocks))
        logits = model(tokens, cache=cache)[:, -1]
        out = [tokens]
        for step in range(max_new_tokens):
            out.append(sample_next(logits, temperature, top_k, generator))
            if step + 1 < max_new_tokens:
                logits = model(out[-1], cache=cache)[:, -1]
    finally:
        model.train(was_training)
    return torch.cat(out, dim=1)
