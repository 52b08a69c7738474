"""Registry of attention backends: causal attention over already-rotated q, k, v, honouring a scheme's bias.

Every backend computes the same thing, softmax(q·kᵀ/√d + bias, causal) · v, and asks the scheme for its bias in
the form it can use: ``eager`` the dense ``bias()``, ``sdpa`` the dense bias as an attention mask (or none, for
the flash path), ``flex`` the ``score_mod``. A backend that cannot honour a scheme raises; none drops a bias.
``auto`` picks, per call, a backend that works for the device and the scheme. A scheme that reads the layer's input
gets its keys' ``features`` from every backend.

A scheme that supplies its own attention (``supplies_attention``: PaTH, stick-breaking) is not a softmax with a bias:
``eager`` multiplies its dense reference weights by v, ``scheme`` runs its own memory-bounded ``attend`` (``auto``
picks it, and cached decoding falls back to it), and every backend built around softmax(q·kᵀ/√D + bias) refuses it
in one line (``refuse_supplied_attention``): none runs a softmax in its place. ``triton`` also runs stick-breaking's
attention in a fused kernel, for a scheme that declares its ``stick_form``, and refuses every other such scheme.

Every backend takes the layer's sink (``sink``: ``posenc/attention/sink.py``), the columns a softmax row holds in
front of the keys: ``eager`` puts them in its dense softmax, ``sdpa`` in front of the keys it hands SDPA, and the
kernels that return the row log-sum-exp (``flex``, ``flex_learnable``, ``triton``) merge them with their output.

A local (sliding-window) layer passes its ``window`` (``posenc/attention/window.py``): ``eager`` and ``sdpa`` apply it
in their masks, ``flex`` in its block mask and ``triton``'s table kernel in its tiles; ``flex_learnable`` and the
schemes' own attentions (``scheme``, stick-breaking's kernel) refuse it in one line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from torch import Tensor

from posenc.attention.sink import SinkColumns
from posenc.encodings.base import PositionalEncoding


class Backend(Protocol):
    """Causal attention over rotated q, k, v, honouring the scheme: (B, H, Lq, D).

    q (B, H, Lq, D), k and v (B, H, Lk, D), the scheme, q_pos (Lq,), k_pos (Lk,), ``features`` (B, Lk, F): the
    keys' ``token_features`` of a scheme that reads the layer's input (``None`` for every other scheme), and ``sink``:
    the layer's sink columns (``None`` without one), and ``window``: a local layer's (``None``: a global layer).
    """

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        encoding: PositionalEncoding,
        q_pos: Tensor,
        k_pos: Tensor,
        features: Tensor | None = None,
        sink: SinkColumns | None = None,
        window: int | None = None,
    ) -> Tensor: ...


_BACKENDS: dict[str, Backend] = {}
# Backends that accept queries at a suffix of the key positions (Lq < Lk, q_pos = k_pos[-Lq:]), as cached
# decoding calls them: new queries over every cached key.
_QUERY_SUFFIX: set[str] = set()
# What cached decoding uses when the model's backend cannot take a query suffix (flex's kernel is self-attention
# over one window): exact for every softmax scheme, with a (Lq × Lk) mask that is one row per decoded token. A
# scheme that supplies its own attention falls back to ``scheme`` instead (``decoding_backend``).
DECODING_FALLBACK = "sdpa"


# Per backend, the schemes it refuses from their declarations alone: each a check (encoding, backend) that raises
# ValueError with what to use instead. A backend runs them on every call (``refuse``), and a run asks them before its
# first step (``scheme_refusal``), so a scheme a backend cannot honour is one line, not a traceback mid-training.
Refusal = Callable[[PositionalEncoding, str], None]
_REFUSALS: dict[str, tuple[Refusal, ...]] = {}


def register_backend(
    name: str, *, query_suffix: bool = False, refuses: tuple[Refusal, ...] = ()
) -> Callable[[Backend], Backend]:
    """Register a backend.

    ``query_suffix`` declares that it accepts Lq < Lk (new queries over cached keys); ``refuses`` lists the checks by
    which it turns down a scheme from its declarations (``refuse``).
    """

    def decorator(fn: Backend) -> Backend:
        _BACKENDS[name] = fn
        _REFUSALS[name] = refuses
        if query_suffix:
            _QUERY_SUFFIX.add(name)
        return fn

    return decorator


def refuse_content_bias(encoding: PositionalEncoding, backend: str) -> None:
    """Refuse a bias that reads q and k in a backend that sees positions only (a score_mod, a distance table).

    Such a backend would otherwise run the scheme with no bias at all; every one of them lists this among its
    ``refuses``, after ``refuse_supplied_attention``.
    """
    if encoding.adds_content_bias:
        raise ValueError(
            f"attention={backend} cannot apply {encoding.label}'s content-dependent bias (it reads queries and keys, "
            "not only positions); use attention=sdpa, eager or auto"
        )


def refuse_supplied_attention(encoding: PositionalEncoding, backend: str) -> None:
    """Refuse a scheme that supplies its own attention in a backend that computes softmax(q·kᵀ/√D + bias).

    Such a backend (sdpa, flex, flex_learnable) would otherwise run softmax attention in the scheme's place; every one
    of them lists this first among its ``refuses`` (``triton`` its own, which lets stick-breaking's ``stick_form``
    through to its fused kernel).
    """
    if encoding.supplies_attention:
        raise ValueError(
            f"attention={backend} runs softmax(q·kᵀ/√D + bias) attention and {encoding.label} supplies its own "
            "attention instead; use attention=auto, scheme or eager"
        )


def refuse(encoding: PositionalEncoding, backend: str) -> None:
    """Raise (ValueError, one line) when ``backend`` cannot honour ``encoding`` by its declarations."""
    for check in _REFUSALS.get(backend, ()):
        check(encoding, backend)


def scheme_refusal(backend: str, encoding: PositionalEncoding) -> str | None:
    """The line ``backend`` refuses ``encoding`` with, or ``None``: asked before a run's first step."""
    _load()
    try:
        refuse(encoding, backend)
    except ValueError as err:
        return str(err)
    return None


def decoding_backend(name: str, encoding: PositionalEncoding | None = None) -> str:
    """The backend cached decoding uses for a model built with ``name`` and ``encoding``.

    Itself if it takes a query suffix; else the scheme's own attention for a scheme that supplies one; else
    ``DECODING_FALLBACK``.
    """
    _load()
    if name in _QUERY_SUFFIX:
        return name
    return "scheme" if encoding is not None and encoding.supplies_attention else DECODING_FALLBACK


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
    from posenc.attention import auto, eager, flex, flex_learnable, scheme, sdpa, triton_table  # noqa: F401 - registration


__all__ = [
    "Backend",
    "available_backends",
    "decoding_backend",
    "get_backend",
    "refuse_content_bias",
    "refuse_supplied_attention",
    "register_backend",
]
