"""What a training run shows: its own lines, Lightning's records once, and none of the libraries' noise.

The console of a run is read line by line, and ``train.log`` is its copy: a tip to install another logging service,
a deprecation inside Lightning, a FLOPs column Lightning never counted (it counts only for an ``example_input_array``)
and W&B's note on a setting Lightning passes it are noise to whoever reads either. Each is turned off where the
library offers a switch (a ``ModelSummary`` without the column, W&B's settings), else filtered by its exact message,
so every other warning and record still shows.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table

# Lightning's rank-zero records (device lines, "`Trainer.fit` stopped") and its advertising tips share one logger.
RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
TIP_PREFIX = "💡 Tip:"
# Warnings raised inside libraries about their own use of another library, nothing a run could change.
LIBRARY_WARNINGS = (
    # Lightning's pytree helper on torch >= 2.9 (lightning/pytorch/utilities/_pytree.py)
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    # A resumed run's dataloader need not restore its position: training windows are numbered, and a resumed run
    # starts after those it trained on (TokenAccounting).
    "You're resuming from a checkpoint that ended before the epoch ended",
)


class _NoTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(TIP_PREFIX)


def quiet_libraries() -> None:
    """Silence the known noise (see the module's docstring); idempotent, so each job of a multirun may call it."""
    for message in LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    for name in RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTips) for f in logger.filters):
            logger.addFilter(_NoTips())


def route_lightning_logging() -> None:
    """Lightning's records through the application's handlers only (Hydra's console), so each prints once.

    Lightning attaches its own console handler to its loggers when it is imported; under Hydra, whose root handler
    also receives them, every line (the model summary, the Ctrl-C notice) would print twice. Without handlers on
    the root logger (the Python API, tests) Lightning's own stay.
    """
    if not logging.getLogger().handlers:
        return
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.propagate = True


class CountedModelSummary(ModelSummary):
    """Lightning's model summary without its FLOPs column and "0 Total Flops" line when it counted none.

    Lightning counts FLOPs only for a module with an ``example_input_array``; posenc's has none (a batch's shape is
    the config's), so the column would read 0 for every layer.
    """

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        if total_flops:
            ModelSummary.summarize(
                summary_data, total_parameters, trainable_parameters, model_size, total_training_modes, total_flops
            )
            return
        columns = [column for column in summary_data if column[0] != "FLOPs"]
        table = _format_summary_table(
            total_parameters, trainable_parameters, model_size, total_training_modes, 0, *columns
        )
        logging.getLogger(ModelSummary.__module__).info("\n" + table.rsplit("\n", 1)[0])  # the "Total Flops" line
