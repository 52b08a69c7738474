"""Checks before any work: a config that cannot train or evaluate is refused in one line, before anything is built.

``RUNTIME_KEYS`` says which settings only change how a run executes or logs, not what it trains and evaluates;
everything else is the experiment (``experiment_settings``), which a relaunch must keep.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posenc.data.tokenizer import ByteTokenizer
from posenc.runs.records import RunError, read_json

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

# Evaluation-time attention scalings (``eval.attention_scale``): log_n = max(1, log n / log L_train) on every query
# (``posenc/encodings/ssmax.py``, ``LengthScaling``).
ATTENTION_SCALES = ("log_n",)


# ---------------------------------------------------------------------------------------------------------------
# What a run is


# Settings added after runs were made, each with what a config that lacks it did: a relaunched sweep and the report's
# pooling read a missing key as that value. An older run scored the head of the split, trained its scheme at the
# model's lr, (MQAR) put its key-value block at the window's start, started from no other run, trained RoPE
# unscaled, and evaluated without a length scaling of the scores.
INTRODUCED = {
    "eval.sample": "head",
    "optim.scheme_lr_multiplier": 1.0,
    "data.task_options.kv_offset": "zoology",
    "init_from": None,
    "model.context_scaling": None,
    "eval.attention_scale": None,
    "eval.max_containment": None,
    "optim.tuned": None,
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
    multiplier = optim.get("scheme_lr_multiplier", 1.0)
    if isinstance(multiplier, bool) or not isinstance(multiplier, int | float) or not multiplier > 0:
        problems.append(f"optim.scheme_lr_multiplier={multiplier!r} must be a positive number (1.0: the model's lr)")
    problems += eval_problems(evaluation)
    if model.get("context_scaling") and evaluation.get("rope_scaling") is not None:
        problems.append(
            "model.context_scaling and eval.rope_scaling both stretch RoPE, and the evaluation's would replace the "
            "one the model trains with: drop eval.rope_scaling"
        )
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
    stride, fraction = evaluation.get("stride"), evaluation.get("stride_fraction")
    if evaluation["mode"] not in ("nonoverlap", "sliding"):
        problems.append(f"eval.mode={evaluation['mode']!r} must be nonoverlap or sliding")
    elif evaluation["mode"] == "sliding" and (stride is None) == (fraction is None):
        problems.append(
            "eval.mode=sliding needs one stride: eval.stride (tokens, e.g. 32) or eval.stride_fraction (of each "
            f"evaluation length, e.g. 0.5), got stride={stride!r}, stride_fraction={fraction!r}"
        )
    elif evaluation["mode"] == "sliding" and stride is not None and (not _whole(stride) or stride < 1):
        problems.append(f"eval.mode=sliding needs eval.stride ≥ 1, got {stride!r}")
    for key, values in (("eval.stride_fraction", [] if fraction is None else [fraction]),
                        ("eval.sliding_fractions", evaluation.get("sliding_fractions") or [])):  # fmt: skip
        if any(not _fraction(value) for value in values):
            problems.append(f"{key}={values} must be fractions of the evaluation length in (0, 1], e.g. 0.5")
    if evaluation.get("sample", "documents") not in ("documents", "head", "long_documents"):
        problems.append(f"eval.sample={evaluation['sample']!r} must be documents, head or long_documents")
    if evaluation.get("attention_scale") not in (None, *ATTENTION_SCALES):
        scales = ", ".join(ATTENTION_SCALES)
        problems.append(f"eval.attention_scale={evaluation['attention_scale']!r} must be null or one of {scales}")
    return problems


def _fraction(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and 0 < value <= 1


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
    from posenc.model import encoding_label

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
    """FlexAttention has no CPU backward: training with ``attention=flex`` needs a CUDA GPU.

    ``cuda``: whether the run will have one; ``None``: whether this machine has one. A sweep submitted to SLURM
    checks on a login node for jobs that run elsewhere, with the GPUs they ask for.
    """
    attention, accelerator = config["attention"]["name"], config["trainer"]["accelerator"]
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    on_gpu = accelerator in ("auto", "gpu", "cuda") and cuda
    if attention == "flex" and not on_gpu:
        raise RunError(
            "attention=flex trains only on a CUDA GPU (FlexAttention has no CPU backward): use attention=auto "
            "(it picks sdpa on CPU) or attention=sdpa"
        )


def validate(config: Mapping[str, Any], cuda: bool | None = None) -> None:
    """Refuse a config that cannot train or evaluate, before anything is built or written.

    ``cuda``: whether the run will have a CUDA GPU (``check_device``).
    """
    problems = config_problems(config)
    if problems:
        raise RunError("; ".join(problems))
    check_model(config)
    check_device(config, cuda)


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
