"""The in-length accuracy of a task run at every validation, so a report can show that it had stopped moving.

A task run validates on held-out windows of its training format (the same generator, another seed stream). The
loss alone does not say whether a retrieval was learned; the fraction of answers whose every byte is the argmax
does. ``ValidationAccuracy`` logs it as ``val/accuracy`` beside ``val/loss`` and keeps the curve, which
``run.json`` records as ``val_curve`` (step, loss, accuracy, answers): the report draws it and reads from it how
much the accuracy still moved over the last part of training.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from posenc.data.tasks import IGNORE


def answer_counts(logits: torch.Tensor, targets: torch.Tensor) -> tuple[int, int]:
    """(answers right, answers) in a batch: an answer is a run of scored targets, right when every byte is."""
    right = (logits.argmax(dim=-1) == targets) | (targets == IGNORE)
    scored = targets != IGNORE
    # An answer starts where a scored target follows an unscored one (or opens the window).
    starts = scored & ~torch.nn.functional.pad(scored[:, :-1], (1, 0), value=False)
    answer_id = torch.cumsum(starts.flatten(), 0).reshape(scored.shape)  # 1.. per answer, row-major
    answers = int(starts.sum())
    if answers == 0:
        return 0, 0
    wrong = torch.zeros(answers + 1, dtype=torch.bool)
    wrong.index_put_((answer_id[scored],), ~right[scored], accumulate=True)
    return answers - int(wrong[1:].sum()), answers


class ValidationAccuracy(Callback):
    """Answer accuracy on the validation windows of a task run, logged and kept at every validation."""

    def __init__(self) -> None:
        self.right, self.answers = 0, 0
        self.history: list[dict[str, Any]] = []

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.right, self.answers = 0, 0

    @torch.no_grad()
    def on_validation_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int, **_: Any
    ) -> None:
        inputs, targets = batch
        right, answers = answer_counts(pl_module(inputs).cpu(), targets.cpu())
        self.right, self.answers = self.right + right, self.answers + answers

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and self.answers:
            pl_module.log("val/accuracy", self.right / self.answers, sync_dist=True)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Here, not at the epoch's end: callbacks' epoch-end hooks run before the module logs val/loss.
        if trainer.sanity_checking or not self.answers:
            return
        loss = trainer.callback_metrics.get("val/loss")
        self.history.append(
            {
                "step": trainer.global_step,
                "loss": None if loss is None else float(loss),
                "accuracy": self.right / self.answers,
                "answers": self.answers,
            }
        )

    def state_dict(self) -> dict[str, Any]:
        """Saved in every checkpoint: a resumed run keeps the curve of the steps before it."""
        return {"history": list(self.history)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))
