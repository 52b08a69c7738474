"""The training loop's own callbacks: token accounting, and saving at the step where a run stops, early or not.

Token accounting also records the conditions a throughput was measured under. Apart from the loop
(``posenc/training/loop.py``) because each is a piece of state with its own tests: a resumed run's windows, tokens/s
without validation, a SIGTERM or a scheduler's warning answered at a step boundary.
"""

from __future__ import annotations

import os
import signal
import statistics
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException

from posenc.runs import global_batch


class TokenAccounting(Callback):
    """Sizes the training stream for the world Lightning resolved; logs tokens seen and tokens/s over all ranks.

    ``data.batch_size`` is per device, so one optimizer step consumes ``batch_size × accumulate × world_size``
    windows: the global batch. The world size is only known once Lightning has parsed ``devices`` (``auto``,
    lists) and ``num_nodes``, hence ``setup``. Training windows are numbered ``(seed, start_sample + index)``; a
    run resumed at step s starts after the s global batches it already trained on, so it sees fresh windows.
    Tokens/s is global (steps are in lockstep across ranks) and leaves out validation time; so does
    ``loop_seconds``, the training loop's whole time (steps and data loading, validation and the end-of-training
    evaluation left out), which ``run.json`` records with the throughput it implies, for comparing schemes' cost.
    """

    def __init__(self, max_steps: int, resume_step: int) -> None:
        self.max_steps, self.resume_step = max_steps, resume_step
        self.accounting: dict[str, int] = {}
        self.last_step, self.last_time, self.paused_at = 0, 0.0, None
        self.loop_seconds, self.loop_mark, self.loop_steps = 0.0, None, 0
        self.loads: list[float] = []  # the machine's 1-minute load average at each logged step
        self.earlier: dict[str, float] | None = {"train_seconds": 0.0, "train_loop_seconds": 0.0}
        self.fit_started: float | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        data = trainer.datamodule
        self.accounting = global_batch(data.batch_size, trainer, data.seq_len)
        # The whole run's windows, so that the epoch (all of it) ends at max_steps after a resume too.
        data.num_samples = self.max_steps * self.accounting["global_batch_size"]
        data.start_sample = self.resume_step * self.accounting["global_batch_size"]

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.fit_started = time.perf_counter()
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_hyperparams(self.accounting)
            print(
                f"{trainer.world_size} process(es) × batch {trainer.datamodule.batch_size} × accumulation "
                f"{trainer.accumulate_grad_batches} = global batch {self.accounting['global_batch_size']} "
                f"({self.accounting['tokens_per_step']} tokens per step)"
                + (f"; resuming at step {self.resume_step}" if self.resume_step else "")
            )

    def state_dict(self) -> dict[str, float]:
        """Saved in every checkpoint: the tokens it was trained on (for evaluating it later) and the seconds spent."""
        since = time.perf_counter() - self.fit_started if self.fit_started is not None else 0.0
        return {**self.accounting, **(self.spent(since, self.loop_seconds) or {})}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A resumed run: the seconds its earlier processes spent on the steps the checkpoint holds."""
        if "train_seconds" in state_dict:
            self.earlier = {key: float(state_dict.get(key) or 0.0) for key in ("train_seconds", "train_loop_seconds")}
        else:
            self.earlier = None

    def spent(self, seconds: float, loop_seconds: float) -> dict[str, float] | None:
        """Seconds of this process added to the earlier processes'; ``None`` where those were not recorded."""
        if self.earlier is None:
            return None
        return {
            "train_seconds": self.earlier["train_seconds"] + seconds,
            "train_loop_seconds": self.earlier["train_loop_seconds"] + loop_seconds,
        }

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.last_step, self.last_time = trainer.global_step, time.perf_counter()
        self.loop_mark, self.loop_steps = self.last_time, trainer.global_step

    def tokens_per_sec(self, steps: int) -> float | None:
        """Tokens trained in this process's loop over its seconds; ``None`` where this process did not train."""
        trained = steps - self.loop_steps
        if self.loop_mark is None or trained <= 0 or self.loop_seconds <= 0:
            return None
        return trained * self.accounting["tokens_per_step"] / self.loop_seconds

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.loop_mark is not None:
            now = time.perf_counter()
            self.loop_seconds += now - self.loop_mark
            self.loop_mark = now
        step = trainer.global_step
        if step == self.last_step or step % trainer.log_every_n_steps:  # Lightning logs at these steps
            return
        now = time.perf_counter()
        tokens_per_step = self.accounting["tokens_per_step"]
        rate = (step - self.last_step) * tokens_per_step / max(now - self.last_time, 1e-9)
        # Through Lightning's logging, so these share the x-axis of train/loss; rank zero's values are logged.
        pl_module.log_dict({"train/tokens": float(step * tokens_per_step), "train/tokens_per_sec": rate})
        self.last_step, self.last_time = step, now
        if hasattr(os, "getloadavg"):
            self.loads.append(os.getloadavg()[0])

    def conditions(self, device: torch.device) -> dict[str, Any]:
        """What the throughput was measured under: a run's tokens/s compares with another's only when these match.

        ``load_per_core`` is the median 1-minute load average over the logged steps, per core: near the run's own
        threads over the cores when it had the machine to itself, higher when something else ran beside it.
        """
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu × {os.cpu_count()}"
        load = statistics.median(self.loads) / (os.cpu_count() or 1) if self.loads else None
        return {
            "device": name,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "load_per_core": load,
            "load_samples": len(self.loads),
        }

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.paused_at = time.perf_counter()
        if self.loop_mark is not None:
            self.loop_seconds += self.paused_at - self.loop_mark

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.paused_at is not None:
            now = time.perf_counter()
            self.last_time += now - self.paused_at
            if self.loop_mark is not None:
                self.loop_mark = now
            self.paused_at = None


class SaveFinal(Callback):
    """Save ``last.ckpt`` at the end of training when the periodic checkpoints did not land on the last step.

    Why: Lightning's ``every_n_train_steps`` saves at multiples of n, and its end-of-training save is skipped once
    any checkpoint was written, so a run of 4,500 steps at n = 200 kept step 4,400's weights: a re-evaluation (an
    inference-time option, another protocol) or a fine-tune from the run would read weights its own end-of-training
    evaluation never scored, and the run would count as unfinished.
    """

    def __init__(self, checkpoint: Path) -> None:
        self.checkpoint = checkpoint
        self.saved_step: int | None = None  # the step of the latest checkpoint written, by any callback

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self.saved_step = trainer.global_step

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning's own end-of-training save covers a run that wrote no checkpoint before; two would be one too many.
        if self.saved_step is not None and self.saved_step != trainer.global_step:
            trainer.save_checkpoint(self.checkpoint)


class SaveOnInterrupt(Callback):
    """Save ``last.ckpt`` at the step where a run is stopped early, so that it resumes exactly there.

    - Ctrl-C: save, and print the command that resumes the run.
    - SIGTERM (``scancel``, ``scontrol requeue``, a preemption, a time limit reached): Lightning notes it and stops
      every rank at the next step boundary with ``SIGTERMException``; save there. ``fit`` then ends the run with
      one line saying how to resume (SLURM restarts a requeued job by itself, and it resumes from that step).
    - The scheduler's warning before a time limit (``requeue_signal``: SLURM sends it ``signal_delay_s`` before the
      limit, and submitit's handler answers it by requeueing the job). While training, the signal is only noted:
      at the end of the step every rank learns of it (one all-reduce), all save, the step's figures are logged,
      and at the start of the next step the signal goes on to submitit's handler, which requeues the job (counted
      against ``max_num_timeout``) and exits. Answered at once, as submitit or Lightning's own auto-requeue would,
      the signal can land inside an optimizer step, and the checkpoint would hold half-updated weights.
    """

    def __init__(self, checkpoint: Path, resume_command: str, requeue_signal: int = signal.SIGUSR2) -> None:
        self.checkpoint, self.resume_command, self.requeue_signal = checkpoint, resume_command, requeue_signal
        self.handover: Any = None  # the requeue signal's handler before training (submitit's), while we hold it
        self.noted = False  # the requeue signal arrived during this step
        self.saved_at: int | None = None  # the step saved for the requeue, handed over at the next step's start

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        handler = signal.getsignal(self.requeue_signal)
        # Only where a job scheduler's handler waits for the signal (submitit's, in a SLURM job), and only from the
        # main thread, the one Python runs signal handlers in.
        if callable(handler) and threading.current_thread() is threading.main_thread():
            self.handover = handler
            signal.signal(self.requeue_signal, self._note)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.noted = True

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stepped = (batch_idx + 1) % trainer.accumulate_grad_batches == 0  # mid-accumulation is no step boundary
        if self.handover is None or self.saved_at is not None or not stepped:
            return
        # Every rank stops at the same step, even if the signal reached them during different steps.
        if trainer.strategy.reduce_boolean_decision(self.noted, all=False):
            trainer.save_checkpoint(self.checkpoint)
            self.saved_at = trainer.global_step
            if trainer.is_global_zero:
                print(f"SLURM's time-limit signal: saved {self.checkpoint} at step {self.saved_at}; requeueing")

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.saved_at is not None:
            self._hand_over()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.handover is None:
            return
        if self.noted and self.saved_at is None:  # the signal came during the last step: save before the evaluation
            trainer.save_checkpoint(self.checkpoint)
            self.saved_at = trainer.global_step
        if self.saved_at is not None:
            self._hand_over()
        signal.signal(self.requeue_signal, self.handover)
        self.handover = None

    def _hand_over(self) -> None:
        """Give the signal to submitit's handler: on rank zero it requeues the job and exits; elsewhere it returns."""
        handler, self.handover = self.handover, None
        signal.signal(self.requeue_signal, handler)
        handler(self.requeue_signal, None)
        raise SystemExit(-1)  # the other ranks: the requeued job starts them again

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self.handover is not None:
            signal.signal(self.requeue_signal, self.handover)
            self.handover = None
        if isinstance(exception, KeyboardInterrupt | SIGTERMException):
            trainer.save_checkpoint(self.checkpoint)
        if isinstance(exception, KeyboardInterrupt) and trainer.is_global_zero:
            print(f"interrupted at step {trainer.global_step}; saved {self.checkpoint}. Resume with:")
            print(f"  {self.resume_command}")
