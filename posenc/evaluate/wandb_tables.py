"""An evaluation's figures in the loggers: scalars everywhere, tables and charts in W&B (each once, one namespace).

The namespace is the evaluation's folder's (``posenc.evaluate.wandb_namespace``): the run's own evaluation logs under
its protocol (``eval/nonoverlap/``, ``eval/sliding_f0.5/``), a side evaluation with another sample under a namespace of
its own (``eval/nonoverlap_max_tokens4096/``), so the run's summary keeps its own figures; the settings each namespace's
figures come from are in the run's W&B config under the same name. Multiples are zero-padded in the keys
(``ppl@004x``, ``posenc.evaluate.sortable``), so that W&B lists them in numeric order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import Logger, WandbLogger

from posenc.data.retrieval import RETRIEVAL_TASKS
from posenc.evaluate import sortable, wandb_namespace
from posenc.evaluate.bins import smooth

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
    """Every figure once, under the namespace of ``folder``, where its files are (``wandb_namespace``).

    Scalars (``eval/nonoverlap/ppl@004x``) go to every logger, which also makes them W&B's summary. W&B further gets
    the settings they come from (config ``eval/<protocol>``: the evaluation's settings and its folder), a line chart
    of perplexity by length and one of loss by position (a line per length), each with its table
    (``eval/nonoverlap/perplexity_table``, ``…/loss_by_position_table``, logged with the chart, once), the task
    tables, and the PNGs under ``eval/<protocol>/plots/``, so that a chart and an image never share a key. Every
    perplexity and task row carries the run's label, run name, seed, steps and tokens trained: a sweep group's
    tables compare directly. ``step``: W&B's step, the optimizer step at the end of training, past the run's last
    logged step for a re-evaluation (``posenc.runs.loggers.SteppedWandbLogger``).
    """
    namespace = wandb_namespace(results.get("eval") or {}, folder)
    for logger in loggers:
        logger.log_metrics({f"{namespace}/{sortable(k)}": v for k, v in results["summary"].items()}, step=step)
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
