"""Registry of attention backends: causal attention over already-rotated q, k, v, honouring a scheme's bias.

Every backend computes the same thing, softmax(q·kᵀ/√d + bias, causal) · v, and asks the scheme for its bias in
the form it can use: ``eager`` the dense ``bias()``, ``sdpa`` the dense bias as an attention mask (or none, for
the flash path), ``flex`` the ``score_mod``. A backend that cannot honour a scheme raises; none drops a bias.
``auto`` picks, per call, a backend that works for the device and the scheme.

A scheme that replaces the softmax (``replaces_softmax``: stick-breaking) has no softmax to bias: ``eager`` multiplies
its dense reference weights by v, ``sdpa`` and ``auto`` run its own memory-bounded ``attend``, and the backends built
around a softmax kernel refuse it (``refuse_own_attention``).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from posenc.encodings.base import PositionalEncoding

# (q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, D), encoding, q_pos (Lq,), k_pos (Lk,)) -> (B, H, Lq, D)
Backend = Callable[[Tensor, Tensor, Tensor, PositionalEncoding, Tensor, Tensor], Tensor]

_BACKENDS: dict[str, Backend] = {}
# Backends that accept queries at a suffix of the key positions (Lq < Lk, q_pos = k_pos[-Lq:]), as cached
# decoding calls them: new queries over every cached key.
_QUERY_SUFFIX: set[str] = set()
# What cached decoding uses when the model's backend cannot take a query suffix (flex's kernel is self-attention
# over one window): exact for every scheme, with a (Lq × Lk) mask that is one row per decoded token.
DECODING_FALLBACK = "sdpa"


def register_backend(name: str, *, query_suffix: bool = False) -> Callable[[Backend], Backend]:
    """Register a backend; ``query_suffix`` declares that it accepts Lq < Lk (new queries over cached keys)."""

    def decorator(fn: Backend) -> Backend:
        _BACKENDS[name] = fn
        if query_suffix:
            _QUERY_SUFFIX.add(name)
        return fn

    return decorator


def refuse_content_bias(encoding: PositionalEncoding, backend: str) -> None:
    """Refuse a bias that reads q and k in a backend that sees positions only (a score_mod, a distance table).

    Such a backend would otherwise run the scheme with no bias at all; every one of them calls this first.
    """
    if encoding.adds_content_bias:
        raise ValueError(
            f"attention={backend} cannot apply {encoding.label}'s content-dependent bias (it reads queries and keys, "
            "not only positions); use attention=sdpa, eager or auto"
        )


def refuse_own_attention(encoding: PositionalEncoding, backend: str) -> None:
    """Refuse a scheme that replaces the softmax in a backend whose kernel is a softmax (flex, flex_learnable, triton).

    Such a backend would otherwise run softmax attention in the scheme's place; every one of them calls this first.
    """
    if encoding.replaces_softmax:
        raise ValueError(
            f"attention={backend} runs softmax attention, which {encoding.label} replaces with its own; "
            "use attention=auto, sdpa or eager"
        )


def decoding_backend(name: str) -> str:
    """The backend cached decoding uses for a model built with ``name``: itself if it takes a query suffix."""
    _load()
    return name if name in _QUERY_SUFFIX else DECODING_FALLBACK


def available_backends() -> list[str]:
    """Backend names, ``auto`` included."""
    _load()
    return sorted(_BACKENDS)


def get_backend(name: str) -> Backend:
    """The backend called ``name``; an unknown name fails with the list of choices."""
    _load()
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(available_backends())}")
    return _BACKENDS[name]


def _load() -> None:
    from posenc.attention import auto, eager, flex, flex_learnable, sdpa, triton_table  # noqa: F401 - registration


__all__ = [
    "Backend",
    "available_backends",
    "decoding_backend",
    "get_backend",
    "refuse_content_bias",
    "refuse_own_attention",
    "register_backend",
]
