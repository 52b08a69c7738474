"""Checks before any work: a config that cannot train or evaluate is refused in one line, before anything is built.

``RUNTIME_KEYS`` says which settings only change how a run executes or logs, not what it trains and evaluates;
everything else is the experiment (``experiment_settings``), which a relaunch must keep.
"""

from __future__ import annotations

import importlib.util
import netrc
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from posenc.data.tokenizer import ByteTokenizer
from posenc.runs.records import RunError, read_json
from posenc.schema import TrainConfig, refusal

if TYPE_CHECKING:
    from posenc.data.datamodule import TaskDataModule, TextDataModule

# torch and the model are imported where they are needed: the checks here must stay quick to import, so that a
# bad input is refused before the heavy libraries load.

# Config keys that say how a run executes or where it logs, not what it trains and evaluates: a relaunch may
# change them (a key names itself and everything under it).
RUNTIME_KEYS = (
    "resume",
    # what the encoding's length settings resolved to and by which rule: the settings themselves are in ``encoding``
    "length_settings",
    # where a tuned run's learning rates came from: the rates themselves are in ``optim``
    "tuning",
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

# ---------------------------------------------------------------------------------------------------------------
# What a run is


# Settings added after runs were made, each with what a config that lacks it did: a relaunched sweep and the report's
# pooling read a missing key as that value. An older run scored the head of the split, trained its scheme at the
# model's lr, (MQAR) put its key-value block at the window's start, started from no other run, trained RoPE
# unscaled, evaluated without a length scaling of the scores, and gave attention no sink of its own.
INTRODUCED = {
    "eval.sample": "head",
    "optim.scheme_lr_multiplier": 1.0,
    "data.task_options.kv_offset": "zoology",
    "init_from": None,
    "model.context_scaling": None,
    "eval.attention_scale": None,
    "eval.max_containment": None,
    "optim.tuned": None,
    "model.sink": "none",
    "model.sink_tokens": 1,
}


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


def resolve_length_settings(config: Mapping[str, Any], inherited: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``config`` with its encoding's unset length settings resolved and recorded (``config["length_settings"]``).

    ``inherited``: the encoding config of the run this one starts from (``init_from``), whose resolved settings an
    unset one keeps. See ``posenc/encodings/length.py``.
    """
    from posenc.encodings.length import scale_to_length

    if not isinstance(config.get("encoding"), Mapping) or "name" not in config["encoding"]:
        return dict(config)
    seq_len = (config.get("data") or {}).get("seq_len")
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        return dict(config)  # nothing to scale to: the config's own check refuses the length in its words
    try:
        encoding, record = scale_to_length(config["encoding"], seq_len, inherited)
    except ValueError as err:
        raise RunError(f"invalid encoding settings: {err}") from None
    return {**config, "encoding": encoding, "length_settings": record}


def apply_tuning(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with its scheme's tuned learning rates, when ``optim.tuned`` names a tuning's ``selection.json``.

    The file (``posenc/report/tuning.py``) holds one setting per scheme label, selected on the validation split; the
    run takes its own scheme's ``lr`` and ``scheme_lr_multiplier`` and records where they came from (``tuning``). A
    scheme the file has no setting for is refused in one line: it was not tuned with the others.
    """
    path = (config.get("optim") or {}).get("tuned")
    if path is None:
        return dict(config)
    from posenc.layout import encoding_label

    try:
        selection = read_json(Path(str(path)).expanduser())
    except SystemExit as err:
        raise RunError(f"optim.tuned={path}: {err}") from None
    label = encoding_label(config["encoding"])
    chosen = (selection.get("schemes") or {}).get(label)
    if chosen is None:
        raise RunError(
            f"optim.tuned={path} has no setting for {label} (it holds {', '.join(selection.get('schemes') or {})}): "
            "tune it with the others (sweeps/tune.yaml), or drop optim.tuned"
        )
    optim = {**config["optim"], "lr": chosen["lr"], "scheme_lr_multiplier": chosen["scheme_lr_multiplier"]}
    record = {"from": str(path), "rule": selection.get("rule"), "split": selection.get("split"), **chosen}
    record.pop("grid", None)
    return {**config, "optim": optim, "tuning": record}


def check_model(config: Mapping[str, Any]) -> None:
    """Build the model on the meta device (no memory, no time) so that a scheme refuses its options up front."""
    import torch

    from posenc.attention import scheme_refusal
    from posenc.model import Decoder

    config = resolve_length_settings(config)  # as the run builds it (a no-op for a config posenc.train resolved)
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
    for encoding in model.layer_encodings:  # a backend that cannot honour a layer's scheme, before any work
        if (refusal := scheme_refusal(config["attention"]["name"], encoding)) is not None:
            raise RunError(f"invalid attention setting: {refusal}")
    limits = [m.max_positions for m in model.modules() if getattr(m, "max_positions", None) is not None]
    if limits and min(limits) < seq_len:
        raise RunError(
            f"{model.label} represents at most {min(limits)} positions but data.seq_len={seq_len}: raise its "
            f"max_positions (encoding.max_positions={seq_len}) or lower data.seq_len"
        )


def check_device(config: Mapping[str, Any], cuda: bool | None = None) -> None:
    """The devices a run asks for exist: a GPU where it asks for one, as many as it asks for, flex on CUDA only.

    ``cuda``: whether the run will have CUDA GPUs; ``None``: whether this machine has them (and how many). A sweep
    submitted to SLURM checks on a login node for jobs that run elsewhere, with the GPUs they ask for.
    """
    import torch

    attention, trainer = config["attention"]["name"], config["trainer"]
    accelerator, devices = trainer["accelerator"], trainer.get("devices", "auto")
    here = cuda is None
    count = torch.cuda.device_count() if here and torch.cuda.is_available() else 0
    cuda = count > 0 if cuda is None else cuda
    mps = bool(torch.backends.mps.is_available())
    if accelerator in ("gpu", "cuda") and not cuda and not (accelerator == "gpu" and mps):
        raise RunError(
            f"trainer.accelerator={accelerator} asks for a GPU and this machine has none that torch can use "
            "(torch.cuda.is_available() is false): use trainer.accelerator=auto (a GPU when there is one) or cpu"
        )
    if accelerator == "mps" and not mps:
        raise RunError("trainer.accelerator=mps asks for Apple's GPU (MPS), which this machine lacks: use auto or cpu")
    if accelerator == "tpu" and importlib.util.find_spec("torch_xla") is None:
        raise RunError("trainer.accelerator=tpu needs torch_xla, which is not installed: use auto or cpu")
    on_gpu = accelerator in ("auto", "gpu", "cuda") and cuda
    asked = len(devices) if isinstance(devices, list) else devices if isinstance(devices, int) else 0
    if here and on_gpu and asked > count:
        raise RunError(
            f"trainer.devices={devices} asks for {asked} GPUs and this machine has {count}: "
            f"use trainer.devices={count} (or -1: all of them)"
        )
    if attention == "flex" and not on_gpu:
        raise RunError(
            "attention=flex trains only on a CUDA GPU (FlexAttention has no CPU backward): use attention=auto "
            "(it picks sdpa on CPU) or attention=sdpa"
        )


def wandb_key_configured() -> bool:
    """Whether W&B has an API key to log in with, read as W&B reads it (its variables, then ``~/.netrc``), offline."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    try:
        host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def check_wandb(
    logger: Mapping[str, Any],
    setting: str = "logger.mode=online",
    instead: str = "log offline with logger.mode=offline (upload later with `wandb sync`)",
) -> None:
    """W&B asked to log online has a key now: without one it would prompt at a terminal, or fail a minute in.

    ``setting``: what asked for it, as the refusal names it (``WANDB_MODE`` in the environment wins over it);
    ``instead``: what else the command can do.
    """
    if logger.get("kind", "wandb") != "wandb":
        return
    mode = os.environ.get("WANDB_MODE") or logger.get("mode", "auto")
    if mode == "online" and not wandb_key_configured():
        asked = "WANDB_MODE=online" if os.environ.get("WANDB_MODE") else setting
        raise RunError(
            f"{asked} needs a W&B API key and none is configured (WANDB_API_KEY, or ~/.netrc from `wandb login`): "
            f"log in first, or {instead}"
        )


def validate(config: Mapping[str, Any], cuda: bool | None = None) -> None:
    """Refuse a config that cannot train or evaluate, before anything is built or written.

    Its values against the schema first (``posenc.schema``), then what only building tells (the scheme's own options,
    the backend), then the machine: the devices asked for, W&B's key. ``cuda``: whether the run will have CUDA GPUs
    (``check_device``).
    """
    line = refusal(config, TrainConfig)
    if line is not None:
        raise RunError(line)
    check_model(config)
    check_device(config, cuda)
    check_wandb(config["logger"])


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


def resolve(config: Mapping[str, Any], inherited: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The settings a run trains with: its length settings resolved (``inherited`` as above), then its tuned rates.

    One function, so that training, a fine-tune's refusal and a sweep's relaunch check resolve a config alike: a
    relaunch compares what the earlier launch trained with against what this one would.
    """
    return apply_tuning(resolve_length_settings(config, inherited))
