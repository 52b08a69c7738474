"""The run directory, in one place: config checks before any work, checkpoints, run.json, done/failed markers.

Every entry point (train, evaluate, sweep, report) reads and writes runs through this module, so what makes a
run "finished", "failed" or "resumable" is decided once. A run directory holds:

- ``.hydra/config.yaml``: the composed config; ``checkpoints/last.ckpt``: the latest checkpoint;
- ``run.json``: the summary (steps, tokens, eval figures), refreshed when the run is re-evaluated;
- ``done.json``: written last, the mark of a complete run (a relaunched sweep skips it);
- ``failed.json``: why a run stopped (a non-finite loss); a relaunch retries it and the report lists it apart;
- ``wandb_id``: the W&B run id, so a resumed run continues its own W&B run.

``RunError`` carries every message meant for a user: one line saying what is wrong and what to do.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from posenc.config import to_container
from posenc.data.tokenizer import ByteTokenizer
from posenc.jsonio import dumps

if TYPE_CHECKING:
    from posenc.data.datamodule import TaskDataModule, TextDataModule
    from posenc.lit import LitDecoder

# torch, the model and Lightning are imported where they are needed: the checks and records here must stay quick
# to import, so that a bad input is refused before the heavy libraries load.

DONE_FILE = "done.json"
FAILED_FILE = "failed.json"
RUN_FILE = "run.json"
WANDB_ID_FILE = "wandb_id"
CHECKPOINT = Path("checkpoints") / "last.ckpt"

# Config keys that say how a run executes or where it logs, not what it trains and evaluates: a relaunch may
# change them (a key names itself and everything under it).
RUNTIME_KEYS = (
    "resume",
    "output_root",
    "sweep_name",
    "run_name",
    "logger",
    "compile",
    "checkpoint_every_n_steps",
    "trainer.enable_progress_bar",
    "trainer.enable_model_summary",
    "trainer.log_every_n_steps",
    "data.num_workers",
    "data.cache_dir",
    "eval.plots",
)


class RunError(SystemExit):
    """A run that cannot go on as asked: the message says why and what to do (exit status 1, no traceback)."""


# ---------------------------------------------------------------------------------------------------------------
# What a run is


def experiment_settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config as dotted keys, without ``RUNTIME_KEYS``: what must match for a job to skip or resume."""
    flat: dict[str, Any] = {}

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            if any(dotted == k or dotted.startswith(f"{k}.") for k in RUNTIME_KEYS):
                continue
            if isinstance(value, Mapping) and value:
                walk(value, f"{dotted}.")
            else:
                flat[dotted] = value

    walk(config, "")
    return flat


# ---------------------------------------------------------------------------------------------------------------
# Checks before any work


def _whole(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and float(value).is_integer()


def config_problems(config: Mapping[str, Any]) -> list[str]:
    """Everything wrong with the values a run will use, found without building anything (one line each)."""
    problems = []
    data, model, trainer, optim, evaluation = (config[k] for k in ("data", "model", "trainer", "optim", "eval"))
    for key, value in (
        ("data.seq_len", data["seq_len"]),
        ("data.batch_size", data["batch_size"]),
        ("trainer.max_steps", trainer["max_steps"]),
        ("model.dim", model["dim"]),
        ("model.heads", model["heads"]),
        ("model.depth", model["depth"]),
    ):
        if not _whole(value) or value < 1:
            problems.append(f"{key}={value!r} must be a whole number ≥ 1")
    lr = optim["lr"]
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not math.isfinite(lr) or lr <= 0:
        problems.append(f"optim.lr={lr!r} must be a positive number (e.g. optim.lr=1e-3)")
    problems += eval_problems(evaluation)
    if not problems and model["dim"] % model["heads"]:
        near = max(model["heads"], round(model["dim"] / model["heads"]) * model["heads"])
        problems.append(
            f"model.dim={model['dim']} is not divisible by model.heads={model['heads']}: "
            f"choose a multiple, e.g. model.dim={near}"
        )
    return problems


def eval_problems(evaluation: Mapping[str, Any]) -> list[str]:
    """What is wrong with an ``eval`` config (lengths, mode, stride), one line each."""
    problems: list[str] = []
    for key, multiples in (
        ("eval.multiples", evaluation["multiples"]),
        ("eval.passkey.multiples", (evaluation.get("passkey") or {}).get("multiples", [])),
        ("eval.copy.multiples", (evaluation.get("copy") or {}).get("multiples", [])),
    ):
        if not multiples or any(not _whole(m) or m < 1 for m in multiples):
            problems.append(
                f"{key}={multiples} must list whole multiples of the training length ≥ 1, e.g. {key}=[1,2,4]"
            )
    if evaluation["mode"] not in ("nonoverlap", "sliding"):
        problems.append(f"eval.mode={evaluation['mode']!r} must be nonoverlap or sliding")
    elif evaluation["mode"] == "sliding" and (not _whole(evaluation.get("stride")) or evaluation["stride"] < 1):
        problems.append(f"eval.mode=sliding needs eval.stride ≥ 1, got {evaluation.get('stride')!r}")
    return problems


def check_model(config: Mapping[str, Any]) -> None:
    """Build the model on the meta device (no memory, no time) so that a scheme refuses its options up front."""
    import torch

    from posenc.model import Decoder

    model_cfg, seq_len = config["model"], config["data"]["seq_len"]
    kwargs = {"encoding": config["encoding"], "vocab_size": ByteTokenizer.vocab_size, **model_cfg}
    try:
        try:
            with torch.device("meta"):
                model = Decoder(attention=config["attention"]["name"], **kwargs)
        except (NotImplementedError, RuntimeError):  # a scheme that reads tensor values while it builds
            model = Decoder(attention=config["attention"]["name"], **kwargs)
    except (ValueError, TypeError) as err:
        raise RunError(f"invalid encoding/model settings: {err}") from None
    limits = [m.max_positions for m in model.modules() if getattr(m, "max_positions", None) is not None]
    if limits and min(limits) < seq_len:
        raise RunError(
            f"{model.label} represents at most {min(limits)} positions but data.seq_len={seq_len}: raise its "
            f"max_positions (encoding.max_positions={seq_len}) or lower data.seq_len"
        )


def check_device(config: Mapping[str, Any]) -> None:
    """FlexAttention has no CPU backward: training with ``attention=flex`` needs a CUDA GPU."""
    import torch

    attention, accelerator = config["attention"]["name"], config["trainer"]["accelerator"]
    on_gpu = accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()
    if attention == "flex" and not on_gpu:
        raise RunError(
            "attention=flex trains only on a CUDA GPU (FlexAttention has no CPU backward): use attention=auto "
            "(it picks sdpa on CPU) or attention=sdpa"
        )


def validate(config: Mapping[str, Any]) -> None:
    """Refuse a config that cannot train or evaluate, before anything is built or written."""
    problems = config_problems(config)
    if problems:
        raise RunError("; ".join(problems))
    check_model(config)
    check_device(config)


def check_data(datamodule: TextDataModule | TaskDataModule) -> dict[str, Any]:
    """Load (or build) the corpus and check every split holds a window; returns the datamodule's description."""
    try:
        info = datamodule.describe()
    except (FileNotFoundError, ValueError, RuntimeError, ImportError) as err:
        raise RunError(str(err)) from None
    for split, tokens in (info.get("tokens") or {}).items():
        if tokens < datamodule.seq_len + 2:
            raise RunError(
                f"the {info['corpus']} corpus's {split} split has {tokens} tokens, fewer than one window of "
                f"data.seq_len={datamodule.seq_len} + 1: give it more text or lower data.seq_len"
            )
    return info


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
        return TaskDataModule(task=data["task"], **common)
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


def load_module(checkpoint: Path, device: str, attention: str | None) -> tuple[LitDecoder, dict[str, Any]]:
    """The trained module and its config from a checkpoint (optionally with another attention backend).

    The blocks are never compiled here: evaluation runs them uncompiled (``posenc/compiling.py``).
    """
    from posenc.lit import LitDecoder

    state = load_checkpoint(checkpoint)
    try:
        hparams = state["hyper_parameters"]
        config = hparams["config"]
    except (KeyError, TypeError) as err:
        raise RunError(f"{checkpoint} is not a posenc checkpoint (no saved config: missing {err})") from None
    if attention is not None:
        config = {**config, "attention": {"name": attention}}
    module = LitDecoder({**config, "compile": False}, vocab_size=hparams["vocab_size"])
    try:
        module.load_state_dict(state["state_dict"])
    except RuntimeError as err:
        first = str(err).splitlines()[0]
        raise RunError(
            f"checkpoint/config mismatch: {checkpoint}'s weights do not fit its saved config: {first}"
        ) from None
    return module.to(device).eval(), config


def resume_checkpoint(resume: str | None, run_dir: Path) -> Path | None:
    """The checkpoint ``resume`` names (``last``: this run's own), or ``None`` to start fresh."""
    if resume is None:
        return None
    path = run_dir / CHECKPOINT if resume == "last" else Path(resume)
    if not path.is_file():
        raise RunError(f"resume={resume}: there is no checkpoint at {path}")
    return path


# ---------------------------------------------------------------------------------------------------------------
# Markers and records


def write_json(path: Path, data: Any) -> None:
    """Write, then rename: a killed process never leaves a half-written record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(dumps(data))
    partial.replace(path)


def read_json(path: Path) -> Any:
    """A JSON record; a damaged one fails with one line naming the file."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RunError(f"{path} is not readable JSON ({err}): delete or restore it") from None


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def write_done(run_dir: Path, config: Mapping[str, Any], steps: int) -> None:
    """Mark a run complete; call it last. A failure record from an earlier attempt is removed first."""
    (run_dir / FAILED_FILE).unlink(missing_ok=True)
    record = {"run_name": config.get("run_name"), "finished_at": now(), "steps": steps, "config": config}
    write_json(run_dir / DONE_FILE, record)


def write_failed(run_dir: Path, config: Mapping[str, Any], reason: str, step: int) -> None:
    """Record why a run stopped; the report lists it apart, a relaunched sweep retries it."""
    record = {"run_name": config.get("run_name"), "failed_at": now(), "step": step, "reason": reason, "config": config}
    write_json(run_dir / FAILED_FILE, record)


def update_run_summary(run_dir: Path, eval_summary: dict[str, Any]) -> None:
    """Replace the ``eval`` figures of ``run.json`` (after a re-evaluation); no-op for a run without one."""
    path = run_dir / RUN_FILE
    if path.is_file():
        summary = read_json(path)
        summary["eval"] = eval_summary
        write_json(path, summary)


def wandb_id(run_dir: Path) -> str:
    """The W&B run id of this run directory, created once: a resumed single run continues its own W&B run."""
    path = run_dir / WANDB_ID_FILE
    if path.is_file():
        return path.read_text().strip()
    run_id = secrets.token_hex(8)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id)
    return run_id


def global_rank() -> int:
    """The rank of this process from the launcher's variables (0 outside distributed runs), before Lightning."""
    for key in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if key in os.environ:
            return int(os.environ[key])
    return 0


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
            if key in run_config and _plain(run_config[key]) != _plain(trained[key]):
                raise SystemExit(
                    f"checkpoint/config mismatch in {key!r}: {run_dir}/.hydra/config.yaml says {run_config[key]} but "
                    f"the checkpoint was trained with {trained[key]}. The checkpoint was probably copied from another "
                    "run: point posenc.evaluate at that run's directory."
                )
    for key in ("encoding", "model"):
        asked = OmegaConf.select(cfg, key)
        if asked is not None and _plain(to_container(asked)) != _plain(trained[key]):
            raise SystemExit(
                f"checkpoint/config mismatch in {key!r}: the checkpoint was trained with {trained[key]} but the "
                f"command asks for {to_container(asked)}. Evaluation always uses the trained model: drop the override."
            )


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
