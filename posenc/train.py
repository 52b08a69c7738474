"""``python -m posenc.train +encoding=<scheme>``: train the shared decoder with one positional scheme.

Hydra composes the config (``conf/train.yaml``), Lightning trains, and the run ends with the extrapolation
evaluation (perplexity at 1×…32× the training length, printed and written to ``<run>/eval``). Everything a
run writes lands in its directory under ``outputs/``: the resolved config, checkpoints, logs, ``run.json``.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint, ThroughputMonitor
from omegaconf import DictConfig

from posenc.config import CONF_DIR, require_encoding, to_container
from posenc.data.datamodule import TaskDataModule, TextDataModule
from posenc.evaluate.runner import ExtrapolationEval
from posenc.lit import LitDecoder
from posenc.loggers import build_loggers


def resolve_precision(requested: str, accelerator: str) -> str:
    """``auto`` → bf16-mixed where a CUDA GPU supports bf16, fp32 everywhere else (CPU bf16 is slow)."""
    if requested != "auto":
        return requested
    on_gpu = accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()
    return "bf16-mixed" if on_gpu and torch.cuda.is_bf16_supported() else "32-true"


def build_datamodule(config: dict[str, Any], num_samples: int) -> TextDataModule | TaskDataModule:
    """The data module a ``data`` config describes: a synthetic ``task`` or a text ``corpus``."""
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


def run_info(config: dict[str, Any], label: str, data_info: dict[str, Any]) -> dict[str, Any]:
    """What identifies a run in results files and the report."""
    return {
        "label": label,
        "encoding": config["encoding"],
        "train_len": config["data"]["seq_len"],
        "seed": config["seed"],
        "model": config["model"],
        "data": data_info,
        "run_name": config["run_name"],
    }


def train(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Train one run into ``run_dir``; return its summary (also written to ``run_dir/run.json``)."""
    config = to_container(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    L.seed_everything(config["seed"], workers=True, verbose=False)
    trainer_cfg = dict(config["trainer"])
    trainer_cfg["precision"] = resolve_precision(trainer_cfg["precision"], trainer_cfg["accelerator"])
    if isinstance(trainer_cfg.get("val_check_interval"), int):  # one epoch is the whole run: validate within it
        trainer_cfg["val_check_interval"] = min(trainer_cfg["val_check_interval"], trainer_cfg["max_steps"])
    devices = trainer_cfg["devices"] if isinstance(trainer_cfg["devices"], int) and trainer_cfg["devices"] > 0 else 1
    samples = trainer_cfg["max_steps"] * config["data"]["batch_size"] * trainer_cfg["accumulate_grad_batches"]
    datamodule = build_datamodule(config, samples * devices * trainer_cfg["num_nodes"])
    data_info = datamodule.describe()
    module = LitDecoder(config, vocab_size=datamodule.vocab_size)
    label = module.model.label
    info = run_info(config, label, data_info)
    seq_len = config["data"]["seq_len"]
    tags = [label, f"L{seq_len}", f"seed{config['seed']}", *module.model.scheme_names]
    loggers = build_loggers(config["logger"], run_dir, config["run_name"], {**config, "data_info": data_info}, tags)
    callbacks: list[Callback] = [ModelCheckpoint(dirpath=run_dir / "checkpoints", save_last=True, save_top_k=0)]
    if loggers:  # both only log, and refuse to run without a logger
        callbacks += [
            LearningRateMonitor(logging_interval="step"),
            ThroughputMonitor(
                batch_size_fn=lambda batch: batch[0].shape[0], length_fn=lambda batch: batch[0].numel(), separator="/"
            ),
        ]
    evaluation = None
    if config["eval"]["at_end"]:
        task = config["data"].get("task")
        evaluation = ExtrapolationEval(
            info, config["eval"], run_dir / "eval", lambda: datamodule.stream(config["eval"]["split"]), task
        )
        callbacks.append(evaluation)
    trainer = L.Trainer(**trainer_cfg, logger=loggers or False, callbacks=callbacks, default_root_dir=str(run_dir))
    resume = config.get("resume")
    if resume == "last":
        resume = str(run_dir / "checkpoints" / "last.ckpt")
    started = time.perf_counter()
    trainer.fit(module, datamodule=datamodule, ckpt_path=resume)
    summary: dict[str, Any] = {
        **info,
        "steps": trainer.global_step,
        "train_seconds": time.perf_counter() - started,
        "checkpoint": str(run_dir / "checkpoints" / "last.ckpt"),
        "val_loss": float(trainer.callback_metrics.get("val/loss", float("nan"))),
        "eval": evaluation.results["summary"] if evaluation is not None and evaluation.results else None,
    }
    if trainer.is_global_zero:
        (run_dir / "run.json").write_text(json.dumps(summary, indent=2, default=_json_default))
    for logger in loggers:
        logger.finalize("success")
    return summary


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return str(value)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    require_encoding(cfg, "posenc.train", run_dir)
    train(cfg, run_dir)


if __name__ == "__main__":
    main()
