"""The kinds of value a setting takes, and each described as a refusal names it ("a whole number ≥ 1").

A setting's type is declared once, in ``posenc/schema/groups.py``, with these words; ``describe`` reads the same
declaration back, so the line that refuses a value says what the schema accepts and can never drift from it.
Numbers are typed as Hydra parses them from the command line: ``3`` is a whole number, ``3.0`` and ``1e-3`` numbers
(a whole number is accepted where a number is), ``true`` a boolean, ``[1,2]`` a list, ``null`` nothing.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel, BeforeValidator, Field
from pydantic.fields import FieldInfo


def _number_as_text(value: Any) -> Any:
    return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value


# A name may be typed as a number (sweep_name=2024): Hydra reads it as one, the setting is still its text.
Text = Annotated[str, BeforeValidator(_number_as_text)]
Count = Annotated[int, Field(ge=1)]
Natural = Annotated[int, Field(ge=0)]
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]
AtLeastOne = Annotated[float, Field(ge=1, allow_inf_nan=False)]
Fraction = Annotated[float, Field(gt=0, le=1)]  # a share of something, 1 included: (0, 1]
Share = Annotated[float, Field(ge=0, le=1)]  # [0, 1]
Multiples = Annotated[list[Count], Field(min_length=1, examples=["[1,2,4]"])]
Auto = Literal["auto"]


def as_override(value: Any) -> str:
    """A value as it is typed on the command line (``[1,2,4]``, ``true``, ``null``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return "[" + ",".join(as_override(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{key}:{as_override(item)}" for key, item in value.items()) + "}"
    return str(value)


def describe(annotation: Any, constraints: Sequence[Any] = ()) -> str:
    """What a type accepts, in words: ``a whole number ≥ 1``, ``one of nonoverlap, sliding``, ``… or null``."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return describe(args[0], [*constraints, *_constraints(args[1:])])
    titled = next((c.title for c in constraints if isinstance(c, FieldInfo) and c.title), None)
    if titled:
        return titled
    if origin in (Union, types.UnionType):
        members = [member for member in args if member is not type(None)]
        described = [describe(member) for member in members]
        if len(described) > 1:  # true, false or auto
            described = [("true, false" if word == "true or false" else word) for word in described]
        words = _either(described)
        return words + (" or null" if len(members) < len(args) else "")
    if origin is Literal:
        values = [as_override(value) for value in args]
        return values[0] if len(values) == 1 else "one of " + ", ".join(values)
    if origin is list:
        return _list(args[0] if args else Any, constraints)
    if origin is dict or annotation is dict:
        return "a mapping {key:value,...}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "a mapping {" + ",".join(f"{name}:..." for name in annotation.model_fields) + "}"
    if annotation is bool:
        return "true or false"
    if annotation is int:
        return "a whole number" + _bounds(constraints)
    if annotation is float:
        bounds = _bounds(constraints)
        return "a positive number" if bounds == " > 0" else "a number" + bounds
    if annotation is str:
        return "text"
    return "anything"


def _constraints(extras: Sequence[Any]) -> list[Any]:
    found: list[Any] = []
    for extra in extras:
        found += [extra, *extra.metadata] if isinstance(extra, FieldInfo) else [extra]
    return found


def _bounds(constraints: Sequence[Any]) -> str:
    low = next((c for c in constraints if isinstance(c, annotated_types.Ge | annotated_types.Gt)), None)
    high = next((c for c in constraints if isinstance(c, annotated_types.Le | annotated_types.Lt)), None)
    if low is not None and high is not None:
        left = "[" if isinstance(low, annotated_types.Ge) else "("
        right = "]" if isinstance(high, annotated_types.Le) else ")"
        return f" in {left}{_number(low)}, {_number(high)}{right}"
    if low is not None:
        return f" {'≥' if isinstance(low, annotated_types.Ge) else '>'} {_number(low)}"
    if high is not None:
        return f" {'≤' if isinstance(high, annotated_types.Le) else '<'} {_number(high)}"
    return ""


def _number(bound: Any) -> str:
    value = next(getattr(bound, name) for name in ("ge", "gt", "le", "lt") if hasattr(bound, name))
    return str(value) if isinstance(value, int) else f"{value:g}"


def _list(item: Any, constraints: Sequence[Any]) -> str:
    low = next((c.min_length for c in constraints if isinstance(c, annotated_types.MinLen)), 0)
    high = next((c.max_length for c in constraints if isinstance(c, annotated_types.MaxLen)), None)
    size = f"a list of {low}" if low == high else "a non-empty list" if low else "a list"
    return f"{size}, each {describe(item)}"


def _either(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]
