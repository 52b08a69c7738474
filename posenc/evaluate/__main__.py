"""``python -m posenc.evaluate <run dir or checkpoint> [eval.mode=sliding eval.stride=32 ...]``.

Rebuilds the model exactly as it was trained (scheme, sizes and data from the checkpoint's saved config),
refuses a checkpoint that does not match the run's config, and writes the full extrapolation evaluation:
perplexity by length, loss by position, synthetic-task accuracy, as JSON, CSV and PNG (see ``runner.py``).

Results go to ``<run>/eval`` when the settings are those the run evaluated with at the end of training, and
beside it otherwise (``eval_sliding_s32``, ``eval_yarnx8``, ``eval_max_tokens16384``): an evaluation with other
settings never replaces an earlier one. ``results.json`` records what the weights were trained for
(``training``: steps, tokens, checkpoint step, finished); an unfinished run is evaluated with a warning.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig

from posenc.config import CONF_DIR, check_command_line, to_container
from posenc.evaluate import sliding_dir
from posenc.jsonio import DiskFullError, cannot_create
from posenc.runs import (
    EVALUATE_USAGE,
    RunError,
    build_datamodule,
    check_consistency,
    check_data,
    check_wandb,
    checkpoint_training,
    experiment_settings,
    load_checkpoint,
    load_module,
    read_checkpoint,
    resolve_checkpoint,
    run_info,
    update_run_summary,
)
from posenc.schema import EvaluateConfig


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="evaluate")
def _main(cfg: DictConfig) -> None:
    checkpoint, run_dir = resolve_checkpoint(cfg.target)
    eval_cfg = to_container(cfg.eval)
    device = _device(cfg.device)
    config = read_checkpoint(checkpoint)[1]
    task = config["data"].get("task")
    out_dir = Path(cfg.out_dir) if cfg.out_dir else run_dir / eval_dir_name(eval_cfg, config.get("eval") or {}, task)
    logger_cfg = config.get("logger") or {}
    wandb = cfg.wandb is True or (cfg.wandb == "auto" and logger_cfg.get("kind") == "wandb")
    if wandb:  # the run's own W&B run, online only with a key: never a prompt
        check_wandb(
            {**logger_cfg, "kind": "wandb"},
            f"the run's logger.mode={logger_cfg.get('mode', 'auto')}",
            "evaluate with wandb=false, or offline with WANDB_MODE=offline (upload later with `wandb sync`)",
        )
    if (why := cannot_create(out_dir)) is not None:
        raise RunError(f"cannot write the results to {out_dir} ({why}): give out_dir=<a writable folder>")
    from posenc.evaluate.outputs import print_results

    multiples = ", ".join(f"{m}×" for m in eval_cfg["multiples"])
    print(f"evaluating {checkpoint} at {multiples} the training length into {out_dir} (Ctrl-C stops it)", flush=True)
    kept = f"{out_dir} is as it was" if out_dir.exists() else f"nothing was written ({out_dir} does not exist)"
    try:
        results, images = _evaluate(cfg, checkpoint, run_dir, eval_cfg, device, out_dir)
        kept = f"{out_dir} holds this evaluation's results"
        print_results(results)
        if wandb:
            kept += "; W&B may hold part of them"
            _log_to_wandb(results, run_dir, images, config, folder=out_dir.name)
    except KeyboardInterrupt:
        raise SystemExit(f"interrupted: {kept}") from None
    print(f"\nwrote {out_dir}/results.json and {len(images)} plot(s)")  # the last line: where the results are


def _device(asked: str) -> str:
    """The device to evaluate on; one line where the one asked for is not on this machine."""
    if asked == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if asked.startswith("cuda") and not torch.cuda.is_available():
        raise RunError(
            f"device={asked}: this machine has no CUDA GPU (torch.cuda.is_available() is false): use device=cpu, "
            "or device=auto (cuda when there is one)"
        )
    if asked.startswith("cuda:") and int(asked.partition(":")[2]) >= torch.cuda.device_count():
        raise RunError(f"device={asked}: this machine has {torch.cuda.device_count()} CUDA GPU(s), cuda:0 first")
    if asked == "mps" and not torch.backends.mps.is_available():
        raise RunError("device=mps: this machine has no Apple GPU (MPS): use device=cpu or device=auto")
    return asked


def _evaluate(
    cfg: DictConfig, checkpoint: Path, run_dir: Path, eval_cfg: dict[str, Any], device: str, out_dir: Path
) -> tuple[dict[str, Any], list[Path]]:
    """Load the trained module, evaluate it, write its folder (whole or not at all); the results and plots."""
    from posenc.evaluate.drift import from_checkpoint as drift_from_checkpoint
    from posenc.evaluate.runner import evaluate_model, replace_outputs

    module, config = load_module(checkpoint, device, cfg.attention)
    check_consistency(config, run_dir, cfg)
    task = config["data"].get("task")
    datamodule = build_datamodule(config, num_samples=1)
    data_info = check_data(datamodule)
    stream, leakage = (
        (None, None)
        if task
        else datamodule.heldout_stream(
            eval_cfg["split"], eval_cfg.get("max_containment"), eval_cfg.get("near_copies", "lines")
        )
    )
    training = checkpoint_training(checkpoint, config)
    if not training["finished"]:
        print(
            f"warning: {run_dir} is unfinished (its checkpoint is at step {training['steps']} of "
            f"trainer.max_steps={training['max_steps']}): results.json says so, and posenc.report leaves it out "
            "unless --include-unfinished",
            file=sys.stderr,
        )
    callbacks_state = load_checkpoint(checkpoint, mmap=True).get("callbacks") or {}
    info = {
        **run_info(config, module.model.label, data_info),
        "training": training,
        "positional_drift": drift_from_checkpoint(callbacks_state, module.model),
    }
    try:
        results = evaluate_model(
            module.model,
            run_info=info,
            eval_cfg=eval_cfg,
            stream=stream,
            task=task,
            precision=module.hparams.precision,
            leakage=leakage,
        )
    except ValueError as err:  # a setting the model cannot honour (e.g. RoPE scaling of a model without RoPE)
        raise RunError(str(err)) from None
    try:
        images = replace_outputs(results, out_dir, plots=eval_cfg["plots"])
        if out_dir.resolve() == (run_dir / "eval").resolve():
            update_run_summary(run_dir, results["summary"])
    except DiskFullError as full:
        raise RunError(f"{full}; {out_dir} is as it was. Free space, then run the same command again") from None
    return results, images


# Hydra's flags that print and run nothing (--help lists the eval.* options).
HYDRA_PRINTS = ("-h", "--help", "--hydra-help", "--cfg", "-c", "--info", "-i")

# Evaluation settings that change neither what is scored nor how (so they never name a directory); the sliding
# evaluations a training run adds at its end are evaluations of their own, in folders of their own.
EVAL_RUNTIME = ("at_end", "plots", "tokens_per_batch", "sliding_fractions")


def eval_dir_name(eval_cfg: dict[str, Any], trained_eval: dict[str, Any], task: str | None = None) -> str:
    """``eval`` for the settings the run evaluated with at the end of training; otherwise a name for the change.

    Sliding windows and RoPE scaling name themselves (``eval_sliding_s32``, ``eval_sliding_f0.5`` for a stride of half
    of each length, ``eval_yarnx8``); any other setting
    that differs from the end-of-training evaluation is appended as ``key`` + value (``eval_max_tokens16384``), so
    an evaluation with other settings never replaces an earlier one, and the same command lands in the same place.
    A task's settings count only when that task is scored (``enabled: auto`` scores the task a model trained on).
    """
    from posenc.evaluate.runner import TASK_NAMES

    enabled = {name: (eval_cfg.get(name) or {}).get("enabled", "auto") for name in TASK_NAMES}
    idle = [name for name, on in enabled.items() if not (on is True or (on == "auto" and task == name))]
    if not eval_cfg.get("attention_stats"):
        idle.append("attention_stats_tokens")
    name = "eval"
    if eval_cfg["mode"] == "sliding":
        fraction = eval_cfg.get("stride_fraction")
        name = sliding_dir(fraction) if fraction is not None else f"eval_sliding_s{eval_cfg['stride']}"
    if eval_cfg.get("rope_scaling") is not None:  # its own directory: a scaled evaluation never overwrites the plain
        name += f"_{eval_cfg['rope_scaling']}x{float(eval_cfg['rope_scaling_factor']):g}"
    if eval_cfg.get("attention_scale") is not None:  # likewise a length-scaled evaluation: eval_log_n
        name += f"_{eval_cfg['attention_scale']}"
    asked, trained = experiment_settings(eval_cfg), experiment_settings(trained_eval)
    if eval_cfg.get("near_copies", "lines") != "lines":  # another held-out set: eval_near_copies_bytes
        name += f"_near_copies_{eval_cfg['near_copies']}"
    named = ("mode", "stride", "stride_fraction", "rope_scaling", "rope_scaling_factor", "attention_scale")
    named = (*named, "near_copies")
    named = (*named, *EVAL_RUNTIME, *idle)
    for key, value in asked.items():
        if key.split(".")[0] in named or trained.get(key) == value:
            continue
        shown = (
            "-".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value) if isinstance(value, list) else value
        )
        name += "_" + key.replace(".", "-") + "".join(c for c in str(shown) if c.isalnum() or c in ".-")
    return name


def _log_to_wandb(
    results: dict[str, Any], run_dir: Path, images: list[Path], config: dict[str, Any], folder: str
) -> None:
    """Resume the run's own W&B run (its id from the saved config or ``wandb_id``) and log past its last step.

    The figures land under the keys of ``folder`` (``posenc.evaluate.wandb_namespace``): the run's own evaluation
    (``eval/``) under its protocol's, as training logged it (``eval/nonoverlap/ppl@004x``); a side evaluation
    (``eval_max_tokens4096/``) under keys of its own, so that it never overwrites the run's summary.
    """
    from posenc.evaluate.wandb_tables import log_results
    from posenc.runs import WANDB_ID_FILE
    from posenc.runs.loggers import SteppedWandbLogger, next_wandb_step, record_wandb_step, resolve_wandb_mode

    logger_cfg = config["logger"]
    mode = resolve_wandb_mode(logger_cfg.get("mode", "auto"))
    if mode == "disabled":
        return
    id_file = run_dir / WANDB_ID_FILE
    run_id = logger_cfg.get("id") or (id_file.read_text().strip() if id_file.is_file() else None)
    logger = SteppedWandbLogger(
        project=logger_cfg.get("project", "posenc"),
        entity=logger_cfg.get("entity"),
        group=logger_cfg.get("group"),
        id=run_id,
        save_dir=str(run_dir),
        mode=mode,
    )
    # Online, W&B knows the resumed run's next step; offline, the run directory's record says it.
    step = max(next_wandb_step(run_dir, int(results["training"]["steps"] or 0)), logger.experiment.step)
    log_results(results, [logger], images, step=step, folder=folder)
    logger.finalize("success")
    record_wandb_step(run_dir, step)
    import wandb

    if wandb.run is not None:
        wandb.finish()


def main() -> None:
    """Turn the positional run/checkpoint argument into the ``target=`` override Hydra expects."""
    args = sys.argv[1:]
    if any(a in HYDRA_PRINTS for a in args):  # --help lists the eval.* options: no run is read
        sys.argv = [sys.argv[0], *(a for a in args if not Path(a).exists())]
        _main()
        return
    positional = [a for a in args if "=" not in a and not a.startswith("-")]
    if len(positional) != 1 or any(a.startswith("target=") for a in args):
        raise SystemExit(EVALUATE_USAGE)
    target = positional[0].replace("\\", "\\\\").replace("'", "\\'")
    rest = [a for a in args if a != positional[0]]
    # encoding and model are the checkpoint's: check_consistency refuses an override that contradicts them
    check_command_line(
        [f"target='{target}'", *rest],
        "evaluate",
        "posenc.evaluate",
        read_elsewhere=("encoding", "model"),
        schema=EvaluateConfig,
    )
    sys.argv = [sys.argv[0], f"target='{target}'", *rest]
    try:
        _main()
    except KeyboardInterrupt:  # before the evaluation began (Hydra starting): nothing of it was written
        raise SystemExit("interrupted before the evaluation began: nothing was written") from None


if __name__ == "__main__":
    main()
