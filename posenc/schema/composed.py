"""A config as Hydra composed it, checked before Hydra runs: every value against the schema, and its directory.

The entry points compose the command line's config themselves first (``posenc/config.py``), so that a wrong value
or a directory that cannot be made is refused in one line before Hydra makes anything. ``settings_help`` is the
other use of a composed config: a ``--help`` that says what each setting accepts, read from the schema.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel

from posenc.jsonio import cannot_create
from posenc.schema import EvaluateConfig, as_override, describe, field_at, leaves, refusal


def check_composed(config: DictConfig, schema: type[BaseModel], multirun: bool) -> dict[str, Any] | None:
    """Every value of a composed config (Hydra's node included) against ``schema``, and the directory Hydra makes.

    ``SystemExit`` with one line on the first problem. ``${hydra:...}`` in a setting resolves as the job will see it.
    A sweep's values are checked per job by the sweep's preflight, which can name the job (``None`` is returned); its
    directory here. A single run's plain, resolved config is returned, for checks of the machine it will run on.
    """
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().set_config(config)
    task = config.copy()
    with open_dict(task):
        task.pop("hydra", None)
    plain, unresolved = _resolved(task)
    if not multirun and (line := refusal(plain, schema)) is not None:
        raise SystemExit(line)
    if unresolved is not None:
        raise SystemExit(unresolved)
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    try:
        directory = OmegaConf.select(config, key)
    except OmegaConfBaseException as err:
        raise SystemExit(f"cannot resolve {key}: {str(err).splitlines()[0]}") from None
    writes = OmegaConf.select(config, "hydra.output_subdir") is not None  # posenc.evaluate writes in its run only
    if directory is not None and (why := cannot_create(Path(str(directory)), write=writes)) is not None:
        raise SystemExit(f"{key}={directory}: {why}; choose a writable place, e.g. output_root=<dir>")
    return None if multirun else plain


def _resolved(config: DictConfig) -> tuple[dict[str, Any], str | None]:
    """A config as plain values, and the line for an interpolation that cannot resolve (or ``None``).

    Interpolations read other settings (``run_name`` reads the scheme and ``data.seq_len``): one that fails on a bad
    value stays as written, so that the schema names the value rather than the interpolation that read it.
    """
    try:
        return OmegaConf.to_container(config, resolve=True, throw_on_missing=False), None  # type: ignore[return-value]
    except OmegaConfBaseException as err:
        unresolved = f"cannot resolve {err.full_key}: {str(err).splitlines()[0]}"
    plain: dict[str, Any] = OmegaConf.to_container(config, resolve=False, throw_on_missing=False)  # type: ignore[assignment]
    for key, value in leaves(plain):
        if isinstance(value, str) and "${" in value:
            with contextlib.suppress(OmegaConfBaseException):
                resolved = OmegaConf.select(config, key)
                *parents, last = key.split(".")
                node = plain
                for part in parents:
                    node = node[part]
                node[last] = OmegaConf.to_container(resolved) if OmegaConf.is_config(resolved) else resolved
    return plain, unresolved


def settings_help(schema: str = "", *, _root_: DictConfig) -> str:
    """Every setting of a command's config as ``key=default``, one a line: what its ``--help`` lists to override.

    The resolver ``${posenc.options:evaluate}``: with a schema's name, each line also says what the key accepts and
    what it is for.
    """
    plain = OmegaConf.to_container(_root_, resolve=False)
    declared = {"evaluate": EvaluateConfig}.get(schema)
    lines = []

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.items():
            if prefix == "" and key in ("hydra", "target"):
                continue
            if isinstance(value, dict) and value:
                walk(value, f"{prefix}{key}.")
                continue
            line = f"  {prefix}{key}={as_override(value)}"
            field = field_at(declared, f"{prefix}{key}") if declared is not None else None
            if field is not None:
                purpose = f": {field.description}" if field.description else ""
                line = f"{line:<44}  {describe(field.annotation, field.metadata)}{purpose}"
            lines.append(line)

    walk(plain, "")
    return "\n".join(lines)
