"""Evaluate one trained model for extrapolation and write every figure: JSON, CSV, PNG, and W&B.

Used both at the end of training (``ExtrapolationEval`` callback) and by ``python -m posenc.evaluate``. The
output folder (``<run>/eval/`` by default) holds ``results.json`` (everything, the file ``posenc.report``
reads), ``perplexity.csv``, ``loss_by_position.csv``, task CSVs and plots.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
from lightning.pytorch.callbacks import Callback
from torch import nn

from posenc.encodings.base import PositionalEncoding
from posenc.encodings.ssmax import LengthScaling, TemperatureTuning
from posenc.encodings.stack import Stack
from posenc.evaluate.attention_stats import attention_stats_by_length, attention_summary, stats_windows
from posenc.evaluate.bias_curve import first_layer_bias
from posenc.evaluate.drift import PositionalDrift
from posenc.evaluate.effective import RULES, both_rules
from posenc.evaluate.heldout import heldout_perplexity
from posenc.evaluate.outputs import TASK_NAMES, print_results, replace_outputs, write_outputs
from posenc.evaluate.perplexity import LengthResult
from posenc.evaluate.retrieval import evaluate_retrieval_tasks
from posenc.evaluate.tasks import evaluate_copy, evaluate_passkey
from posenc.evaluate.wandb_tables import log_results
from posenc.runs import CHECKPOINT, global_batch, read_checkpoint, training_record
from posenc.runtime import eager_modules as eager_blocks  # compiled blocks run uncompiled in evaluation
from posenc.runtime import precision_context

__all__ = ["TASK_NAMES", "ExtrapolationEval", "evaluate_model", "print_results", "replace_outputs", "write_outputs"]


def supported(lengths: list[int], model: nn.Module) -> list[int]:
    limit = getattr(model, "max_positions", None)
    return [length for length in lengths if limit is None or length <= limit]


def scaling_tag(eval_cfg: dict[str, Any]) -> str | None:
    """``yarn×8`` for an evaluation with RoPE context scaling, ``None`` without; fails clearly on half a setting."""
    method, factor = eval_cfg.get("rope_scaling"), eval_cfg.get("rope_scaling_factor")
    if method is None:
        return None
    if factor is None:
        raise ValueError(f"eval.rope_scaling={method} needs eval.rope_scaling_factor (e.g. 8: eight times L)")
    return f"{method}×{float(factor):g}"


def apply_context_scaling(model: nn.Module, eval_cfg: dict[str, Any], run_info: dict[str, Any]) -> dict[str, Any]:
    """Stretch every scheme of ``model`` that can be (RoPE) as ``eval.rope_scaling`` asks; the run info it reports.

    The scaled model is a different model at evaluation, so its label names the scaling (``rope · yarn×8``) and
    the report shows it as its own column; ``rope_scaling`` records the method and factor.
    """
    tag = scaling_tag(eval_cfg)
    if tag is None:
        return run_info
    method, factor = eval_cfg["rope_scaling"], float(eval_cfg["rope_scaling_factor"])
    trained = getattr(model, "context_scaling", None)
    if trained is not None:  # setting a scaling replaces the one before: the model would lose what it trained with
        raise ValueError(
            f"eval.rope_scaling={method} would replace the {trained['method']}×{trained['factor']:g} scaling "
            f"{run_info['label']} trained with (model.context_scaling): drop eval.rope_scaling"
        )
    scaled = [
        module.set_context_scaling(method, factor, int(run_info["train_len"]))
        for module in model.modules()
        if isinstance(module, PositionalEncoding)
    ]
    if not any(scaled):
        raise ValueError(
            f"eval.rope_scaling={method} needs a rotary scheme that can be stretched; {run_info['label']} has none"
        )
    return {**run_info, "label": f"{run_info['label']} · {tag}", "rope_scaling": {"method": method, "factor": factor}}


@contextmanager
def attention_scaling(model: nn.Module, eval_cfg: dict[str, Any], run_info: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """While open, the global layers' queries scaled with length as ``eval.attention_scale`` asks.

    ``log_n`` stacks ``LengthScaling`` (max(1, log n / log L_train), ``posenc/encodings/ssmax.py``, which says why this
    form) on each global layer's scheme, for any scheme: a stack is a scheme, so backends, cached decoding and attention
    statistics see it like any other. A local layer's rows hold at most its window of keys, never more than it trained
    with, where the factor is 1. ``llama4`` stacks Llama 4's temperature (``TemperatureTuning``) on the global layers
    of a layout with local ones, floored at their window. The layers get their own schemes back on exit, so the
    model's parameters and checkpoints never change. Yields the run info the evaluation reports: the label names the
    scaling (``alibi · log_n``) and ``attention_scale`` records it, as ``rope_scaling`` is recorded.
    """
    scale = eval_cfg.get("attention_scale")
    if scale is None:
        yield run_info
        return
    attentions = [block.attn for block in model.blocks]
    if any(attention.encoding.scales_with_length for attention in attentions):
        raise ValueError(
            f"eval.attention_scale={scale} would scale {run_info['label']}'s scores by log n twice: it was trained "
            "with a length scaling of its own (ssmax); leave eval.attention_scale null"
        )
    train_len, originals = int(run_info["train_len"]), [attention.encoding for attention in attentions]
    windows = [attention.window for attention in attentions if attention.window is not None]
    if scale == "llama4" and not windows:
        raise ValueError(
            f"eval.attention_scale=llama4 floors its temperature at the local layers' window, and {run_info['label']} "
            "has no local layer: use it with a layout (irope), or eval.attention_scale=log_n"
        )
    try:
        for attention, encoding in zip(attentions, originals, strict=True):
            if attention.window is not None:
                continue
            if scale == "llama4":
                scaling = TemperatureTuning(encoding.num_heads, encoding.head_dim, max(windows))
            else:
                scaling = LengthScaling(encoding.num_heads, encoding.head_dim, train_len)
            attention.encoding = Stack([encoding, scaling])
        yield {**run_info, "label": f"{run_info['label']} · {scale}", "attention_scale": scale}
    finally:
        for attention, encoding in zip(attentions, originals, strict=True):
            attention.encoding = encoding


def evaluate_model(
    model: nn.Module,
    *,
    run_info: dict[str, Any],
    eval_cfg: dict[str, Any],
    stream: np.ndarray | None,
    task: str | None,
    precision: str = "32-true",
    leakage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """All extrapolation figures of ``model`` as one JSON-ready dict.

    ``run_info`` carries label, train_len, seed, encoding; ``stream`` is the held-out token stream for
    language-modelling runs (``None`` for task runs), ``leakage`` the record of the documents left out of it as
    near-copies of training text; ``task`` is the synthetic task a model was trained on.
    ``precision`` is the one it trained in (Lightning's setting, recorded in the results): the forward runs under
    it, so the in-length figure is training's and every backend runs as it did there.
    Compiled blocks run uncompiled here (``posenc/training/compiling.py``): a static graph per evaluation shape
    would cost one compilation per length for a single pass; the attention kernels stay compiled.
    """
    device = next(model.parameters()).device
    with (
        eager_blocks(model),
        precision_context(precision, device),
        attention_scaling(model, eval_cfg, run_info) as scaled_info,
    ):
        results = _evaluate(model, scaled_info, eval_cfg, stream, task)
    if leakage is not None and "documents" in results:
        results["documents"]["leakage"] = leakage
    return {**results, "precision": precision}


def _evaluate(
    model: nn.Module,
    run_info: dict[str, Any],
    eval_cfg: dict[str, Any],
    stream: np.ndarray | None,
    task: str | None,
) -> dict[str, Any]:
    run_info = apply_context_scaling(model, eval_cfg, run_info)
    train_len = int(run_info["train_len"])
    lengths = [int(m * train_len) for m in eval_cfg["multiples"]]
    results: dict[str, Any] = {**run_info, "eval": {k: v for k, v in eval_cfg.items() if k != "plots"}}
    results["trained_task"] = task  # a task scored on a model trained on something else measures its format
    batch_tokens = eval_cfg.get("tokens_per_batch", 16384)
    if stream is not None:
        rows, results["documents"] = heldout_perplexity(model, stream, lengths, eval_cfg, batch_tokens)
        base = next((r for r in rows if r.length == train_len and not r.error), None)
        results["perplexity"] = [
            r.as_dict() | {"multiple": r.length / train_len, "ratio": _ratio(r, base), "loss_by_position": None}
            for r in rows
        ]
        results["loss_by_position"] = {str(r.length): r.loss_by_position for r in rows if not r.error}
    seed = int(eval_cfg.get("seed", 1234))
    beyond: set[int] = set()  # task lengths past what the model represents (its perplexity rows say so themselves)

    def within(multiples: Sequence[float]) -> list[int]:
        asked = [int(m * train_len) for m in multiples]
        kept = supported(asked, model)
        beyond.update(set(asked) - set(kept))
        return kept

    for name in ("passkey", "copy"):
        options = eval_cfg.get(name) or {}
        enabled = options.get("enabled", "auto")
        if enabled is True or (enabled == "auto" and task == name):
            task_lengths = within(options["multiples"])
            if name == "passkey":
                results["passkey"] = evaluate_passkey(
                    model, task_lengths, options["depths"], options["samples"], seed, batch_tokens
                )
            else:
                results["copy"] = evaluate_copy(model, task_lengths, options["samples"], seed, batch_tokens)
    task_options = ((run_info.get("config") or {}).get("data") or {}).get("task_options")
    results |= evaluate_retrieval_tasks(model, eval_cfg, task, within, batch_tokens, task_options)
    if beyond:
        reason = f"{run_info['label']} represents at most {model.max_positions} positions (max_positions)"
        results["not_evaluated"] = {"lengths": sorted(beyond), "reason": reason}
    if eval_cfg.get("attention_stats"):
        windows_for = stats_windows(stream, task, int(eval_cfg.get("attention_stats_tokens", 4096)), seed, task_options)
        stats_lengths = [n for n in supported(lengths, model) if stream is None or n < len(stream)]
        results["attention_stats"] = attention_stats_by_length(
            model, stats_lengths, windows_for, train_len, batch_tokens
        )
    scored = [row["length"] for row in results.get("perplexity", []) if row["error"] is None]
    results["learned_bias"] = first_layer_bias(model, max(scored or lengths))
    settings = [encoding.learned_settings() for encoding in model.layer_encodings]
    if any(settings):  # per layer: what a scheme's length-scaled settings trained to (FIRE's threshold)
        results["learned_settings"] = settings
    results["effective_length"] = both_rules(results)
    results["summary"] = summary_metrics(results)
    return results


def _ratio(row: LengthResult, base: LengthResult | None) -> float | None:
    if row.error or base is None:
        return None
    return row.ppl / base.ppl


def summary_metrics(results: dict[str, Any]) -> dict[str, float]:
    """Flat ``ppl@4x``-style numbers: what W&B summaries, dashboards and the report compare."""
    out: dict[str, float] = {}
    for row in results.get("perplexity", []):
        if row["error"] is None:
            tag = _multiple_tag(row["multiple"])
            out[f"ppl@{tag}"] = row["ppl"]
            out[f"bpb@{tag}"] = row["bpb"]
            if row["ratio"] is not None:
                out[f"ppl_ratio@{tag}"] = row["ratio"]
    train_len = results["train_len"]
    for name in TASK_NAMES:
        for field, key in (("accuracy", "acc"), ("token_accuracy", "byte_acc")):
            by_length: dict[int, list[float]] = {}
            for row in results.get(name, []):
                if field in row:
                    by_length.setdefault(row["length"], []).append(row[field])
            for length, accs in by_length.items():
                out[f"{name}_{key}@{_multiple_tag(length / train_len)}"] = float(np.mean(accs))
        for row in results.get(name, []):
            if "first_byte_accuracy" in row:  # retrieval tasks: one row per length
                out[f"{name}_first_byte@{_multiple_tag(row['length'] / train_len)}"] = row["first_byte_accuracy"]
    for (stat, length), value in attention_summary(results.get("attention_stats") or []).items():
        out[f"attn_{stat}@{_multiple_tag(length / train_len)}"] = value
    drift = results.get("positional_drift")
    if drift is not None:
        out["drift/max_total_change"] = drift["max_total_change"]
        if drift["max_late_change"] is not None:
            out["drift/max_late_change"] = drift["max_late_change"]
    recorded = results.get("effective_length") or {}
    for rule in RULES:
        for metric, length in (recorded.get(rule) or {}).items():
            if length is not None:  # a summary holds numbers; no in-length figure means no value
                out[f"effective_length_{rule}/{metric}"] = length
    return out


def _multiple_tag(multiple: float) -> str:
    return f"{int(multiple)}x" if float(multiple).is_integer() else f"{multiple:g}x"


class ExtrapolationEval(Callback):
    """Evaluate at the end of training (rank zero) and write ``<run>/eval``. Off with ``eval.at_end=false``."""

    def __init__(
        self,
        run_info: dict[str, Any],
        eval_cfg: dict[str, Any],
        out_dir: Path,
        stream_fn: Callable[[], tuple[np.ndarray, dict[str, Any] | None]] | None,
        task: str | None,
        drift: PositionalDrift | None = None,
    ) -> None:
        self.run_info, self.eval_cfg, self.out_dir, self.stream_fn, self.task = (
            run_info,
            eval_cfg,
            out_dir,
            stream_fn,
            task,
        )
        self.drift = drift  # the run's positional-parameter snapshots: results.json records how far they moved
        self.results: dict[str, Any] | None = None

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        # Lightning's teardown has moved the module back to CPU by now: evaluate on the training device.
        pl_module.model.to(trainer.strategy.root_device)
        stream, leakage = self.stream_fn() if self.stream_fn is not None else (None, None)
        step, train_len = trainer.global_step, int(self.run_info["train_len"])
        tokens_per_step = global_batch(trainer.datamodule.batch_size, trainer, train_len)["tokens_per_step"]
        checkpoint = self.out_dir.parent / CHECKPOINT  # saved by now: Lightning's checkpointing ends with training
        saved_step = read_checkpoint(checkpoint)[0] if checkpoint.is_file() else None
        training = training_record(step, int(trainer.max_steps), tokens_per_step, saved_step)
        self.results = evaluate_model(
            pl_module.model,
            run_info={
                **self.run_info,
                "training": training,
                "positional_drift": self.drift.record(pl_module.model) if self.drift is not None else None,
            },
            eval_cfg=self.eval_cfg,
            stream=stream,
            task=self.task,
            precision=str(trainer.precision),
            leakage=leakage,
        )
        images = replace_outputs(self.results, self.out_dir, plots=self.eval_cfg.get("plots", True))
        print_results(self.results)
        # Under its protocol (eval/nonoverlap, eval/sliding_f0.5, ...): two protocols of one run never share a key.
        log_results(self.results, trainer.loggers, images, trainer.global_step, folder=self.out_dir.name)
