"""Settings in units of the training length, and what training at that length can reach.

A scheme's paper chose some of its settings for the length it trained at: T5's 32 buckets up to distance 128 at
512 tokens, FIRE's threshold of 512 at 2,048, a learned table of one row per trained position. Copied unchanged to a
run at another length they mean something else: at L = 64, 32 buckets up to 128 put every distance from 64 on into
buckets that training never reaches, so every extrapolated score reads a bias that never trained. A scheme therefore
declares such a setting (``length_settings``, one ``LengthScaled`` each: the ratio to the training length its paper
used), and a run resolves every one it was not given from its own training length (``scale_to_length``); the
resolved values are recorded with the run.

``coverage`` then asks every scheme of a run which of its learnable positional parameters training at L can reach
(``PositionalEncoding.coverage``): a T5 bucket no distance below L falls into, a learned table's rows past L − 1, a
threshold training never crosses. Each gap is one line on the console before the first step and a record the
report marks columns by: an extrapolation that reads parameters that never trained is said, not silently reported.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torch import nn

from posenc.encodings import LAYER_KINDS, layer_kind, scheme_class, stack_members
from posenc.encodings.base import PositionalEncoding
from posenc.encodings.forms import LengthScaled

# A local layer's window when the config leaves it unset: half the training length, as Gemma 2 trained (4,096 of 8,192).
WINDOW = LengthScaled(1 / 2, "Gemma 2: 4,096 at L = 8,192")


def _window(spec: dict[str, Any], train_length: int) -> dict[str, Any]:
    """Resolve a layout's ``window`` in place (keys, from a fraction of L or the default); its record, if any."""
    names = spec["name"]
    entries = [names] if isinstance(names, str) else [str(entry) for entry in names]
    given = spec.get("window")
    if not any(layer_kind(entry)[0] == "local" for entry in entries):
        return {}
    if given is None:
        spec["window"] = WINDOW.at(train_length)
        return {"window": {"value": spec["window"], "rule": WINDOW.rule}}
    if isinstance(given, float) and 0 < given < 1:
        spec["window"] = max(1, math.ceil(given * train_length))
        return {"window": {"value": spec["window"], "rule": f"{given:g}·L (given as a fraction)"}}
    return {"window": {"value": given, "rule": "given"}}


def _members(spec: Mapping[str, Any]) -> tuple[list[str], bool]:
    """The single schemes a spec names, and whether its options are keyed by member (a stack or a schedule)."""
    names = spec["name"]
    entries = [names] if isinstance(names, str) else [str(entry) for entry in names]
    members = list(dict.fromkeys(member for entry in entries for member in stack_members(entry)))
    # As the backbone reads options (posenc/model.py): flat for one scheme, keyed by member for a stack or schedule.
    keyed = len(entries) > 1 or "+" in entries[0]
    return members, keyed


def scale_to_length(
    spec: Mapping[str, Any], train_length: int, inherited: Mapping[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``spec`` (an encoding config) with every length setting it leaves unset (absent or null) resolved.

    ``inherited``, another run's resolved encoding config (the parent a run starts from, or the earlier launch of a
    sweep's job), gives an unset setting its value first, wherever it configured the same scheme the same way
    (flat or keyed): a fine-tuned table keeps its parent's shape. Returns the resolved spec and a record
    ``{setting: {"value", "rule"}}`` (``member.setting`` in a stack) of every length setting of its schemes: the
    rule for the scaled ones, ``"given"`` for those the config set, ``"inherited"`` for those ``inherited`` set.
    """
    if train_length < 1:
        raise ValueError(f"the training length must be positive to scale settings to it, got {train_length}")
    resolved = {key: (dict(value) if isinstance(value, Mapping) else value) for key, value in spec.items()}
    members, keyed = _members(resolved)
    record: dict[str, Any] = {}
    earlier: Mapping[str, Any] = {}
    if inherited is not None and isinstance(inherited.get("name"), str | list):
        earlier_members, earlier_keyed = _members(inherited)
        earlier = inherited if earlier_keyed == keyed else {}
        earlier = {} if not set(members) & set(earlier_members) else earlier
    kinds = {f"{kind}-{member}": member for kind in LAYER_KINDS for member in members}
    # A local layer's own options (``local-<member>``) are resolved as the member's are.
    blocks = [*members, *(key for key in kinds if isinstance(resolved.get(key), Mapping))] if keyed else members
    for member in blocks:
        rules = scheme_class(kinds.get(member, member)).length_settings
        if not rules:
            continue
        options = resolved.setdefault(member, {}) if keyed else resolved
        before = (earlier.get(member) or {}) if keyed else earlier
        for setting, rule in rules.items():
            key = f"{member}.{setting}" if keyed else setting
            if options.get(setting) is not None:
                record[key] = {"value": options[setting], "rule": "given"}
            elif isinstance(before, Mapping) and before.get(setting) is not None:
                options[setting] = before[setting]
                record[key] = {"value": options[setting], "rule": "inherited"}
            else:
                options[setting] = rule.at(train_length)
                record[key] = {"value": options[setting], "rule": rule.rule}
    record.update(_window(resolved, train_length))
    return resolved, record


def coverage(model: nn.Module, train_length: int) -> dict[str, Any]:
    """What training at ``train_length`` leaves unreached among the positional parameters of ``model``'s schemes.

    ``{"train_length", "gaps": [{"scheme", "parameter", "note", ...}]}``: each single scheme class asked once (every
    layer of a run holds the same settings), in the order the model holds them.
    """
    gaps, asked = [], set()
    for module in model.modules():
        if not isinstance(module, PositionalEncoding) or module.members != [module]:
            continue
        key = (type(module), module.extra_repr())
        if key in asked:
            continue
        asked.add(key)
        gaps += [{"scheme": module.label, **gap} for gap in module.coverage(train_length)]
    return {"train_length": train_length, "gaps": gaps}


def settings_line(record: Mapping[str, Any], train_length: int) -> str | None:
    """The one console line saying what the length settings resolved to, or ``None`` when a scheme declares none."""
    if not record:
        return None
    parts = [f"{key}={entry['value']:g} ({entry['rule']})" for key, entry in record.items()]
    return f"length settings at L = {train_length}: " + "; ".join(parts)


def coverage_lines(record: Mapping[str, Any]) -> list[str]:
    """One console line per parameter that training at the run's length does not reach (none when all are)."""
    return [f"coverage: {gap['scheme']} {gap['parameter']}: {gap['note']}" for gap in record.get("gaps", [])]


__all__ = ["LengthScaled", "coverage", "coverage_lines", "scale_to_length", "settings_line"]
