"""Registry of attention backends: causal attention over already-rotated q, k, v, honouring a scheme's bias.

Every backend computes the same thing, softmax(q·kᵀ/√d + bias, causal) · v, and asks the scheme for its bias in
the form it can use: ``eager`` the dense ``bias()``, ``sdpa`` the dense bias as an attention mask (or none, for
the flash path), ``flex`` the ``score_mod``. A backend that cannot honour a scheme raises; none drops a bias.
``auto`` picks, per call, a backend that works for the device and the scheme.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from posenc.encodings.base import PositionalEncoding

# (q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, D), encoding, q_pos (Lq,), k_pos (Lk,)) -> (B, H, Lq, D)
Backend = Callable[[Tensor, Tensor, Tensor, PositionalEncoding, Tensor, Tensor], Tensor]

_BACKENDS: dict[str, Backend] = {}


def register_backend(name: str) -> Callable[[Backend], Backend]:
    def decorator(fn: Backend) -> Backend:
        _BACKENDS[name] = fn
        return fn

    return decorator


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


__all__ = ["Backend", "available_backends", "get_backend", "register_backend"]
