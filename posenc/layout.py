"""How an encoding spec becomes the model's layers: the input's scheme, each layer's scheme, and each layer's kind.

A spec is a scheme name (``"alibi"``), a stack (``"rope+alibi"``), a per-layer schedule cycled over the layers
(``["rope", "rope", "rope", "nope"]``), a config mapping ``{"name": ..., **options}`` (flat options for one scheme,
keyed by member name for stacks and schedules), or a built scheme shared by every layer.

A schedule names each layer's kind with its scheme, one config a layout: ``"local-rope"`` is a sliding-window RoPE
layer, ``"rope"`` (``"global-rope"``) a global one, and the spec's ``window`` sizes every local layer (in keys, or a
fraction of the training length that a run resolves, ``posenc.encodings.length``). A local layer's members read their
options under ``local-<member>`` first, so one layout can hold RoPE at two bases (Gemma 3's local 10k, global 1M).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from posenc.attention.window import check_window
from posenc.encodings import build, layer_kind, scheme_class, stack_members
from posenc.encodings.base import PositionalEncoding

EncodingSpec = str | Sequence[str] | Mapping[str, Any] | PositionalEncoding


def _split_spec(spec: EncodingSpec) -> tuple[list[str] | str | PositionalEncoding, dict[str, Any]]:
    """Separate a spec into its name(s) and its options (``{"name": ..., **options}`` or a bare name/list)."""
    if isinstance(spec, PositionalEncoding):
        return spec, {}
    if isinstance(spec, Mapping):
        options = {key: value for key, value in spec.items() if key not in ("name", "label")}
        if "name" not in spec:
            raise ValueError(f"encoding config {dict(spec)} has no 'name' (a scheme, 'a+b', or a per-layer list)")
        spec = spec["name"]
    else:
        options = {}
    if isinstance(spec, str):
        return spec, options
    entries = [str(entry) for entry in spec]
    if not entries:
        raise ValueError("an empty per-layer schedule: give at least one scheme, e.g. [rope, rope, rope, nope]")
    return (entries[0] if len(entries) == 1 else entries), options


def _member_options(entry: str, options: Mapping[str, Any], keyed: bool) -> dict[str, Any]:
    """Options for one schedule entry: flat for a single uniform scheme, keyed by member name otherwise.

    A local layer's members read ``local-<member>`` first, then ``<member>``: Gemma 3's local RoPE layers have base
    10k where its global ones have 1M (``rope: {base: 1000000}``, ``local-rope: {base: 10000}``).
    """
    if not keyed:
        return dict(options)
    kind, _ = layer_kind(entry)

    def of(member: str) -> Any:
        own = options.get(f"{kind}-{member}")
        return own if own is not None else options.get(member)

    parts = stack_members(entry)
    if len(parts) == 1:
        return dict(of(parts[0]) or {})
    return {part: dict(of(part)) for part in parts if of(part) is not None}


def _split_absolute(entry: str) -> tuple[str | None, str | None]:
    """Split ``"a+b+c"`` into the members acting on the input (absolute) and those acting in attention."""
    parts = stack_members(entry)
    absolute = [part for part in parts if scheme_class(part).absolute]
    relative = [part for part in parts if not scheme_class(part).absolute]
    return ("+".join(absolute) or None), ("+".join(relative) or None)


def _window(spec_window: Any, kinds: Sequence[str], spec: Any) -> int | None:
    """The local layers' window in keys, from the spec's ``window``; ``None`` when no layer is local."""
    local = "local" in kinds
    if not local:
        if spec_window is not None:
            raise ValueError(
                f"encoding.window={spec_window} sizes the local layers' window, and no layer of {spec} is local: "
                "name one local-<scheme>, e.g. [local-rope, rope], or drop the window"
            )
        return None
    if spec_window is None:
        raise ValueError(f"{spec} has local layers: give their window, encoding.window=<keys> (or a fraction of L)")
    if isinstance(spec_window, float) and not float(spec_window).is_integer():
        raise ValueError(
            f"encoding.window={spec_window} is a fraction of the training length: a run resolves it to keys "
            "(posenc.encodings.length.scale_to_length); building a model directly, give it in keys"
        )
    window = int(spec_window) if isinstance(spec_window, float) else spec_window
    check_window(window)
    return window


def schedule_label(entries: Sequence[str]) -> str:
    """Readable name of a per-layer schedule: runs collapsed, ``["rope"]*3 + ["nope"]`` → ``rope×3,nope``."""
    runs: list[list[Any]] = []
    for entry in entries:
        if runs and runs[-1][0] == entry:
            runs[-1][1] += 1
        else:
            runs.append([entry, 1])
    return ",".join(name if count == 1 else f"{name}×{count}" for name, count in runs)


def encoding_label(spec: EncodingSpec) -> str:
    """Readable name of any encoding spec (a scheme, a stack, a schedule), without building it.

    A config may name itself (``label``): a deployed layout is known by its model's name, and two layouts that differ
    only in their members' options (iRoPE's and RNoPE-SWA's RoPE bases) would otherwise share a run directory.
    """
    if isinstance(spec, Mapping) and spec.get("label"):
        return str(spec["label"])
    names, options = _split_spec(spec)
    if isinstance(names, PositionalEncoding):
        return names.label
    if not isinstance(names, str):
        return schedule_label(names)
    try:
        kind, scheme = layer_kind(names)
        parts = stack_members(scheme)
        if len(parts) == 1:
            label = scheme_class(scheme).label_of(options)
        else:
            label = "+".join(scheme_class(part).label_of(_keyed(options, part)) for part in parts)
    except ValueError:  # not a registered scheme: the name as given (building it refuses it in one line)
        return names
    return label if kind == "global" else f"{kind}-{label}"


def _keyed(options: Mapping[str, Any], part: str) -> Mapping[str, Any]:
    value = options.get(part)
    return value if isinstance(value, Mapping) else {}


def build_layers(
    spec: EncodingSpec, depth: int, heads: int, head_dim: int
) -> tuple[PositionalEncoding | None, list[PositionalEncoding], list[int | None]]:
    """The input's scheme, each layer's, and each layer's window (``None``: global; the spec's ``window``: local)."""
    names, options = _split_spec(spec)
    if isinstance(names, PositionalEncoding):
        return names, [names] * depth, [None] * depth
    spec_window = options.pop("window", None)
    if isinstance(names, str):
        kind, names = layer_kind(names)
        prefix = "" if kind == "global" else f"{kind}-"
        absolute, relative = _split_absolute(names)
        keyed = "+" in names  # a stack's options are keyed by member; a single scheme's are flat
        input_encoding = None
        if absolute is not None:
            absolute_options = _member_options(absolute, options, keyed)
            input_encoding = build(absolute, num_heads=heads, head_dim=head_dim, **absolute_options)
        if relative is None:  # purely absolute: attention layers see no position at all
            relative, options = "nope", {}
        entries = [prefix + relative]
    else:
        for entry in names:
            absolute, _ = _split_absolute(entry)
            if absolute is not None:
                raise ValueError(
                    f"absolute scheme {absolute!r} cannot sit in a per-layer schedule {list(names)}: it acts once "
                    "on the input, not per layer. Put it in a stack for every layer (e.g. 'learned+alibi') instead"
                )
        input_encoding, entries, keyed = None, list(names), True
        kinds = {layer_kind(entry)[0] for entry in entries}
        members = {member for entry in entries for member in stack_members(entry)}
        stray = sorted(set(options) - members - {f"{kind}-{member}" for kind in kinds for member in members})
        if stray:
            raise ValueError(
                f"options {stray} of the per-layer schedule {entries} must be nested under a member's name "
                f"(one of {sorted(members)}), e.g. {stack_members(entries[0])[0]}: {{...}}"
            )
    layers, kinds = [], []
    for i in range(depth):
        entry = entries[i % len(entries)]
        kind, scheme = layer_kind(entry)
        layer = build(scheme, num_heads=heads, head_dim=head_dim, **_member_options(entry, options, keyed))
        if kind == "local" and layer.supplies_attention:
            raise ValueError(
                f"a local layer limits a softmax row to a window, and {layer.label} supplies its own attention "
                f"with none: give it global layers ({scheme}, not {entry})"
            )
        if kind == "local" and layer.scales_with_length:  # it counts the keys before any window cuts the row
            raise ValueError(
                f"{layer.label} scales each query by the number of keys it sees, counted from positions, which a "
                f"local layer's window would cut: give it global layers ({scheme}, not {entry})"
            )
        layers.append(layer)
        kinds.append(kind)
    lost = sorted({layer_kind(entry)[0] for entry in entries} - set(kinds))
    if lost:
        raise ValueError(
            f"the layout {list(entries)} cycles over {depth} layers and leaves no {lost[0]} layer: give the model a "
            f"depth of at least {len(entries)} (a multiple of it keeps the layout's ratio)"
        )
    window = _window(spec_window, kinds, names)
    return input_encoding, layers, [window if kind == "local" else None for kind in kinds]
