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
from omegaconf import DictConfig, OmegaConf

from posenc.config import CONF_DIR, to_container
from posenc.runs import (
    RunError,
    build_datamodule,
    check_data,
    eval_problems,
    load_module,
    run_info,
    update_run_summary,
)

USAGE = "usage: python -m posenc.evaluate <run dir or checkpoint.ckpt> [eval.multiples=[1,2,4] eval.mode=sliding ...]"


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
    raise RunError(f"{target} is neither a run directory nor a checkpoint file; {USAGE}")


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


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="evaluate")
def _main(cfg: DictConfig) -> None:
    checkpoint, run_dir = resolve_checkpoint(cfg.target)
    eval_cfg = to_container(cfg.eval)
    problems = eval_problems(eval_cfg)
    if problems:
        raise RunError("; ".join(problems))
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    module, config = load_module(checkpoint, device, cfg.attention)
    check_consistency(config, run_dir, cfg)
    from posenc.evaluate.runner import evaluate_model, print_results, replace_outputs

    task = config["data"].get("task")
    datamodule = build_datamodule(config, num_samples=1)
    data_info = check_data(datamodule)
    stream = None if task else datamodule.stream(eval_cfg["split"])
    info = run_info(config, module.model.label, data_info)
    results = evaluate_model(module.model, run_info=info, eval_cfg=eval_cfg, stream=stream, task=task)
    if cfg.out_dir:
        out_dir = Path(cfg.out_dir)
    elif eval_cfg["mode"] == "sliding":
        out_dir = run_dir / f"eval_sliding_s{eval_cfg['stride']}"
    else:
        out_dir = run_dir / "eval"
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
        raise SystemExit(USAGE)
    target = positional[0].replace("\\", "\\\\").replace("'", "\\'")
    sys.argv = [sys.argv[0], f"target='{target}'", *(a for a in args if a != positional[0])]
    _main()


if __name__ == "__main__":
    main()
