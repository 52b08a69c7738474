"""Training stability, recorded in every run: spikes of the loss and the gradient norm, the largest attention logit.

- **Spikes** (OLMo-core's rule): step t's value is a spike when it is more than 6 standard deviations (of the
  population) above the mean of the 128 steps before it; a step is judged once 128 steps precede it, and a spike
  stays in the window of the steps after it. Counted for the training loss (the mean over a step's micro-batches,
  this process's) and for the gradient's global L2 norm before clipping.
- **Gradient norm percentiles**: 50th, 90th, 99th and the largest, over every step trained.
- **Largest attention logit**: max over layers, heads and causal pairs of z_ij = q_i · k_j / √D, the rotated query
  and key's scaled product before any bias (Wortsman et al., 2023, §3.1, whose "attention logit growth" is this
  number growing), sampled about every ``LOGIT_EVERY`` steps (at a logging step) and at the last, on the batch's first
  window through the layers' own projections (``posenc.probe``): no backend exposes its scores, so this is one extra
  forward of one window, without gradients, per sample.

Every step writes its loss and gradient norm into two preallocated tensors on the device (two copies into a slice, no
host sync); the counts are taken from them where Lightning logs anyway (a vectorised pass over the steps since),
and the record at the end or at a divergence. The series ride in the checkpoint (``state_dict``), so a resumed run
counts over all its steps. ``record`` is what ``run.json`` holds under ``stability``, and ``failed.json`` for a run that
diverged: its spikes and norms up to the step it stopped at.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

from posenc.attention.window import visible
from posenc.probe import visit_layers
from posenc.runtime import precision_context

SPIKE_WINDOW = 128  # steps the mean and deviation are taken over
SPIKE_SIGMAS = 6.0  # a spike: more than this many standard deviations above that mean
PERCENTILES = (50, 90, 99)
MAX_SCORES = 1 << 22  # scores held at once by the logit probe
# Steps between two samples of the largest logit: on 2 shared CPU cores (tiny model, L = 64, batch 32) one sample cost
# about 2% of a step, so one every 50 steps costs ~0.04% of them, and a 600-step run still has 12 samples.
LOGIT_EVERY = 50
RULE = (
    f"a spike: more than {SPIKE_SIGMAS:g} standard deviations above the mean of the {SPIKE_WINDOW} steps before "
    "(OLMo-core's rule)"
)


def spikes(series: Tensor, start: int = SPIKE_WINDOW) -> Tensor:
    """Indices t ≥ ``start`` of ``series`` (T,) whose value exceeds mean + 6 · std of the 128 values before it."""
    start = max(start, SPIKE_WINDOW)
    if series.numel() <= start:
        return torch.zeros(0, dtype=torch.long, device=series.device)
    values = series.double()
    windows = values[start - SPIKE_WINDOW : -1].unfold(0, SPIKE_WINDOW, 1)  # row r: the 128 before step start + r
    mean, std = windows.mean(dim=1), windows.std(dim=1, unbiased=False)
    above = values[start:] > mean + SPIKE_SIGMAS * std
    return torch.nonzero(above & torch.isfinite(values[start:])).flatten() + start


@torch.no_grad()
def max_attention_logit(model: nn.Module, tokens: Tensor, precision: str = "32-true") -> float:
    """The largest z_ij = q_i · k_j / √D over every layer, head and visible pair of ``tokens`` (B, L), in fp32.

    The forward runs in ``precision``, the run's own (``bf16-mixed``: under autocast), so the q and k measured are
    those training computes; only the product is taken in fp32.
    """
    largest = [-math.inf]

    def visit(
        layer: int, q: Tensor, k: Tensor, encoding: Any, pos: Tensor, features: Any, sink: Any, window: int | None
    ) -> None:
        rows = max(1, MAX_SCORES // (q.shape[0] * q.shape[1] * k.shape[-2]))
        scale = q.shape[-1] ** -0.5
        for start in range(0, q.shape[-2], rows):
            chunk = slice(start, start + rows)
            scores = torch.matmul(q[:, :, chunk].float(), k.float().transpose(-1, -2)) * scale
            scores = scores.masked_fill(~visible(pos[chunk], pos, window), -math.inf)  # causal, within a window
            largest[0] = max(largest[0], float(scores.max()))

    was_training = model.training
    model.eval()
    try:
        with precision_context(precision, tokens.device):
            visit_layers(model, tokens, visit)
    finally:
        model.train(was_training)
    return largest[0]


class StabilityMonitor(Callback):
    """Records each step's loss and gradient norm, counts their spikes, samples the largest attention logit.

    The LightningModule leaves the step's gradient norm in ``grad_norm`` (a 0-d tensor, from the norms its finiteness
    check computes); the loss comes from the step's outputs.
    """

    def __init__(self, max_steps: int) -> None:
        self.max_steps = max_steps
        self.loss: Tensor | None = None  # (max_steps,) fp32 on the device, NaN where a step was not trained
        self.grad_norm: Tensor | None = None
        self.counted = 0  # steps whose spikes are in the counts
        self.loss_spikes: list[int] = []
        self.grad_norm_spikes: list[int] = []
        self.logits: list[tuple[int, float]] = []  # (step, largest attention logit) at each sample
        self.pending: Tensor | None = None  # the current step's micro-batch losses, summed, and their count
        self.micro_batches = 0
        self.steps = 0
        self.saved: dict[str, Any] | None = None
        self.window: Tensor | None = None  # the first window of the last step's batch

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        device = pl_module.device
        self.loss = torch.full((self.max_steps,), math.nan, device=device)
        self.grad_norm = torch.full((self.max_steps,), math.nan, device=device)
        if self.saved is not None:  # restored before the buffers existed
            self.restore()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.pending = loss.detach().float() + (0.0 if self.pending is None else self.pending)
        self.micro_batches += 1
        step = trainer.global_step
        if step == self.steps:  # accumulating: no optimizer step yet
            return
        if step <= self.max_steps:  # a slice by host integers: a view, no index tensor to copy to the device
            self.loss[step - 1 : step].copy_((self.pending / self.micro_batches).reshape(1))
            norm = getattr(pl_module, "grad_norm", None)
            if norm is not None:
                self.grad_norm[step - 1 : step].copy_(norm.detach().float().reshape(1))
        self.pending, self.micro_batches, self.steps = None, 0, step
        self.window = (batch[0] if isinstance(batch, list | tuple) else batch)[:1]  # a view: the last step's window
        every = trainer.log_every_n_steps
        if step % every:  # Lightning logs at these steps only
            return
        self.count(step)
        logged = {
            "stability/loss_spikes": float(len(self.loss_spikes)),
            "stability/grad_norm_spikes": float(len(self.grad_norm_spikes)),
            "train/grad_norm": float(self.grad_norm[step - 1]),
        }
        if (step // every) % max(1, round(LOGIT_EVERY / every)) == 0:
            self.logits.append((step, max_attention_logit(pl_module.model, self.window, str(trainer.precision))))
            logged["stability/max_attention_logit"] = self.logits[-1][1]
        pl_module.log_dict(logged)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A last sample of the largest logit at the last step, so that a run shorter than ``LOGIT_EVERY`` has one."""
        if self.window is not None and (not self.logits or self.logits[-1][0] != self.steps):
            self.logits.append((self.steps, max_attention_logit(pl_module.model, self.window, str(trainer.precision))))

    def count(self, steps: int) -> None:
        """Add the spikes of the steps trained since the last count (each judged against the 128 before it)."""
        if self.loss is None or steps <= self.counted:
            return
        for series, found in ((self.loss, self.loss_spikes), (self.grad_norm, self.grad_norm_spikes)):
            found += (spikes(series[:steps], start=self.counted) + 1).tolist()  # step numbers count from 1
        self.counted = steps

    def record(self, steps: int | None = None) -> dict[str, Any]:
        """What ``run.json`` (or ``failed.json``) keeps: the rule, the spikes, the norms' percentiles, the logits."""
        steps = self.steps if steps is None else steps
        self.count(steps)
        norms = self.grad_norm[:steps] if self.grad_norm is not None else torch.zeros(0)
        norms = norms[torch.isfinite(norms)].double()
        percentiles = {f"p{p}": float(torch.quantile(norms, p / 100)) for p in PERCENTILES} if norms.numel() else {}
        largest = max(self.logits, key=lambda sample: sample[1]) if self.logits else None
        first = self.loss[:1] if self.loss is not None and steps else torch.zeros(0)
        return {
            "rule": RULE,
            "steps": steps,
            # the first step's loss, taken before any update: the loss at initialisation a sensitivity is capped at
            "initial_loss": float(first[0]) if first.numel() and math.isfinite(float(first[0])) else None,
            "loss_spikes": len(self.loss_spikes),
            "grad_norm_spikes": len(self.grad_norm_spikes),
            "loss_spike_steps": self.loss_spikes,
            "grad_norm_spike_steps": self.grad_norm_spikes,
            "grad_norm": {**percentiles, "max": float(norms.max())} if norms.numel() else None,
            "max_attention_logit": None if largest is None else {
                "max": largest[1], "at_step": largest[0], "last": self.logits[-1][1], "samples": len(self.logits),
            },
        }  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """Saved in every checkpoint: the series so far, so that a resumed run counts over all its steps."""
        series = {name: [] if t is None else t[: self.steps].tolist() for name, t in self.series().items()}
        return {**series, "steps": self.steps, "logits": self.logits}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A resumed run: its steps' series, written into the buffers (now, or once ``setup`` has made them)."""
        self.saved = state_dict
        self.steps = int(state_dict.get("steps", 0))
        self.logits = [(int(step), float(value)) for step, value in state_dict.get("logits", [])]
        self.counted, self.loss_spikes, self.grad_norm_spikes = 0, [], []  # recounted over the restored series
        if self.loss is not None:
            self.restore()

    def series(self) -> dict[str, Tensor | None]:
        return {"loss": self.loss, "grad_norm": self.grad_norm}

    def restore(self) -> None:
        for name, buffer in self.series().items():
            earlier = torch.as_tensor(self.saved.get(name, []), dtype=torch.float32)[: self.max_steps]
            buffer[: len(earlier)] = earlier.to(buffer.device)
        self.saved = None
