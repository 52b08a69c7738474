"""``python -m posenc.evaluate <run dir or checkpoint> [eval.mode=sliding eval.stride=32 ...]``.

Rebuilds the model exactly as it was trained (scheme, sizes and data from the checkpoint's saved config),
refuses a checkpoint that does not match the run's config, and writes the full extrapolation evaluation:
perplexity by length, loss by position, synthetic-task accuracy, as JSON, CSV and PNG (see ``runner.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig

from posenc.config import CONF_DIR, to_container
from posenc.runs import (
    EVALUATE_USAGE,
    RunError,
    build_datamodule,
    check_consistency,
    check_data,
    eval_problems,
    load_module,
    resolve_checkpoint,
    run_info,
    update_run_summary,
)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="evaluate")
def _main(cfg: DictConfig) -> None:
    checkpoint, run_dir = resolve_checkpoint(cfg.target)
    eval_cfg = to_container(cfg.eval)
    problems = eval_problems(eval_cfg)
    if problems:
        raise RunError("; ".join(problems))
    from posenc.evaluate.effective import DEFAULT_ACC_FRACTION, DEFAULT_PPL_RATIO, check_thresholds
    from posenc.evaluate.runner import evaluate_model, print_results, replace_outputs, scaling_tag

    try:
        scaling = scaling_tag(eval_cfg)
        check_thresholds(
            float(eval_cfg.get("effective_ppl_ratio", DEFAULT_PPL_RATIO)),
            float(eval_cfg.get("effective_acc_fraction", DEFAULT_ACC_FRACTION)),
        )
    except ValueError as err:
        raise RunError(str(err)) from None
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    module, config = load_module(checkpoint, device, cfg.attention)
    check_consistency(config, run_dir, cfg)
    task = config["data"].get("task")
    datamodule = build_datamodule(config, num_samples=1)
    data_info = check_data(datamodule)
    stream = None if task else datamodule.stream(eval_cfg["split"])
    info = run_info(config, module.model.label, data_info)
    try:
        results = evaluate_model(module.model, run_info=info, eval_cfg=eval_cfg, stream=stream, task=task)
    except ValueError as err:  # a setting the model cannot honour (e.g. RoPE scaling of a model without RoPE)
        raise RunError(str(err)) from None
    if cfg.out_dir:
        out_dir = Path(cfg.out_dir)
    else:
        name = f"eval_sliding_s{eval_cfg['stride']}" if eval_cfg["mode"] == "sliding" else "eval"
        if scaling is not None:  # its own directory: a scaled evaluation never overwrites the plain one
            name += f"_{eval_cfg['rope_scaling']}x{float(eval_cfg['rope_scaling_factor']):g}"
        out_dir = run_dir / name
    images = replace_outputs(results, out_dir, plots=eval_cfg["plots"])
    if out_dir.resolve() == (run_dir / "eval").resolve():
        update_run_summary(run_dir, results["summary"])
    print_results(results)
    print(f"\nwrote {out_dir}/results.json and {len(images)} plot(s)")
    if cfg.wandb:
        _log_to_wandb(results, run_dir, images, config)


def _log_to_wandb(results: dict[str, Any], run_dir: Path, images: list[Path], config: dict[str, Any]) -> None:
    from lightning.pytorch.loggers import WandbLogger

    from posenc.evaluate.runner import log_results
    from posenc.loggers import resolve_wandb_mode

    previous = sorted((run_dir / "wandb").glob("*run-*"))
    run_id = previous[-1].name.rsplit("-", 1)[-1] if previous else None
    logger = WandbLogger(
        project=config["logger"].get("project", "posenc"),
        id=run_id,
        resume="allow",
        save_dir=str(run_dir),
        mode=resolve_wandb_mode(config["logger"].get("mode", "auto")),
    )
    log_results(results, [logger], images, step=0)
    logger.finalize("success")


def main() -> None:
    """Turn the positional run/checkpoint argument into the ``target=`` override Hydra expects."""
    args = sys.argv[1:]
    positional = [a for a in args if "=" not in a and not a.startswith("-")]
    if len(positional) != 1 or any(a.startswith("target=") for a in args):
        raise SystemExit(EVALUATE_USAGE)
    target = positional[0].replace("\\", "\\\\").replace("'", "\\'")
    sys.argv = [sys.argv[0], f"target='{target}'", *(a for a in args if a != positional[0])]
    _main()


if __name__ == "__main__":
    main()
