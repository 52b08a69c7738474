"""An evaluation's figures in the loggers: scalars everywhere, tables and charts in W&B (each once, one namespace)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import Logger

from posenc.data.retrieval import RETRIEVAL_TASKS
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


def log_results(
    results: dict[str, Any], loggers: list[Logger], images: list[Path], step: int | None, namespace: str = "eval"
) -> None:
    """Every figure once, under ``namespace/`` (the output folder's name: ``eval``, ``eval_sliding_s32``, ...).

    Scalars (``eval/ppl@4x``) go to every logger, which also makes them W&B's summary. W&B further gets a line
    chart of perplexity by length and one of loss by position (a line per length), each with its table
    (``eval/perplexity_table``, ``eval/loss_by_position_table``, logged with the chart, once), the task tables,
    and the PNGs under ``namespace/plots/``, so that a chart and an image never share a key. Every perplexity and
    task row carries the run's label, steps and tokens trained: a sweep group's tables compare directly.
    """
    for logger in loggers:
        logger.log_metrics({f"{namespace}/{k}": v for k, v in results["summary"].items()}, step=step)
        if type(logger).__name__ != "WandbLogger":
            continue
        import wandb

        training = results.get("training") or {}
        who = [results["label"], training.get("steps"), training.get("tokens")]
        logged: dict[str, Any] = {}
        if "perplexity" in results:
            fields = ["length", "multiple", "loss", "ppl", "bpb", "ratio", "tokens"]
            table = wandb.Table(
                columns=["label", "steps", "tokens_trained", *fields[:-1], "tokens_scored"],
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
                    columns=["label", "steps", "tokens_trained", *rows[0]], data=[[*who, *r.values()] for r in rows]
                )
        logged.update({f"{namespace}/plots/{image.stem}": wandb.Image(str(image)) for image in images})
        logger.experiment.log(logged)
