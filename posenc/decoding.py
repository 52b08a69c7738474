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

Nothing here names a scheme: exactness follows from passing the contract the same positions as the full
forward. ``tests/test_decoding.py`` checks the logits against the full forward for every registered scheme.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class LayerCache:
    """One layer's cached keys (unrotated) and values (B, H, Lk, D), their positions (Lk,) and features (B, Lk, F).

    ``length`` counts the cached positions on the host: the decoder numbers positions 0, 1, 2, ... so it is also
    the next position, known without reading a device tensor back (a host sync per decoded token on a GPU).
    """

    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.pos: Tensor | None = None
        self.features: Tensor | None = None
        self.length = 0

    def extend(
        self, k: Tensor, v: Tensor, pos: Tensor, features: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Append the new keys, values, positions and features; return the whole cache in that order."""
        self.length += pos.shape[0]
        if self.k is None:  # the prompt: positions stay the queries' own tensor, so backends see self-attention
            self.k, self.v, self.pos, self.features = k, v, pos, features
        else:
            self.k = torch.cat((self.k, k), dim=-2)
            self.v = torch.cat((self.v, v), dim=-2)
            self.pos = torch.cat((self.pos, pos))
            if features is not None:
                self.features = torch.cat((self.features, features), dim=1)
        return self.k, self.v, self.pos, self.features


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
