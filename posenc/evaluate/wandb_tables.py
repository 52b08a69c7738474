"""An evaluation's figures in the loggers: scalars everywhere, tables and charts in W&B (each once, one namespace).

The namespace is the protocol (``eval/nonoverlap/``, ``eval/sliding_f0.5/``), never the folder a re-evaluation
writes to: evaluating a run again with another sample (``eval.max_tokens``, ``eval.split``) updates the same keys,
and the settings each protocol's latest figures come from are in the run's W&B config (``eval/<protocol>``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import Logger, WandbLogger

from posenc.data.retrieval import RETRIEVAL_TASKS
from posenc.evaluate import protocol_name
from posenc.evaluate.plots import smooth

TASK_TABLES = (
    "passkey",
    "copy",
    *RETRIEVAL_TASKS,
    "mqar_by_distance",
    "mqar_by_query",
    "mqar_by_distance_position",
    "attention_stats",
)


# Evaluation settings that change neither what is scored nor how: not recorded beside the figures.
RUNTIME_SETTINGS = ("at_end", "plots", "tokens_per_batch", "sliding_fractions")


def log_results(
    results: dict[str, Any], loggers: list[Logger], images: list[Path], step: int | None, folder: str = "eval"
) -> None:
    """Every figure once, under ``eval/<protocol>/`` (``protocol_name``); ``folder``: where its files are.

    Scalars (``eval/nonoverlap/ppl@4x``) go to every logger, which also makes them W&B's summary. W&B further gets
    the settings they come from (config ``eval/<protocol>``: the evaluation's settings and its folder), a line chart
    of perplexity by length and one of loss by position (a line per length), each with its table
    (``eval/nonoverlap/perplexity_table``, ``…/loss_by_position_table``, logged with the chart, once), the task
    tables, and the PNGs under ``eval/<protocol>/plots/``, so that a chart and an image never share a key. Every
    perplexity and task row carries the run's label, run name, seed, steps and tokens trained: a sweep group's
    tables compare directly. ``step``: W&B's step, the optimizer step at the end of training, past the run's last
    logged step for a re-evaluation (``posenc.runs.loggers.SteppedWandbLogger``).
    """
    namespace = f"eval/{protocol_name(results.get('eval') or {})}"
    for logger in loggers:
        logger.log_metrics({f"{namespace}/{k}": v for k, v in results["summary"].items()}, step=step)
        if not isinstance(logger, WandbLogger):
            continue
        import wandb

        settings = {k: v for k, v in (results.get("eval") or {}).items() if k not in RUNTIME_SETTINGS}
        logger.experiment.config.update({namespace: {**settings, "folder": folder}}, allow_val_change=True)

        training = results.get("training") or {}
        who = [
            results["label"],
            results.get("run_name"),
            results.get("seed"),
            training.get("steps"),
            training.get("tokens"),
        ]
        logged: dict[str, Any] = {}
        if "perplexity" in results:
            fields = ["length", "multiple", "loss", "ppl", "bpb", "ratio", "tokens"]
            table = wandb.Table(
                columns=["label", "run", "seed", "steps", "tokens_trained", *fields[:-1], "tokens_scored"],
                data=[[*who, *(r[c] for c in fields)] for r in results["perplexity"] if not r["error"]],
            )
            logged[f"{namespace}/perplexity"] = wandb.plot.line(
                table, "length", "ppl", stroke="label", title=f"{results['label']}: perplexity vs evaluation length"
            )
            curves = wandb.Table(columns=["length", "position", "loss"])
            for length, curve in sorted(results["loss_by_position"].items(), key=lambda item: int(item[0])):
                for x, y in zip(*smooth(curve), strict=True):
                    curves.add_data(int(length), float(x), float(y))
            logged[f"{namespace}/loss_by_position"] = wandb.plot.line(
                curves, "position", "loss", stroke="length", title=f"{results['label']}: loss by position, per length"
            )
        for name in TASK_TABLES:
            if results.get(name):
                rows = results[name]
                logged[f"{namespace}/{name}"] = wandb.Table(
                    columns=["label", "run", "seed", "steps", "tokens_trained", *rows[0]],
                    data=[[*who, *r.values()] for r in rows],
                )
        logged.update({f"{namespace}/plots/{image.stem}": wandb.Image(str(image)) for image in images})
        logger.experiment.log(logged, step=step)
