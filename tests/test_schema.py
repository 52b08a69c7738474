"""The schema misses no key: every setting refuses a value of the wrong kind, or out of its range, in one line.

The values are generated from each setting's declared type (Hypothesis), for every leaf of every composed config of
``posenc.train`` (every option of every group) and ``posenc.evaluate``: a setting added to ``conf/`` without a
declaration, or declared looser than a value it cannot take, fails here. A sample goes through the real command
lines: one line on stderr, no traceback, nothing on disk.
"""

from __future__ import annotations

import copy
import os
import string
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
import pytest
from helpers import compose_train
from hydra import compose, initialize_config_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from posenc.config import CONF_DIR
from posenc.schema import EvaluateConfig, TrainConfig, as_override, field_at, leaves, refusal
from posenc.schema import groups as schema_groups
from posenc.schema.types import Text

NUMBER_AS_TEXT = get_args(Text)[1]
GROUPS = {group.name: sorted(p.stem for p in group.glob("*.yaml")) for group in CONF_DIR.iterdir() if group.is_dir()}


def _plain(config: Any) -> dict[str, Any]:
    return OmegaConf.to_container(config, resolve=True, throw_on_missing=False)  # type: ignore[return-value]


def _train_configs() -> list[dict[str, Any]]:
    """A composed config for every option of every group (a text corpus given its files)."""
    configs = []
    for group, options in GROUPS.items():
        for option in options:
            if group == "encoding":
                configs.append(_plain(compose_train(f"+encoding={option}")))
            else:
                extra = ["data.corpus_options.paths=[notes.txt]"] if (group, option) == ("data", "text") else []
                configs.append(_plain(compose_train("+encoding=alibi", f"{group}={option}", *extra)))
    return configs


def _evaluate_config() -> dict[str, Any]:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return _plain(compose(config_name="evaluate", overrides=["target=runs/x"]))


TRAIN_CONFIGS = _train_configs()
EVALUATE_CONFIG = _evaluate_config()


def _owned_by_scheme(key: str) -> bool:
    return key.startswith("encoding.") and key != "encoding.name"


def _cases() -> list[tuple[str, type[BaseModel], dict[str, Any]]]:
    """(key, schema, a config that has it) for every leaf, each key once."""
    found: dict[tuple[str, type[BaseModel]], dict[str, Any]] = {}
    for schema, configs in ((TrainConfig, TRAIN_CONFIGS), (EvaluateConfig, [EVALUATE_CONFIG])):
        for config in configs:
            for key, _ in leaves(config):
                if not _owned_by_scheme(key):
                    found.setdefault((key, schema), config)
    return [(key, schema, config) for (key, schema), config in found.items()]


CASES = _cases()
IDS = [f"{'train' if schema is TrainConfig else 'evaluate'}:{key}" for key, schema, _ in CASES]


# ---------------------------------------------------------------------------------------------------------------
# Values from a declared type


def _kinds(annotation: Any) -> tuple[set[type], list[Any]]:
    """The Python types a declared type takes, and the literal values it takes."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated and NUMBER_AS_TEXT in args[1:]:  # Text: a name may be typed as a number
        return {str, int, float}, []
    if origin is Annotated:
        return _kinds(args[0])
    if origin in (Union, types.UnionType):
        kinds: set[type] = set()
        literals: list[Any] = []
        for member in args:
            more, values = _kinds(member)
            kinds |= more
            literals += values
        return kinds, literals
    if origin is Literal:
        return set(), list(args)
    if origin is list:
        return {list}, []
    if origin is dict or annotation is dict or (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        return {dict}, []
    if annotation is float:
        return {int, float}, []
    return {annotation}, []


LETTERS = st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=8).filter(
    lambda text: text not in ("true", "false", "null", "inf", "nan")  # words Hydra reads as other types
)
ANY_KIND = {
    bool: st.booleans(),
    int: st.integers(-1000, 10**6),
    float: st.floats(-1000, 1000).map(lambda x: round(x, 3)),
    str: LETTERS,
    list: st.lists(st.one_of(st.integers(-3, 3), LETTERS), min_size=1, max_size=3),
    dict: st.dictionaries(LETTERS, st.integers(0, 3), min_size=1, max_size=2),
    type(None): st.none(),
}


def _takes(kinds: set[type], literals: list[Any], value: Any) -> bool:
    return type(value) in kinds or any(value == lit and type(value) is type(lit) for lit in literals)


def wrong_kind(annotation: Any) -> st.SearchStrategy[Any]:
    """A value of a kind the type does not take (a list where a number goes, a word outside a choice); inside a list,
    a list holding such a value."""
    kinds, literals = _kinds(annotation)
    values = st.one_of(*ANY_KIND.values()).filter(lambda value: not _takes(kinds, literals, value))
    item = _list_item(annotation)
    return values if item is None else st.one_of(values, wrong_kind(item).map(lambda value: [value]))


def _list_item(annotation: Any) -> Any:
    """The item type of the one list type ``annotation`` takes, if it takes one."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _list_item(args[0])
    if origin in (Union, types.UnionType):
        items = [item for item in map(_list_item, args) if item is not None]
        return items[0] if len(items) == 1 else None
    return args[0] if origin is list else None


def out_of_range(annotation: Any, constraints: list[Any]) -> st.SearchStrategy[Any] | None:
    """A value of a kind the type takes, past a bound it declares; ``None`` where it declares none."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        extras = [
            c for extra in args[1:] for c in ([extra, *extra.metadata] if isinstance(extra, FieldInfo) else [extra])
        ]
        return out_of_range(args[0], [*constraints, *extras])
    if origin in (Union, types.UnionType):
        _, literals = _kinds(annotation)
        found = [s for s in (out_of_range(member, []) for member in args) if s is not None]
        return st.one_of(*found).filter(lambda v: v not in literals) if found else None
    if origin is list:
        low = next((c.min_length for c in constraints if isinstance(c, annotated_types.MinLen)), 0)
        item = out_of_range(args[0], [])
        options = [st.just([0.5] * (low - 1) if low > 1 else [])] if low else []
        options += [item.map(lambda value: [value])] if item is not None else []
        return st.one_of(*options) if options else None
    if annotation not in (int, float):
        return None
    bounds = []
    for bound in constraints:
        if isinstance(bound, annotated_types.Ge):
            bounds.append(_below(annotation, bound.ge, inclusive=False))
        elif isinstance(bound, annotated_types.Gt):
            bounds.append(_below(annotation, bound.gt, inclusive=True))
        elif isinstance(bound, annotated_types.Le):
            bounds.append(_above(annotation, bound.le, inclusive=False))
        elif isinstance(bound, annotated_types.Lt):
            bounds.append(_above(annotation, bound.lt, inclusive=True))
    return st.one_of(*bounds) if bounds else None


def _below(kind: type, bound: float, inclusive: bool) -> st.SearchStrategy[Any]:
    if kind is int:
        return st.integers(int(bound) - 1000, int(bound) - (0 if inclusive else 1))
    values = st.floats(bound - 1000, bound, exclude_max=not inclusive)
    return values.map(lambda x: round(x, 3)).filter(lambda x: x <= bound if inclusive else x < bound)


def _above(kind: type, bound: float, inclusive: bool) -> st.SearchStrategy[Any]:
    if kind is int:
        return st.integers(int(bound) + (0 if inclusive else 1), int(bound) + 1000)
    values = st.floats(bound, bound + 1000, exclude_min=not inclusive)
    return values.map(lambda x: round(x, 3)).filter(lambda x: x >= bound if inclusive else x > bound)


def _with(config: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    changed = copy.deepcopy(config)
    node = changed
    *parents, last = key.split(".")
    for part in parents:
        node = node[part]
    node[last] = value
    return changed


def _assert_refused(line: str | None, key: str, value: Any) -> None:
    assert line is not None, f"{key}={as_override(value)} was accepted"
    assert "\n" not in line and key in line, line
    if not isinstance(value, dict):
        assert f"{key}={as_override(value)}" in line, line


# ---------------------------------------------------------------------------------------------------------------
# In process: every leaf


def test_every_setting_of_every_config_is_declared_and_every_config_is_valid() -> None:
    for schema, configs in ((TrainConfig, TRAIN_CONFIGS), (EvaluateConfig, [EVALUATE_CONFIG])):
        for config in configs:
            if config.get("data", {}).get("corpus") != "text":
                assert refusal(config, schema) is None
            undeclared = [key for key, _ in leaves(config) if not _owned_by_scheme(key) and not field_at(schema, key)]
            assert undeclared == []
    assert len(CASES) > 100  # every group's keys, not a sample of them


FAST_HYPOTHESIS = settings(
    max_examples=8, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.filter_too_much]
)


@pytest.mark.parametrize(("key", "schema", "config"), CASES, ids=IDS)
@FAST_HYPOTHESIS
@given(data=st.data())
def test_a_value_of_the_wrong_kind_is_refused_in_one_line(
    key: str, schema: type[BaseModel], config: dict[str, Any], data: st.DataObject
) -> None:
    field = field_at(schema, key)
    assert field is not None
    value = data.draw(wrong_kind(field.rebuild_annotation()), label=key)
    _assert_refused(refusal(_with(config, key, value), schema), key, value)


def _ranged(key: str, schema: type[BaseModel]) -> bool:
    field = field_at(schema, key)
    return field is not None and out_of_range(field.annotation, list(field.metadata)) is not None


RANGED = [(key, schema, config) for key, schema, config in CASES if _ranged(key, schema)]


@pytest.mark.parametrize(("key", "schema", "config"), RANGED, ids=[f"{s.__name__}:{k}" for k, s, _ in RANGED])
@FAST_HYPOTHESIS
@given(data=st.data())
def test_a_value_out_of_its_range_is_refused_in_one_line(
    key: str, schema: type[BaseModel], config: dict[str, Any], data: st.DataObject
) -> None:
    field = field_at(schema, key)
    assert field is not None
    strategy = out_of_range(field.annotation, list(field.metadata))
    assert strategy is not None
    value = data.draw(strategy, label=key)
    _assert_refused(refusal(_with(config, key, value), schema), key, value)


def test_the_ranges_that_matter_are_declared() -> None:
    keys = {f"{s.__name__}:{k}" for k, s, _ in RANGED}
    for key in (
        "data.seq_len",
        "optim.lr",
        "optim.betas",
        "eval.multiples",
        "trainer.max_steps",
        "seed",
        "model.dropout",
    ):
        assert f"TrainConfig:{key}" in keys
    assert "EvaluateConfig:eval.passkey.depths" in keys


# ---------------------------------------------------------------------------------------------------------------
# The schema's choices are the code's


def test_the_schemas_choices_are_the_codes() -> None:
    from lightning.fabric.connector import _PRECISION_INPUT
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.strategies import StrategyRegistry

    from posenc.attention import available_backends
    from posenc.data.corpora import SPLITS
    from posenc.data.mqar import KV_OFFSETS
    from posenc.data.retrieval import RETRIEVAL_TASKS
    from posenc.encodings.rope import SCALINGS

    assert set(get_args(schema_groups.BACKENDS)) == set(available_backends()) == set(GROUPS["attention"])
    assert get_args(schema_groups.ROPE_SCALINGS) == SCALINGS
    assert get_args(schema_groups.SPLITS) == SPLITS
    assert get_args(get_args(schema_groups.TaskOptions.model_fields["kv_offset"].annotation)[0]) == KV_OFFSETS
    tasks = get_args(get_args(schema_groups.Data.model_fields["task"].annotation)[0])
    assert set(tasks) == {"passkey", "copy", *RETRIEVAL_TASKS}
    assert set(get_args(schema_groups.STRATEGIES)) <= {"auto", *StrategyRegistry.available_strategies()}
    assert set(get_args(schema_groups.ACCELERATORS)) <= {"auto", "gpu", *AcceleratorRegistry.available_accelerators()}
    lightning = {value for member in get_args(_PRECISION_INPUT) for value in typing.get_args(member)}
    assert set(get_args(schema_groups.PRECISIONS)) == {"auto", *lightning}


# ---------------------------------------------------------------------------------------------------------------
# Through the command line: a sample


DEFAULT_LEAVES = [
    (key, TrainConfig) for key, _ in leaves(_plain(compose_train("+encoding=alibi"))) if key != "encoding.name"
]
DEFAULT_LEAVES += [(key, EvaluateConfig) for key, _ in leaves(EVALUATE_CONFIG) if key != "target"]


def _command_line_value(value: Any) -> bool:
    """A value that Hydra reads back as itself from ``key=<as typed>``."""
    if isinstance(value, dict | list):
        return all(map(_command_line_value, value.values() if isinstance(value, dict) else value))
    return not isinstance(value, str) or value.isalpha()


@pytest.mark.slow
@settings(
    max_examples=4,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_a_sample_through_the_command_line_gets_one_line_and_leaves_nothing(
    tmp_path: Path, data: st.DataObject
) -> None:
    key, schema = data.draw(st.sampled_from(DEFAULT_LEAVES), label="key")
    field = field_at(schema, key)
    assert field is not None
    ranged = out_of_range(field.annotation, list(field.metadata))
    wrong = wrong_kind(field.rebuild_annotation())
    strategy = wrong if ranged is None else st.one_of(wrong, ranged)
    value = data.draw(strategy.filter(_command_line_value), label="value")
    cwd = Path(tmp_path, f"{len(list(tmp_path.iterdir()))}")
    cwd.mkdir()
    command = ["posenc.train", "+encoding=alibi"] if schema is TrainConfig else ["posenc.evaluate", "runs/x"]
    result = subprocess.run(
        [sys.executable, "-m", *command, f"{key}={as_override(value)}"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "WANDB_MODE": "disabled"},
    )
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1 and key in lines[0], result.stderr
    assert list(cwd.iterdir()) == []
