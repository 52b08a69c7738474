"""Registry of positional schemes: one file per scheme, discovered automatically.

Adding a scheme means adding ``posenc/encodings/<scheme>.py`` with a class decorated by ``@register`` (and,
for the CLI, ``conf/encoding/<scheme>.yaml``); nothing else changes. Names joined with ``+`` build a stack
(see ``stack.py``), which honours the same contract as a single scheme.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any, TypeVar

from posenc.encodings.base import PositionalEncoding

_REGISTRY: dict[str, type[PositionalEncoding]] = {}
_NOT_SCHEMES = {"base", "stack", "length"}
_discovered = False

T = TypeVar("T", bound=type[PositionalEncoding])


def register(cls: T) -> T:
    """Class decorator: make a scheme buildable by its ``name``."""
    if "-" in cls.name or "+" in cls.name:  # a layer's kind and a stack's members are read from these
        raise ValueError(f"a scheme's name may hold neither '-' nor '+', got {cls.name!r}")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"two schemes are registered as {cls.name!r}: {_REGISTRY[cls.name]} and {cls}")
    _REGISTRY[cls.name] = cls
    return cls


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    for module in pkgutil.iter_modules(__path__):
        if module.name not in _NOT_SCHEMES:
            importlib.import_module(f"{__name__}.{module.name}")
    _discovered = True


def available() -> list[str]:
    """Names of every registered scheme, sorted."""
    _discover()
    return sorted(_REGISTRY)


def scheme_class(name: str) -> type[PositionalEncoding]:
    """The class registered as ``name``; an unknown name fails with the list of choices."""
    _discover()
    if name not in _REGISTRY:
        raise ValueError(f"unknown positional scheme {name!r}; available: {', '.join(available())}")
    return _REGISTRY[name]


# A layer of a schedule is global (every earlier key) or local (a sliding window of keys): ``"local-rope"`` names a
# local RoPE layer, ``"rope"`` (or ``"global-rope"``) a global one. The kind is the backbone's; the scheme the rest. A
# hyphen, which no scheme's name holds, keeps the name a valid config key and command-line override, and a run's
# directory name valid on every file system.
LAYER_KINDS = ("global", "local")


def layer_kind(entry: str) -> tuple[str, str]:
    """``"local-rope+alibi"`` → ``("local", "rope+alibi")``; an entry without a kind is global."""
    if "-" not in entry:
        return "global", entry
    kind, _, scheme = entry.partition("-")
    kind = kind.strip()
    if kind not in LAYER_KINDS:
        raise ValueError(
            f"layer kind {kind!r} in {entry!r} must be one of {', '.join(LAYER_KINDS)}, e.g. local-rope for a "
            "sliding-window RoPE layer"
        )
    return kind, scheme.strip()


def stack_members(name: str) -> list[str]:
    """Member names of ``"a+b+c"`` (one name for a single scheme), after any layer kind; empty members fail clearly."""
    name = layer_kind(name)[1]
    parts = [part.strip() for part in name.split("+")]
    if not name.strip() or any(not part for part in parts):
        raise ValueError(f"empty scheme name in {name!r}; available: {', '.join(available())}")
    return parts


def build(name: str, *, num_heads: int, head_dim: int, **cfg: Any) -> PositionalEncoding:
    """Build the scheme ``name`` (or the stack ``"a+b"``) for attention with ``num_heads`` × ``head_dim``.

    ``cfg`` holds the scheme's options. For a stack, options are given per member under the member's name,
    e.g. ``build("rope+alibi", num_heads=8, head_dim=64, rope={"base": 500})``.
    """
    from posenc.encodings.stack import Stack

    parts = stack_members(name)
    if len(parts) == 1:
        return scheme_class(parts[0])(num_heads=num_heads, head_dim=head_dim, **cfg)
    unknown_options = set(cfg) - set(parts)
    if unknown_options:
        raise ValueError(
            f"options {sorted(unknown_options)} for stack {name!r} must be nested under a member's name, "
            f"e.g. {parts[0]}: {{...}}"
        )
    if len(set(parts)) != len(parts):
        raise ValueError(f"stack {name!r} names a scheme twice; each member may appear once")
    members = []
    for part in parts:
        options = cfg.get(part) or {}
        if not isinstance(options, Mapping):
            raise ValueError(f"options for {part!r} in stack {name!r} must be a mapping, got {options!r}")
        members.append(scheme_class(part)(num_heads=num_heads, head_dim=head_dim, **dict(options)))
    return Stack(members)


__all__ = ["PositionalEncoding", "available", "build", "register", "scheme_class", "stack_members"]
