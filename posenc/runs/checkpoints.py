"""Building from a saved run: its data module, its identity record, its checkpoint and the trained module.

Also what ``posenc.evaluate`` needs to find a run's checkpoint and to refuse one that does not match the run.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from posenc.config import to_container
from posenc.jsonio import DiskFullError, free_bytes, size
from posenc.runs.records import CHECKPOINT, PREVIOUS_CHECKPOINT, RUN_FILE, RunError, read_json, training_record

if TYPE_CHECKING:
    from posenc.data.datamodule import TaskDataModule, TextDataModule
    from posenc.training.lit import LitDecoder

# ---------------------------------------------------------------------------------------------------------------
# Building from a saved config


def build_datamodule(config: Mapping[str, Any], num_samples: int) -> TextDataModule | TaskDataModule:
    """The data module a ``data`` config describes: a synthetic ``task`` or a text ``corpus``."""
    from posenc.data.datamodule import TaskDataModule, TextDataModule

    data = config["data"]
    common = {
        "seq_len": data["seq_len"],
        "batch_size": data["batch_size"],
        "num_samples": num_samples,
        "val_windows": data.get("val_windows"),
        "num_workers": data.get("num_workers", 0),
        "seed": config["seed"],
    }
    if "task" in data:
        return TaskDataModule(task=data["task"], task_options=data.get("task_options"), **common)
    return TextDataModule(
        corpus=data["corpus"], corpus_options=data.get("corpus_options"), cache_dir=data["cache_dir"], **common
    )


def run_info(config: Mapping[str, Any], label: str, data_info: dict[str, Any]) -> dict[str, Any]:
    """What identifies a run in results files and the report (the full config: the report's identity)."""
    return {
        "label": label,
        "encoding": config["encoding"],
        "train_len": config["data"]["seq_len"],
        "seed": config["seed"],
        "model": config["model"],
        "data": data_info,
        "run_name": config["run_name"],
        "config": dict(config),
        "length_settings": config.get("length_settings") or {},
    }


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints


def load_checkpoint(path: Path, mmap: bool = False) -> dict[str, Any]:
    """A Lightning checkpoint's contents; a truncated or foreign file fails with one line naming it."""
    import torch

    try:
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=False)
    except Exception as err:  # torch raises RuntimeError, EOFError, UnpicklingError... for a damaged file
        raise RunError(
            f"{path} cannot be read as a checkpoint ({type(err).__name__}): it is truncated or not a checkpoint; "
            "delete it (a run then starts afresh) or point at another checkpoint"
        ) from None


def read_checkpoint(path: Path) -> tuple[int, dict[str, Any]]:
    """(global step, training config) of a Lightning checkpoint, without reading its tensors (mmap)."""
    state = load_checkpoint(path, mmap=True)
    if "global_step" not in state:
        raise RunError(f"{path} is not a Lightning checkpoint (no global_step): point at a posenc checkpoint")
    return int(state["global_step"]), dict(state.get("hyper_parameters", {}).get("config", {}))


def checkpoint_training(path: Path, config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``training`` record of a checkpoint's weights: its step, tokens and whether the run finished.

    Tokens per step come from the checkpoint's ``TokenAccounting`` state (the world size is only known while
    training), else from the run's ``run.json``; an older checkpoint without either records no token count.
    """
    state = load_checkpoint(path, mmap=True)
    step = int(state.get("global_step", 0))
    accounting = (state.get("callbacks") or {}).get("TokenAccounting") or {}
    tokens_per_step = accounting.get("tokens_per_step")
    summary = path.parent.parent / RUN_FILE
    if tokens_per_step is None and summary.is_file():
        tokens_per_step = read_json(summary).get("tokens_per_step")
    return training_record(step, int(config["trainer"]["max_steps"]), tokens_per_step, step)


def load_module(checkpoint: Path, device: str, attention: str | None) -> tuple[LitDecoder, dict[str, Any]]:
    """The trained module and its config from a checkpoint (optionally with another attention backend).

    The blocks are never compiled here: evaluation runs them uncompiled (``posenc/training/compiling.py``). The module's
    ``hparams.precision`` is the precision it trained in; a checkpoint from before it was recorded gets its config's
    setting resolved for the device evaluated on (``auto``: bf16-mixed on a GPU).
    """
    from posenc.runtime import resolve_precision
    from posenc.training.lit import LitDecoder

    state = load_checkpoint(checkpoint)
    try:
        hparams = state["hyper_parameters"]
        config = hparams["config"]
    except (KeyError, TypeError) as err:
        raise RunError(f"{checkpoint} is not a posenc checkpoint (no saved config: missing {err})") from None
    if attention is not None:
        config = {**config, "attention": {"name": attention}}
    precision = hparams.get("precision") or resolve_precision(
        config["trainer"].get("precision", "auto"), "cuda" if str(device).startswith("cuda") else "cpu"
    )
    module = LitDecoder({**config, "compile": False}, vocab_size=hparams["vocab_size"], precision=precision)
    try:
        module.load_state_dict(state["state_dict"])
    except RuntimeError as err:
        first = str(err).splitlines()[0]
        raise RunError(
            f"checkpoint/config mismatch: {checkpoint}'s weights do not fit its saved config: {first}"
        ) from None
    return module.to(device).eval(), config


def resume_checkpoint(resume: str | None, run_dir: Path) -> Path | None:
    """The checkpoint ``resume`` names (``last``: this run's own, see ``last_good_checkpoint``), or ``None``."""
    if resume is None:
        return None
    path = last_good_checkpoint(run_dir) if resume == "last" else Path(resume)
    if path is None or not path.is_file():
        raise RunError(f"resume={resume}: there is no checkpoint at {path or run_dir / CHECKPOINT}")
    return path


def last_good_checkpoint(run_dir: Path, announce: bool = True) -> Path | None:
    """``last.ckpt``, or ``last-previous.ckpt`` when ``last.ckpt`` is missing or unreadable (said in one line).

    A checkpoint posenc writes is whole or absent, but a file can still be damaged afterwards (a copy cut short,
    a disk error, a checkpoint of an older posenc that a full disk truncated); the one before it is kept for that.
    ``None`` when the run has neither: it starts afresh.
    """
    last, previous = run_dir / CHECKPOINT, run_dir / PREVIOUS_CHECKPOINT
    if not previous.is_file():
        return last if last.is_file() else None  # an unreadable one fails with its own line where it is read
    problem = f"{last} is missing"
    if last.is_file():
        try:
            read_checkpoint(last)
            return last
        except RunError as err:
            problem = str(err).split(": it is truncated")[0]
    try:
        step = read_checkpoint(previous)[0]
    except RunError:
        raise RunError(f"{problem}, and so is {previous}, the one before it: delete both to start afresh") from None
    if announce:
        print(f"{problem}: resuming from the checkpoint before it, {previous} (step {step})")
    return previous


def disk_full_message(full: OSError, run_dir: Path, resume_command: str) -> str:
    """The one line for a run stopped by a full disk: the file, the space, the checkpoint kept, how to go on."""
    if isinstance(full, DiskFullError):
        what = str(full)
    else:  # written by a library (a logger), which does not say how much it needed
        what = f"the disk is full: could not write {full.filename or run_dir} ({size(free_bytes(run_dir))} free)"
    try:
        checkpoint = last_good_checkpoint(run_dir, announce=False)
        step = read_checkpoint(checkpoint)[0] if checkpoint is not None else None
    except RunError:
        step = None
    if step is None:
        return f"{what}; no checkpoint was kept. Free space, then run the same command again"
    return f"{what}; kept {checkpoint} (step {step}). Free space, then resume with: {resume_command}"


EVALUATE_USAGE = (
    "usage: python -m posenc.evaluate <run dir or checkpoint.ckpt> [eval.multiples=[1,2,4] eval.mode=sliding ...]"
)


def resolve_checkpoint(target: str) -> tuple[Path, Path]:
    """(checkpoint file, run directory) for a run directory or a checkpoint path."""
    path = Path(target).expanduser()
    if path.is_dir():
        checkpoint = path / "checkpoints" / "last.ckpt"
        if not checkpoint.exists():
            raise RunError(f"no checkpoint at {checkpoint}: is {path} a posenc run directory that finished a step?")
        return checkpoint, path
    if path.is_file() and path.suffix != ".ckpt":  # results.json, a plot: a file of a run, not its weights
        run = next((folder for folder in path.parents if (folder / CHECKPOINT).is_file()), None)
        where = f"evaluate its run: python -m posenc.evaluate {run}" if run is not None else EVALUATE_USAGE
        raise RunError(f"{target} is not a checkpoint (a .ckpt file): {where}")
    if path.is_file():
        run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
        return path, run_dir
    raise RunError(f"{target} is neither a run directory nor a checkpoint file; {EVALUATE_USAGE}")


def check_consistency(trained: dict[str, Any], run_dir: Path, cfg: DictConfig) -> None:
    """Refuse to evaluate a checkpoint under a config it was not trained with."""
    saved = run_dir / ".hydra" / "config.yaml"
    if saved.exists():
        run_config = _saved_config(saved)
        for key in ("encoding", "model"):
            if key in run_config and not _agrees(run_config[key], trained[key]):
                raise SystemExit(
                    f"checkpoint/config mismatch in {key!r}: {run_dir}/.hydra/config.yaml says {run_config[key]} but "
                    f"the checkpoint was trained with {trained[key]}. The checkpoint was probably copied from another "
                    "run: point posenc.evaluate at that run's directory."
                )
    for key in ("encoding", "model"):
        asked = OmegaConf.select(cfg, key)
        if asked is not None and not _agrees(to_container(asked), trained[key]):
            raise SystemExit(
                f"checkpoint/config mismatch in {key!r}: the checkpoint was trained with {trained[key]} but the "
                f"command asks for {to_container(asked)}. Evaluation always uses the trained model: drop the override."
            )


def _agrees(config: Any, trained: Any) -> bool:
    """Whether a config section says what the checkpoint was trained with.

    A setting the config leaves unset (null: a length setting the run resolved from its training length, or
    inherited from its parent) agrees with whatever value the run resolved and recorded.
    """
    if isinstance(config, dict) and isinstance(trained, dict):
        unset = {key for key, value in config.items() if value is None}
        config = {key: value for key, value in config.items() if key not in unset}
        trained = {key: value for key, value in trained.items() if key not in unset}
    return _plain(config) == _plain(trained)


def _saved_config(path: Path) -> dict[str, Any]:
    """A run's config.yaml, resolved where it can be (``learned.max_positions: ${data.seq_len}`` → 64)."""
    loaded = OmegaConf.load(path)
    try:
        return OmegaConf.to_container(loaded, resolve=True)  # type: ignore[return-value]
    except Exception:  # an interpolation that needs Hydra's runtime: compare what is literal
        return OmegaConf.to_container(loaded, resolve=False)  # type: ignore[return-value]


def _plain(value: Any) -> Any:
    """Compare configs without interpolations (e.g. learned.max_positions: ${data.seq_len} vs 64)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if not (isinstance(v, str) and v.startswith("${"))}
    return value
