"""Fine-tuning from a run (``init_from``): what carries over from a parent run's weights, what is refused, the record.

A fine-tuned run is a fresh run: its optimizer, learning-rate schedule and step count start anew, and only the
backbone's weights come from the parent's checkpoint. They carry over by name and shape. A tensor of the parent
that the new model holds under the same name with the same shape is copied; a tensor of the new model that the
parent lacks (the new scheme's own parameters, e.g. data-dependent ALiBi's gates after ALiBi) keeps its fresh
initialisation; a tensor of the parent that the new model lacks (the scheme it replaces) is dropped.

Changing the scheme, the training length or the context scaling is what fine-tuning is for: position interpolation
and YaRN fine-tune RoPE at a longer length with the scaling applied (``model.context_scaling``), DroPE drops RoPE
and recalibrates the model without positions at its original length (``+encoding=nope``). The width, the head
count and the depth are not: the parent's weights would not fit the new model. Neither can a tensor that both hold
with two shapes, such as a learned absolute table asked to cover more positions than it has rows. Both are refused
in one line before anything is built or written.

``lineage`` (run.json, results.json, the W&B config and tags) names the parent, what changed and the three lists
of tensor names, and ``notes`` on a change accepted that may not do what it says (a context scaling of a RoPE the
parent never had); ``posenc.report`` places the run beside its parent. ``provenance`` says the same in words, for the
run's first console line, its perplexity table and the report's column headers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from posenc.data.tokenizer import ByteTokenizer
from posenc.runs.records import CHECKPOINT, RunError

if TYPE_CHECKING:
    from torch import Tensor, nn

    from posenc.model import Decoder

# The backbone's shape: weights carry over only between models that agree on all of it.
ARCHITECTURE = ("dim", "heads", "depth", "mlp_ratio", "tie_embeddings")
PREFIX = "model."  # the LightningModule's name for the Decoder in a checkpoint's state_dict


@dataclass(frozen=True)
class Parent:
    """A parent run's checkpoint as fine-tuning reads it: the backbone's tensors and the config it trained with."""

    checkpoint: Path
    run_dir: Path
    step: int
    config: dict[str, Any]
    vocab_size: int
    state: dict[str, Tensor]  # the Decoder's tensors by name (without the LightningModule's prefix)


def read_parent(target: str) -> Parent:
    """The checkpoint ``init_from`` names (a run directory's last one, or a ``.ckpt`` file); one line if it cannot."""
    import torch

    path = Path(target).expanduser().resolve()  # recorded absolute: the report finds the parent from anywhere
    if path.is_dir():
        checkpoint, run_dir = path / CHECKPOINT, path
        if not checkpoint.is_file():
            raise RunError(
                f"init_from={target}: no checkpoint at {checkpoint}: point it at a run directory that saved one "
                "(a run writes checkpoints/last.ckpt as it trains) or at a .ckpt file"
            )
    elif path.is_file():
        checkpoint = path
        run_dir = path.parent.parent if path.parent.name == CHECKPOINT.parent.name else path.parent
    else:
        raise RunError(
            f"init_from={target} is neither a run directory nor a checkpoint file: point it at a run directory "
            "(outputs/runs/<run name>/<time>) or at its checkpoints/last.ckpt"
        )
    try:
        saved = torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=False)
    except Exception as err:  # torch raises RuntimeError, EOFError, UnpicklingError... for a damaged file
        raise RunError(
            f"init_from={target}: {checkpoint} cannot be read as a checkpoint ({type(err).__name__}): it is truncated "
            "or not a checkpoint; point init_from at another run"
        ) from None
    try:
        config, vocab_size = dict(saved["hyper_parameters"]["config"]), int(saved["hyper_parameters"]["vocab_size"])
        weights, step = saved["state_dict"], int(saved["global_step"])
    except (KeyError, TypeError) as err:
        raise RunError(
            f"init_from={target}: {checkpoint} is not a posenc checkpoint (it has no {err}): point init_from at a run "
            "that posenc.train wrote"
        ) from None
    state = {name.removeprefix(PREFIX): tensor for name, tensor in weights.items() if name.startswith(PREFIX)}
    return Parent(checkpoint, run_dir, step, config, vocab_size, state)


def _meta_decoder(config: Mapping[str, Any], vocab_size: int) -> Decoder:
    """The model a config describes, built on the meta device (no memory, no time) to read its names and shapes."""
    import torch

    from posenc.model import Decoder

    kwargs = {"encoding": config["encoding"], "vocab_size": vocab_size, "attention": config["attention"]["name"]}
    try:
        with torch.device("meta"):
            return Decoder(**kwargs, **config["model"])
    except (NotImplementedError, RuntimeError):  # a scheme that reads tensor values while it builds
        return Decoder(**kwargs, **config["model"])


def _table_owner(model: nn.Module, name: str) -> Any:
    """The module of ``model`` holding tensor ``name`` that has a positions limit (a learned table), else ``None``."""
    parts = name.split(".")[:-1]
    for end in range(len(parts), 0, -1):
        module = model.get_submodule(".".join(parts[:end]))
        if getattr(module, "max_positions", None) is not None:
            return module
    return None


def _scaling(config: Mapping[str, Any]) -> Any:
    return config["model"].get("context_scaling")


def _eval_scaling(config: Mapping[str, Any]) -> str | None:
    evaluation = config.get("eval") or {}
    method, factor = evaluation.get("rope_scaling"), evaluation.get("rope_scaling_factor")
    return None if method is None else f"{method}×{float(factor or 0):g}"


def _changes(parent: Mapping[str, Any], config: Mapping[str, Any], labels: tuple[str, str]) -> dict[str, Any]:
    """{what: {from, to}} for the scheme, the training length and the context scalings that differ."""
    changed: dict[str, Any] = {}
    if parent["encoding"] != config["encoding"]:
        same_name = labels[0] == labels[1]  # the same scheme with other options: say which
        changed["scheme"] = {
            "from": parent["encoding"] if same_name else labels[0],
            "to": config["encoding"] if same_name else labels[1],
        }
    for what, read in (
        ("seq_len", lambda c: c["data"]["seq_len"]),
        ("context_scaling", _scaling),
        ("eval_scaling", _eval_scaling),
    ):
        before, after = read(parent), read(config)
        if before != after:
            changed[what] = {"from": before, "to": after}
    return changed


def _stretches(config: Mapping[str, Any], vocab_size: int, scaling: Mapping[str, Any]) -> bool:
    """Whether the model ``config`` describes has a scheme that ``scaling`` can stretch (the model says, not a name)."""
    try:
        _meta_decoder({**config, "model": {**config["model"], "context_scaling": dict(scaling)}}, vocab_size)
    except ValueError:
        return False
    return True


def _notes(config: Mapping[str, Any], parent: Parent, parent_label: str) -> list[str]:
    """Changes accepted that may not do what they say, one line each."""
    scaling = _scaling(config)
    if scaling and not _scaling(parent.config) and not _stretches(parent.config, parent.vocab_size, scaling):
        return [
            f"model.context_scaling={_scaling_words(scaling)} stretches RoPE, but the parent "
            f"({parent.config.get('run_name') or parent.run_dir.name}, {parent_label}) had no RoPE to scale: the "
            "rotary frequencies start untrained here, so this is RoPE trained afresh with a scaling, not an extension"
        ]
    return []


def _scaling_words(scaling: Mapping[str, Any]) -> str:
    return f"{scaling['method']}×{float(scaling['factor']):g} from {scaling.get('original_length')}"


def provenance(config: Mapping[str, Any], lineage: Mapping[str, Any] | None, short: bool = False) -> list[str]:
    """What a run is beyond its scheme: its training context scaling and the run it was fine-tuned from.

    ``["yarn×4 from 64 in training", "fine-tuned from rope-L64-s0 at step 600"]``; ``short``, for a report's
    column header: ``["yarn×4 in training", "from rope"]``. Empty for a run trained from scratch without a scaling.
    """
    parts = []
    scaling = (config.get("model") or {}).get("context_scaling")
    if scaling:
        shown = f"{scaling['method']}×{float(scaling['factor']):g}" if short else _scaling_words(scaling)
        parts.append(f"{shown} in training")
    if lineage:
        name = lineage.get("parent_run_name") or Path(str(lineage.get("parent_run_dir", "?"))).name
        if short:
            parts.append(f"from {lineage.get('parent_scheme') or name}")
        else:
            parts.append(f"fine-tuned from {name} at step {lineage.get('parent_step')}")
    elif config.get("init_from"):
        parts.append(
            f"from {Path(str(config['init_from'])).name}" if short else f"fine-tuned from {config['init_from']}"
        )
    return parts


def plan(config: Mapping[str, Any], parent: Parent) -> dict[str, Any]:
    """The ``lineage`` record of fine-tuning ``config`` from ``parent``; refuses what cannot carry over in one line."""
    theirs, ours = parent.config["model"], config["model"]
    differing = [key for key in ARCHITECTURE if theirs.get(key) != ours.get(key)]
    if differing:
        raise RunError(
            f"init_from={config['init_from']}: the parent has "
            + ", ".join(f"model.{key}={theirs.get(key)}" for key in differing)
            + " but this run asks for "
            + ", ".join(f"model.{key}={ours.get(key)}" for key in differing)
            + ": its weights fit only a model of the same width, heads and depth; keep the parent's"
        )
    model, parent_model = (
        _meta_decoder(config, ByteTokenizer.vocab_size),
        _meta_decoder(parent.config, parent.vocab_size),
    )
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    parent_shapes = {name: tuple(tensor.shape) for name, tensor in parent.state.items()}
    for name in sorted(shapes.keys() & parent_shapes.keys()):
        if shapes[name] == parent_shapes[name]:
            continue
        table, parent_table = _table_owner(model, name), _table_owner(parent_model, name)
        if table is not None and parent_table is not None:
            limit = parent_table.max_positions
            raise RunError(
                f"init_from={config['init_from']}: the parent's {parent_table.label} table holds {limit} positions "
                f"and this run's {table.max_positions} (data.seq_len={config['data']['seq_len']}): a learned absolute "
                f"table carries over only at its own size; fine-tune at data.seq_len≤{limit} with "
                f"encoding.max_positions={limit}, or change the scheme (+encoding=rope drops the table)"
            )
        raise RunError(
            f"init_from={config['init_from']}: {name} is {list(parent_shapes[name])} in the parent but "
            f"{list(shapes[name])} here, so it cannot carry over; keep the parent's settings for it"
        )
    return {
        "parent_run_dir": str(parent.run_dir),
        "parent_checkpoint": str(parent.checkpoint),
        "parent_step": parent.step,
        "parent_run_name": parent.config.get("run_name"),
        "parent_scheme": parent_model.label,
        "parent_seq_len": parent.config["data"]["seq_len"],
        "changed": _changes(parent.config, config, (parent_model.label, model.label)),
        "copied": sorted(shapes.keys() & parent_shapes.keys()),
        "fresh": sorted(shapes.keys() - parent_shapes.keys()),
        "dropped": sorted(parent_shapes.keys() - shapes.keys()),
        "notes": _notes(config, parent, parent_model.label),
    }


def inherit(config: Mapping[str, Any], parent: Parent | None = None) -> tuple[Parent, dict[str, Any]] | None:
    """The parent and the lineage of a run with ``init_from``, checked before any work; ``None`` without one.

    ``parent``: the checkpoint ``init_from`` names, when the caller has read it already.
    """
    target = config.get("init_from")
    if target is None:
        return None
    parent = parent or read_parent(str(target))
    return parent, plan(config, parent)


def load_parent_weights(model: nn.Module, parent: Parent, lineage: Mapping[str, Any]) -> None:
    """Copy the tensors ``lineage`` lists as copied from the parent into ``model``; the rest stay as built."""
    model.load_state_dict({name: parent.state[name] for name in lineage["copied"]}, strict=False)


def lineage_tags(lineage: Mapping[str, Any]) -> list[str]:
    """W&B tags of a fine-tuned run: that it is one, its parent's scheme and run, and each thing changed."""
    return [
        "finetuned",
        f"parent:{lineage['parent_run_name'] or Path(lineage['parent_run_dir']).name}",
        f"from:{lineage['parent_scheme']}",
        *(f"changed:{what}" for what in lineage["changed"]),
    ]
