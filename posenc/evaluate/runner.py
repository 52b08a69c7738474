"""Evaluate one trained model for extrapolation and write every figure: JSON, CSV, PNG, and W&B.

Used both at the end of training (``ExtrapolationEval`` callback) and by ``python -m posenc.evaluate``. The
output folder (``<run>/eval/`` by default) holds ``results.json`` (everything, the file ``posenc.report``
reads), ``perplexity.csv``, ``loss_by_position.csv``, task CSVs and plots.
"""

from __future__ import annotations

import csv
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
from lightning.pytorch.callbacks import Callback
from torch import nn

from posenc.compiling import eager_blocks
from posenc.data.retrieval import RETRIEVAL_TASKS
from posenc.encodings.base import PositionalEncoding
from posenc.evaluate import ACCURACY_LIMITS, LOSS_MIN_SPAN, PPL_MIN_SPAN, RESULTS_FILE
from posenc.evaluate.attention_stats import attention_plots, attention_stats_by_length, attention_summary, stats_windows
from posenc.evaluate.effective import DEFAULT_ACC_FRACTION, DEFAULT_PPL_RATIO, effective_lengths
from posenc.evaluate.perplexity import LengthResult, evaluate_lengths
from posenc.evaluate.plots import plot_heatmap, plot_lines, smooth
from posenc.evaluate.retrieval import evaluate_retrieval_tasks
from posenc.evaluate.tasks import CHANCE_PER_BYTE, evaluate_copy, evaluate_passkey
from posenc.evaluate.wandb_tables import log_results
from posenc.jsonio import dumps
from posenc.runs import CHECKPOINT, global_batch, read_checkpoint, training_record

TASK_NAMES = ("passkey", "copy", *RETRIEVAL_TASKS)


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


def evaluate_model(
    model: nn.Module,
    *,
    run_info: dict[str, Any],
    eval_cfg: dict[str, Any],
    stream: np.ndarray | None,
    task: str | None,
) -> dict[str, Any]:
    """All extrapolation figures of ``model`` as one JSON-ready dict.

    ``run_info`` carries label, train_len, seed, encoding; ``stream`` is the held-out token stream for
    language-modelling runs (``None`` for task runs); ``task`` is the synthetic task a model was trained on.
    Compiled blocks run uncompiled here (``posenc/compiling.py``): a static graph per evaluation shape would cost
    one compilation per length for a single pass; the attention kernels stay compiled.
    """
    with eager_blocks(model):
        return _evaluate(model, run_info, eval_cfg, stream, task)


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
        available = [length for length in lengths if length < len(stream)]
        rows = evaluate_lengths(
            model,
            stream,
            available,
            mode=eval_cfg["mode"],
            stride=eval_cfg.get("stride"),
            max_tokens=eval_cfg.get("max_tokens"),
            tokens_per_batch=batch_tokens,
        )
        base = next((r for r in rows if r.length == train_len and not r.error), None)
        results["perplexity"] = [
            r.as_dict() | {"multiple": r.length / train_len, "ratio": _ratio(r, base), "loss_by_position": None}
            for r in rows
        ]
        results["loss_by_position"] = {str(r.length): r.loss_by_position for r in rows if not r.error}
    seed = int(eval_cfg.get("seed", 1234))
    for name in ("passkey", "copy"):
        options = eval_cfg.get(name) or {}
        enabled = options.get("enabled", "auto")
        if enabled is True or (enabled == "auto" and task == name):
            task_lengths = supported([int(m * train_len) for m in options["multiples"]], model)
            if name == "passkey":
                results["passkey"] = evaluate_passkey(
                    model, task_lengths, options["depths"], options["samples"], seed, batch_tokens
                )
            else:
                results["copy"] = evaluate_copy(model, task_lengths, options["samples"], seed, batch_tokens)
    task_options = ((run_info.get("config") or {}).get("data") or {}).get("task_options")
    results |= evaluate_retrieval_tasks(
        model,
        eval_cfg,
        task,
        lambda multiples: supported([int(m * train_len) for m in multiples], model),
        batch_tokens,
        task_options,
    )
    if eval_cfg.get("attention_stats"):
        windows_for = stats_windows(stream, task, int(eval_cfg.get("attention_stats_tokens", 4096)), seed, task_options)
        stats_lengths = [n for n in supported(lengths, model) if stream is None or n < len(stream)]
        results["attention_stats"] = attention_stats_by_length(
            model, stats_lengths, windows_for, train_len, batch_tokens
        )
    results["effective_length"] = effective_lengths(results)
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
    for metric, length in (results.get("effective_length") or {}).items():
        if length is not None:  # a summary holds numbers; no in-length figure means no value
            out[f"effective_length/{metric}"] = length
    return out


def _multiple_tag(multiple: float) -> str:
    return f"{int(multiple)}x" if float(multiple).is_integer() else f"{multiple:g}x"


def replace_outputs(results: dict[str, Any], out_dir: Path, plots: bool = True) -> list[Path]:
    """``write_outputs`` into a fresh folder that then replaces ``out_dir`` whole.

    No file of an earlier evaluation (a plot, a CSV of a length no longer asked for) survives next to the new ones.
    """
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        images = write_outputs(results, staging, plots=plots)
        previous = out_dir.with_name(f".{out_dir.name}.previous")
        shutil.rmtree(previous, ignore_errors=True)
        if out_dir.exists():
            out_dir.rename(previous)
        staging.rename(out_dir)
        shutil.rmtree(previous, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [out_dir / image.name for image in images]


def write_outputs(results: dict[str, Any], out_dir: Path, plots: bool = True) -> list[Path]:
    """results.json, CSVs and PNGs under ``out_dir``; returns the PNGs written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / RESULTS_FILE).write_text(dumps(results, indent=1))
    label, train_len = results["label"], results["train_len"]
    images: list[Path] = []
    if "perplexity" in results:
        _write_csv(out_dir / "perplexity.csv", results["perplexity"], exclude={"loss_by_position"})
        by_length = sorted(results["loss_by_position"].items(), key=lambda item: int(item[0]))
        rows = [{"length": int(n), "position": i, "loss": v} for n, curve in by_length for i, v in enumerate(curve)]
        _write_csv(out_dir / "loss_by_position.csv", rows)
        if plots:
            ok = [r for r in results["perplexity"] if r["error"] is None]
            images.append(
                plot_lines(
                    {label: ([r["length"] for r in ok], [r["ppl"] for r in ok], None)},
                    out_dir / "ppl_vs_length.png",
                    f"{label}: perplexity vs evaluation length",
                    "evaluation length (tokens)",
                    "perplexity",
                    train_len=train_len,
                    logy=True,
                    min_span=PPL_MIN_SPAN,
                )
            )
            if by_length:
                images.append(
                    plot_lines(
                        {f"windows of {n}": (*smooth(curve), None) for n, curve in by_length},
                        out_dir / "loss_by_position.png",
                        f"{label}: loss by position, per evaluation length",
                        "position in window",
                        "loss (nats)",
                        train_len=train_len,
                        min_span=LOSS_MIN_SPAN,
                    )
                )
    if "passkey" in results:
        _write_csv(out_dir / "passkey.csv", results["passkey"])
        if plots:
            depths = sorted({r["depth"] for r in results["passkey"]})
            lengths = sorted({r["length"] for r in results["passkey"]})
            grid = np.zeros((len(depths), len(lengths)))
            for r in results["passkey"]:
                grid[depths.index(r["depth"]), lengths.index(r["length"])] = r["accuracy"]
            images.append(
                plot_heatmap(
                    grid, depths, lengths, out_dir / "passkey.png", f"{label}: passkey accuracy", "length", "depth"
                )
            )
    for name in ("copy", *RETRIEVAL_TASKS):
        if name not in results:
            continue
        _write_csv(out_dir / f"{name}.csv", results[name])
        if plots:
            rows = results[name]
            lengths = [r["length"] for r in rows]
            images.append(
                plot_lines(
                    {
                        f"{label}, exact match": (lengths, [r["accuracy"] for r in rows], None),
                        f"{label}, per byte": (lengths, [r.get("token_accuracy") for r in rows], None),
                    },
                    out_dir / f"{name}.png",
                    f"{label}: {name} accuracy"
                    + ("" if results.get("trained_task") == name else " (not trained on it)"),
                    "length",
                    "accuracy",
                    train_len=train_len,
                    ylim=ACCURACY_LIMITS,
                    references={"per-byte chance": CHANCE_PER_BYTE[name]},
                )
            )
    if "attention_stats" in results:
        _write_csv(out_dir / "attention_stats.csv", results["attention_stats"])
        if plots:
            images += attention_plots(results["attention_stats"], label, train_len, out_dir)
    return images


def _write_csv(path: Path, rows: list[dict[str, Any]], exclude: set[str] = frozenset()) -> None:
    if not rows:
        return
    fields = [key for key in rows[0] if key not in exclude]
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def print_results(results: dict[str, Any]) -> None:
    """The human summary: perplexity by length (with the ratio to in-length), task accuracies."""
    label, train_len = results["label"], results["train_len"]
    if "perplexity" in results:
        rows = results["perplexity"]
        mode = rows[0]["mode"] + (f", stride {rows[0]['stride']}" if rows[0]["stride"] else "")
        scored = rows[0]["tokens"]
        print(f"\nPerplexity of {label} trained at L={train_len} ({mode}; {scored} tokens scored at each length):")
        data = (results.get("config") or {}).get("data") or {}
        if data.get("val_windows"):  # two perplexities at 1×: say why they differ
            print(
                f"  (1× here scores the first {scored} tokens of the {results['eval'].get('split', 'validation')} "
                f"split; training's val/ppl scored its first {data['val_windows'] * train_len}, so the two "
                "differ by sample, not by method)"
            )
        print(f"  {'length':>7} {'×L':>5} {'loss':>8} {'ppl':>9} {'bits/byte':>9} {'vs 1×':>7}")
        for r in rows:
            if r["error"]:
                print(f"  {r['length']:>7} {r['multiple']:>5g} {'n/a':>8} {'n/a':>9} {'':>9} {'':>7}  ({r['error']})")
            else:
                ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else ""
                figures = f"{r['loss']:>8.4f} {r['ppl']:>9.3f} {r['bpb']:>9.4f} {ratio:>7}"
                print(f"  {r['length']:>7} {r['multiple']:>5g} {figures}")
    for name in TASK_NAMES:
        if name in results:
            exact = {k.split("@")[1]: v for k, v in results["summary"].items() if k.startswith(f"{name}_acc@")}
            byte = {k.split("@")[1]: v for k, v in results["summary"].items() if k.startswith(f"{name}_byte_acc@")}
            shown = ", ".join(f"{m} {v:.2f} ({byte.get(m, float('nan')):.2f} per byte)" for m, v in exact.items())
            print(f"{name} accuracy by length: {shown}; per-byte chance {CHANCE_PER_BYTE[name]:.2f}")
            if results.get("trained_task") != name:
                print(f"  ({label} was not trained on {name}'s format: these figures measure the format, not recall)")
            rows = [r for r in results[name] if "first_byte_accuracy" in r]
            if rows:
                chance = f"chance {rows[0]['chance_first_byte']:.3g}, exact {rows[0]['chance_exact']:.3g}"
                firsts = ", ".join(f"{r['length'] / train_len:g}x {r['first_byte_accuracy']:.2f}" for r in rows)
                print(f"{name} first answer byte by length ({chance}): {firsts}")
    effective = results.get("effective_length")
    if effective:
        settings = results.get("eval") or {}
        rule = (
            f"ppl ≤ {settings.get('effective_ppl_ratio', DEFAULT_PPL_RATIO):g}× in-length, "
            f"accuracy ≥ {settings.get('effective_acc_fraction', DEFAULT_ACC_FRACTION):g}× in-length, at every length"
        )
        print(
            f"effective length ({rule}): "
            + ", ".join(f"{metric} {'n/a' if n is None else n}" for metric, n in effective.items())
        )
    for stat in ("sink", "distance"):
        values = {k: v for k, v in results["summary"].items() if k.startswith(f"attn_{stat}@")}
        if values:
            print(
                f"attention {stat} (mean over layers and heads) by length: "
                + ", ".join(f"{k.split('@')[1]} {v:.3g}" for k, v in values.items())
            )


class ExtrapolationEval(Callback):
    """Evaluate at the end of training (rank zero) and write ``<run>/eval``. Off with ``eval.at_end=false``."""

    def __init__(
        self,
        run_info: dict[str, Any],
        eval_cfg: dict[str, Any],
        out_dir: Path,
        stream_fn: Callable[[], np.ndarray] | None,
        task: str | None,
    ) -> None:
        self.run_info, self.eval_cfg, self.out_dir, self.stream_fn, self.task = (
            run_info,
            eval_cfg,
            out_dir,
            stream_fn,
            task,
        )
        self.results: dict[str, Any] | None = None

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        # Lightning's teardown has moved the module back to CPU by now: evaluate on the training device.
        pl_module.model.to(trainer.strategy.root_device)
        stream = self.stream_fn() if self.stream_fn is not None else None
        step, train_len = trainer.global_step, int(self.run_info["train_len"])
        tokens_per_step = global_batch(trainer.datamodule.batch_size, trainer, train_len)["tokens_per_step"]
        checkpoint = self.out_dir.parent / CHECKPOINT  # saved by now: Lightning's checkpointing ends with training
        saved_step = read_checkpoint(checkpoint)[0] if checkpoint.is_file() else None
        training = training_record(step, int(trainer.max_steps), tokens_per_step, saved_step)
        self.results = evaluate_model(
            pl_module.model,
            run_info={**self.run_info, "training": training},
            eval_cfg=self.eval_cfg,
            stream=stream,
            task=self.task,
        )
        images = replace_outputs(self.results, self.out_dir, plots=self.eval_cfg.get("plots", True))
        print_results(self.results)
        log_results(self.results, trainer.loggers, images, trainer.global_step)
