"""The LightningModule: next-token loss, AdamW with warmup + cosine, and logging. Deliberately thin.

Everything about positions lives in the model's schemes; this module only trains whatever ``Decoder`` it gets.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torchmetrics import MeanMetric

from posenc.encodings.length import scale_to_length
from posenc.model import Decoder
from posenc.training.compiling import compile_blocks, should_compile


class DivergedError(RuntimeError):
    """The loss or a gradient stopped being finite: training cannot recover, so the run stops at that step."""

    def __init__(self, step: int, what: str) -> None:
        super().__init__(f"{what} at step {step}")
        self.step = step


LOSS, GRADIENT = 1, 2  # what became non-finite first (the device-side record's codes)


def finite_check_interval(device: torch.device, log_every_n_steps: int) -> int:
    """How often (in steps) the host reads the device's record of a non-finite loss or gradient.

    Reading it is a host sync: free on CPU (every step), a pipeline stall per step on a GPU, where it is read at
    every logging step instead, before every checkpoint, and at the end of training. The step and value reported
    are still those of the first non-finite step, recorded on the device as it happened.
    """
    return 1 if device.type == "cpu" else max(1, log_every_n_steps)


def warmup_cosine(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup from ~0 to 1, then cosine decay to ``min_lr_ratio`` at ``max_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class LitDecoder(L.LightningModule):
    """Trains a ``Decoder``; ``config`` is the run's full resolved config, saved in every checkpoint.

    ``precision`` is the precision Lightning trained in, ``auto`` resolved (``bf16-mixed`` on a GPU): kept in the
    checkpoint, so an evaluation of it later runs in the precision the weights were trained in.
    """

    def __init__(self, config: dict[str, Any], vocab_size: int, precision: str | None = None) -> None:
        super().__init__()
        # In every checkpoint, not in the loggers: the run's loggers get the config once, from posenc.training.
        self.save_hyperparameters(logger=False)
        # A config resolved by posenc.train has its length settings already; one built another way gets them here.
        encoding = config["encoding"]
        if isinstance(encoding, Mapping) and "name" in encoding:
            encoding = scale_to_length(encoding, int(config["data"]["seq_len"]))[0]
        self.model = Decoder(
            encoding=encoding, vocab_size=vocab_size, attention=config["attention"]["name"], **config["model"]
        )
        if should_compile(config.get("compile", "auto"), config.get("trainer", {}).get("accelerator", "auto")):
            compile_blocks(self.model)
        self.optim = config["optim"]
        self.max_steps = int(config["trainer"]["max_steps"])
        self.val_loss = MeanMetric()  # token-weighted mean over the whole validation set, synced across ranks
        # The first non-finite step: its number, what (LOSS or GRADIENT) and the loss then; -1 while none.
        self.register_buffer("nonfinite_step", torch.tensor(-1), persistent=False)
        self.register_buffer("nonfinite_what", torch.tensor(0), persistent=False)
        self.register_buffer("nonfinite_loss", torch.tensor(0.0), persistent=False)
        self.check_every = 1
        self.grad_norm: Tensor | None = None  # the last step's global gradient norm, read by the stability monitor

    def on_fit_start(self) -> None:
        self.check_every = finite_check_interval(self.device, self.trainer.log_every_n_steps)

    def record_nonfinite(self, bad: Tensor, what: int, loss: Tensor | None = None) -> None:
        """Note on the device, without a host sync, the first step where ``bad`` (a 0-d bool) holds."""
        first = (self.nonfinite_step < 0) & bad
        step = torch.tensor(self.global_step, device=self.device)
        self.nonfinite_step.copy_(torch.where(first, step, self.nonfinite_step))
        self.nonfinite_what.copy_(torch.where(first, what, self.nonfinite_what))
        if loss is not None:
            self.nonfinite_loss.copy_(torch.where(first, loss.detach().float(), self.nonfinite_loss))

    def raise_if_diverged(self) -> None:
        """Stop the run if a non-finite loss or gradient was recorded (one host sync)."""
        step = int(self.nonfinite_step)
        if step < 0:
            return
        if int(self.nonfinite_what) == LOSS:
            raise DivergedError(step, f"the training loss became {float(self.nonfinite_loss)}")
        raise DivergedError(step, "a gradient became non-finite")

    def forward(self, tokens: Tensor) -> Tensor:
        return self.model(tokens)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        loss = self.model.loss(inputs, targets)
        self.record_nonfinite(~torch.isfinite(loss), LOSS, loss)
        self.log_dict({"train/loss": loss, "train/ppl": loss.exp()}, prog_bar=True)
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # A finite loss can still give an infinite gradient. One fused norm over every gradient is non-finite
        # exactly when some entry is; the weights it produces never reach a checkpoint (on_save_checkpoint).
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if grads:
            norms = torch.stack(torch._foreach_norm(grads))
            self.record_nonfinite(~norms.isfinite().all(), GRADIENT)
            self.grad_norm = torch.linalg.vector_norm(norms.float())  # the global norm, before clipping (stability.py)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.global_step % self.check_every == 0:
            self.raise_if_diverged()

    def on_train_end(self) -> None:
        self.raise_if_diverged()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Raised before Lightning writes the file: the last checkpoint on disk stays the last good one.
        self.raise_if_diverged()

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
        # decaying a distance-decay rate towards 0 would push every scheme towards NoPE. Scheme parameters get a group
        # of their own at lr × optim.scheme_lr_multiplier: an Adam step moves a weight by about its learning rate, so
        # with the model's lr a short run cannot carry a bias table far from its initialisation.
        scheme = self.model.scheme_parameters()
        scheme_ids = {id(p) for p in scheme.values()}
        decay, no_decay = [], []
        for param in self.model.parameters():
            if not param.requires_grad or id(param) in scheme_ids:
                continue
            (decay if param.ndim >= 2 else no_decay).append(param)
        lr = self.optim["lr"]
        # Named, so that the logged learning rates say whose they are (lr-AdamW/weights, not lr-AdamW/pg1).
        groups = [
            {"params": decay, "weight_decay": self.optim["weight_decay"], "name": "weights"},
            {"params": no_decay, "weight_decay": 0.0, "name": "norms_and_biases"},
        ]
        if scheme:  # only for a learnable scheme
            multiplier = float(self.optim.get("scheme_lr_multiplier", 1.0))
            groups.append(
                {"params": list(scheme.values()), "weight_decay": 0.0, "lr": lr * multiplier, "name": "scheme"}
            )
        optimizer = torch.optim.AdamW(groups, lr=lr, betas=tuple(self.optim["betas"]), eps=self.optim.get("eps", 1e-8))
        # LambdaLR scales each group's own initial lr: the scheme group stays at lr × multiplier all along.
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: warmup_cosine(step, self.optim["warmup_steps"], self.max_steps, self.optim["min_lr_ratio"]),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
