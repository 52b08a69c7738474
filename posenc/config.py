"""Hydra plumbing shared by the entry points: where ``conf/`` is, resolvers, and config helpers."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from posenc.model import encoding_label

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def _label(encoding: Any) -> str:
    if encoding is None:
        return "no-encoding"
    if isinstance(encoding, DictConfig):
        encoding = OmegaConf.to_container(encoding, resolve=True)
    return encoding_label(encoding)


def _data_tag(task: str | None) -> str:
    return f"-{task}" if task else ""


def _gpus(accelerator: str, devices: Any) -> Any:
    """GPUs a SLURM job asks for on each node: none for a CPU run (a partition without GPUs refuses any request)."""
    return None if accelerator == "cpu" else devices


def register_resolvers() -> None:
    """The resolvers run names are made of.

    ``${posenc.label:${encoding}}``: the readable scheme name used in run names and directories;
    ``${posenc.data_tag:${oc.select:data.task,null}}``: ``-passkey`` for a task run, nothing for text, so that a
    text run and a task run of one scheme never share a directory;
    ``${posenc.gpus:${trainer.accelerator},${trainer.devices}}``: the GPUs per node a SLURM job asks for.
    """
    if not OmegaConf.has_resolver("posenc.label"):
        OmegaConf.register_new_resolver("posenc.label", _label)
    if not OmegaConf.has_resolver("posenc.data_tag"):
        OmegaConf.register_new_resolver("posenc.data_tag", _data_tag)
    if not OmegaConf.has_resolver("posenc.gpus"):
        OmegaConf.register_new_resolver("posenc.gpus", _gpus)


def encoding_choices() -> list[str]:
    """Names accepted by ``+encoding=``: the yaml files of ``conf/encoding``."""
    return sorted(path.stem for path in (CONF_DIR / "encoding").glob("*.yaml"))


def require_encoding(cfg: DictConfig, command: str, run_dir: Path | None = None) -> None:
    """Exit with one line naming the choices when no scheme was given (the group has no default on purpose).

    Hydra has already created the run directory by then; it holds nothing but Hydra's bookkeeping, so it is
    removed (with any parents left empty) to leave nothing half-written behind.
    """
    if OmegaConf.select(cfg, "encoding") is None:
        if run_dir is not None:
            remove_if_only_bookkeeping(run_dir)
        raise SystemExit(
            f"{command} needs a positional scheme: add +encoding=<name>, one of: {', '.join(encoding_choices())}"
        )


def remove_if_only_bookkeeping(run_dir: Path, bookkeeping: tuple[str, ...] = (".hydra", "train.log")) -> None:
    """Remove a run directory (and parents left empty) that holds nothing but Hydra's bookkeeping."""
    if not run_dir.is_dir() or any(p.name not in bookkeeping for p in run_dir.iterdir()):
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    parent = run_dir.parent
    while parent != parent.parent and parent.is_dir() and not any(parent.iterdir()) and parent != Path.cwd():
        parent.rmdir()
        parent = parent.parent


def to_container(cfg: DictConfig) -> dict[str, Any]:
    """Resolved plain-Python copy of a config (what checkpoints and loggers store)."""
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # type: ignore[return-value]


register_resolvers()
