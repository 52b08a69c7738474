"""The LightningModule: next-token loss, AdamW with warmup + cosine, and logging. Deliberately thin.

Everything about positions lives in the model's schemes; this module only trains whatever ``Decoder`` it gets.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torchmetrics import MeanMetric

from posenc.compiling import compile_blocks, should_compile
from posenc.encodings.base import PositionalEncoding
from posenc.model import Decoder


class DivergedError(RuntimeError):
    """The loss or a gradient stopped being finite: training cannot recover, so the run stops at that step."""

    def __init__(self, step: int, what: str) -> None:
        super().__init__(f"{what} at step {step}")
        self.step = step


def warmup_cosine(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup from ~0 to 1, then cosine decay to ``min_lr_ratio`` at ``max_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class LitDecoder(L.LightningModule):
    """Trains a ``Decoder``; ``config`` is the run's full resolved config, saved in every checkpoint."""

    def __init__(self, config: dict[str, Any], vocab_size: int) -> None:
        super().__init__()
        # In every checkpoint, not in the loggers: the run's loggers get the config once, from posenc.training.
        self.save_hyperparameters(logger=False)
        self.model = Decoder(
            encoding=config["encoding"], vocab_size=vocab_size, attention=config["attention"]["name"], **config["model"]
        )
        if should_compile(config.get("compile", "auto"), config.get("trainer", {}).get("accelerator", "auto")):
            compile_blocks(self.model)
        self.optim = config["optim"]
        self.max_steps = int(config["trainer"]["max_steps"])
        self.val_loss = MeanMetric()  # token-weighted mean over the whole validation set, synced across ranks

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(tokens)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        loss = self.model.loss(inputs, targets)
        if not torch.isfinite(loss):
            raise DivergedError(self.global_step, f"the training loss became {loss.item()}")
        self.log_dict({"train/loss": loss, "train/ppl": loss.exp()}, prog_bar=True)
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # A finite loss can still give an infinite gradient; stepping on it would write NaN weights into the
        # next checkpoint, so the last checkpoint on disk stays the last good one.
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if grads and not torch.stack([g.isfinite().all() for g in grads]).all():
            raise DivergedError(self.global_step, "a gradient became non-finite")

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        loss = self.model.loss(inputs, targets)
        self.val_loss.update(loss, weight=targets.numel())
        return loss

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.val_loss.reset()
        # Byte-level tokens: bits per byte is the loss in bits.
        self.log_dict(
            {"val/loss": loss, "val/ppl": loss.exp(), "val/bpb": loss / math.log(2)}, prog_bar=True, sync_dist=True
        )

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        # Projected gradient descent: schemes with constrained parameters (KERPLE's r > 0) project them back
        # right after each step. (Not in on_before_zero_grad: Lightning zeroes grads *before* the backward.)
        super().optimizer_step(*args, **kwargs)
        self.model.constrain_()

    def configure_optimizers(self) -> dict[str, Any]:
        # No weight decay on norms, biases or scheme parameters (slopes, kernel parameters, bias tables):
        # decaying a distance-decay rate towards 0 would push every scheme towards NoPE.
        scheme_params = {
            id(p) for m in self.model.modules() if isinstance(m, PositionalEncoding) for p in m.parameters()
        }
        decay, no_decay = [], []
        for param in self.model.parameters():
            if not param.requires_grad:
                continue
            (decay if param.ndim >= 2 and id(param) not in scheme_params else no_decay).append(param)
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.optim["weight_decay"]},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.optim["lr"],
            betas=tuple(self.optim["betas"]),
            eps=self.optim.get("eps", 1e-8),
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: warmup_cosine(step, self.optim["warmup_steps"], self.max_steps, self.optim["min_lr_ratio"]),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
