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
from posenc.evaluate.runner import evaluate_model, print_results, scaling_tag, write_outputs
from posenc.lit import LitDecoder

USAGE = "usage: python -m posenc.evaluate <run dir or checkpoint.ckpt> [eval.multiples=[1,2,4] eval.mode=sliding ...]"


def resolve_checkpoint(target: str) -> tuple[Path, Path]:
    """(checkpoint file, run directory) for a run directory or a checkpoint path."""
    path = Path(target).expanduser()
    if path.is_dir():
        checkpoint = path / "checkpoints" / "last.ckpt"
        if not checkpoint.exists():
            raise SystemExit(f"no checkpoint at {checkpoint}: is {path} a posenc run directory that finished a step?")
        return checkpoint, path
    if path.is_file():
        run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
        return path, run_dir
    raise SystemExit(f"{target} is neither a run directory nor a checkpoint file\n{USAGE}")


def check_consistency(trained: dict[str, Any], run_dir: Path, cfg: DictConfig) -> None:
    """Refuse to evaluate a checkpoint under a config it was not trained with."""
    saved = run_dir / ".hydra" / "config.yaml"
    if saved.exists():
        run_config = OmegaConf.to_container(OmegaConf.load(saved), resolve=False)
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


def _plain(value: Any) -> Any:
    """Compare configs without interpolations (e.g. learned.max_positions: ${data.seq_len} vs 64)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if not (isinstance(v, str) and v.startswith("${"))}
    return value


def load_module(
    checkpoint: Path, device: str, attention: str | None, compile_setting: str | bool | None = None
) -> tuple[LitDecoder, dict[str, Any]]:
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    try:
        hparams = state["hyper_parameters"]
        config = hparams["config"]
    except KeyError as err:
        raise SystemExit(f"{checkpoint} is not a posenc checkpoint (no saved config: missing {err})") from err
    if attention is not None:
        config = {**config, "attention": {"name": attention}}
    if compile_setting is not None:
        config = {**config, "compile": compile_setting}
    module = LitDecoder(config, vocab_size=hparams["vocab_size"])
    try:
        module.load_state_dict(state["state_dict"])
    except RuntimeError as err:
        raise SystemExit(
            f"checkpoint/config mismatch: {checkpoint}'s weights do not fit its saved config: {err}"
        ) from err
    return module.to(device).eval(), config


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="evaluate")
def _main(cfg: DictConfig) -> None:
    from posenc.train import build_datamodule, run_info

    checkpoint, run_dir = resolve_checkpoint(cfg.target)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    module, config = load_module(checkpoint, device, cfg.attention, cfg.compile)
    check_consistency(config, run_dir, cfg)
    eval_cfg = to_container(cfg.eval)
    try:
        scaling = scaling_tag(eval_cfg)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    task = config["data"].get("task")
    datamodule = build_datamodule(config, num_samples=1)
    stream = None if task else datamodule.stream(eval_cfg["split"])
    info = run_info(config, module.model.label, datamodule.describe())
    try:
        results = evaluate_model(module.model, run_info=info, eval_cfg=eval_cfg, stream=stream, task=task)
    except ValueError as err:  # a setting the model cannot honour (e.g. RoPE scaling of a model without RoPE)
        raise SystemExit(str(err)) from None
    if cfg.out_dir:
        out_dir = Path(cfg.out_dir)
    else:
        name = f"eval_sliding_s{eval_cfg['stride']}" if eval_cfg["mode"] == "sliding" else "eval"
        if scaling is not None:  # its own directory: a scaled evaluation never overwrites the plain one
            name += f"_{eval_cfg['rope_scaling']}x{float(eval_cfg['rope_scaling_factor']):g}"
        out_dir = run_dir / name
    images = write_outputs(results, out_dir, plots=eval_cfg["plots"])
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
