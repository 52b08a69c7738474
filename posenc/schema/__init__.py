"""The config schema: every setting's type and range, enforced by pydantic once a config is composed.

``groups.py`` declares the settings (read it to learn a key); ``refusal`` validates a composed config against them
and turns what pydantic finds into the one line a user gets: the key, the value as typed, what the key accepts
(``eval.multiples=4 must be a non-empty list, each a whole number ≥ 1 (e.g. eval.multiples=[1,2,4])``). The entry
points call it before Hydra makes a directory (``composed.py``, from ``posenc/config.py``) and again on the config a
run trains with (``posenc.runs.validate``), so a sweep's every job is checked before the first starts. It imports
nothing of posenc but itself: every entry point can afford it before the heavy libraries load.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from posenc.schema.groups import EvaluateConfig, TrainConfig
from posenc.schema.types import as_override, describe

__all__ = ["EvaluateConfig", "TrainConfig", "as_override", "describe", "field_at", "leaves", "refusal"]

MISSING = "???"  # OmegaConf's mark of a value that must be given


def refusal(config: Mapping[str, Any], schema: type[BaseModel]) -> str | None:
    """The one line refusing ``config`` (a plain, resolved config) under ``schema``, or ``None`` when it is valid.

    Every problem is named, joined by "; ": a user fixes them in one go.
    """
    unset = [key for key, value in leaves(config) if value == MISSING]
    if unset:
        return "; ".join(f"{key} must be set{_example(schema, key)}" for key in unset)
    try:
        schema.model_validate(config)
    except ValidationError as err:
        lines = [_line(error, config, schema) for error in err.errors()]
        return "; ".join(dict.fromkeys(lines))
    return None


def leaves(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every setting of a plain config; a non-empty mapping is walked, anything else a leaf."""
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def field_at(schema: type[BaseModel], key: str) -> FieldInfo | None:
    """The declaration of a dotted key (``eval.passkey.depths``); ``None`` for a key the schema leaves open."""
    path, field = _walk(schema, key.split("."))
    return field if len(path) == key.count(".") + 1 else None


def _walk(schema: type[BaseModel], loc: tuple[Any, ...] | list[Any]) -> tuple[list[str], FieldInfo | None]:
    """The longest prefix of ``loc`` that names declared settings, and the last one's declaration."""
    path: list[str] = []
    field: FieldInfo | None = None
    annotation: Any = schema
    for part in loc:
        model = _model_in(annotation)
        named = {(info.alias or name): info for name, info in model.model_fields.items()} if model else {}
        if part not in named:
            break
        field = named[part]
        path.append(str(part))
        annotation = field.annotation
    return path, field


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The section a setting holds (``ContextScaling`` for ``ContextScaling | None``), if it holds one."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) is Union or type(annotation).__name__ == "UnionType":
        return next((m for m in map(_model_in, get_args(annotation)) if m is not None), None)
    return None


def _line(error: Any, config: Mapping[str, Any], schema: type[BaseModel]) -> str:
    path, field = _walk(schema, error["loc"])
    key = ".".join(path)
    if error["type"] == "value_error":  # two keys that disagree: the validator's own line names both
        return str(error["ctx"]["error"])
    if error["type"] == "missing":
        return f"{key} must be set{_example(schema, key)}"
    if error["type"] == "extra_forbidden":
        name = ".".join(str(part) for part in error["loc"])
        parent = name.rpartition(".")[0] or "the config"
        return f"{name} is not a setting of {parent}: --help lists the settings"
    accepts = describe(field.annotation, field.metadata) if field is not None else "valid"
    return f"{key}={as_override(_value(config, path))} must be {accepts}{_example(schema, key)}"


def _value(config: Mapping[str, Any], path: list[str]) -> Any:
    node: Any = config
    for part in path:
        node = node[part]
    return node


def _example(schema: type[BaseModel], key: str) -> str:
    field = field_at(schema, key)
    examples = field.examples if field is not None else None
    if not examples:
        annotation = field.annotation if field is not None else None
        examples = next((info.examples for info in _metadata(annotation) if info.examples), None)
    return f" (e.g. {key}={examples[0]})" if examples else ""


def _metadata(annotation: Any) -> list[FieldInfo]:
    """The declarations folded into a type (``Multiples`` carries its example)."""
    found = [item for item in get_args(annotation) if isinstance(item, FieldInfo)]
    for member in get_args(annotation):
        found += _metadata(member)
    return found
