"""How far a run's positional parameters moved: from their initial values, and over the last tenth of training.

A learnable scheme (T5's table, KERPLE's r1/r2, FIRE's MLP, data-dependent ALiBi's gates) is compared as *learned*
only if its parameters did learn: a table that an Adam run at a small learning rate barely moved is still its
initialisation, and one that was still moving at the end had not settled. ``PositionalDrift`` (a training callback)
keeps each scheme tensor's value at the start and at 90% of the steps; ``drift_record`` compares the final value
with both. Every change is relative, ‖θ_T − θ_ref‖ / ‖θ_ref‖, against a floor on the reference's size (a tensor
initialised at zero has no size of its own to be relative to). The record lands in ``run.json`` and
``results.json`` (``positional_drift``), on the console at the end of training, and in the loggers: the change so
far at every logged step (``drift/<tensor>``, ``drift/max``), the curve a sweep over learning rates compares.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

LATE_FRACTION = 0.1  # "late": the last tenth of the optimizer steps
# A tensor's size below which relative change is measured against this RMS per entry instead: 0.01 is the floor
# KERPLE's projection keeps r1 and r2 at and half GPT-2's initial std, so a zero-initialised tensor (ALiBi-DD's gate
# weights) that moved by a typical first Adam step reads as a change of order 1, not as infinity.
RMS_FLOOR = 0.01
STILL_MOVING = 0.05
"""Last-tenth change above which a scheme's parameters are marked "still moving".

The last tenth of a warmup-cosine schedule runs at its smallest learning rates (10–20% of the peak with
``min_lr_ratio=0.1``); parameters that have settled wander there by a few Adam steps of that size. A change of 5%
of the tensor's size over those steps means its final value depends on when training stopped: its curve had not
flattened, and a longer budget would have given another scheme.
"""
BARELY_MOVED = 0.10
"""Total change below which a scheme's parameters are marked "barely moved".

Within 10% of its initialisation the scheme is compared as initialised (a random T5 table, KERPLE's uniform draw),
not as learned: a result for it says little about what the scheme can learn.
"""


def short_name(name: str) -> str:
    """``blocks.0.attn.encoding.table`` → ``layer0.table``: the name in records, the console and logged keys."""
    parts = name.split(".")
    if len(parts) > 3 and parts[0] == "blocks" and parts[2:4] == ["attn", "encoding"]:
        return ".".join([f"layer{parts[1]}", *parts[4:]])
    return name


def scheme_tensors(model: nn.Module) -> dict[str, Tensor]:
    """{short name: detached fp32 CPU copy} of every trainable scheme parameter of ``model`` (a ``Decoder``)."""
    return {short_name(name): p.detach().float().cpu().clone() for name, p in model.scheme_parameters().items()}


def relative_change(new: Tensor, reference: Tensor) -> float:
    """‖new − reference‖ / max(‖reference‖, RMS_FLOOR · √numel)."""
    scale = max(float(reference.norm()), RMS_FLOOR * math.sqrt(reference.numel()))
    return float((new.float() - reference.float()).norm()) / scale


def drift_record(
    final: dict[str, Tensor],
    initial: dict[str, Tensor],
    late: dict[str, Tensor] | None,
    late_step: int | None,
    curve: list[list[float]] | None = None,
) -> dict[str, Any] | None:
    """Each tensor's total and last-tenth relative change, the largest of each, the two marks, and the curve.

    ``None`` for a model without trainable scheme parameters (nothing to watch). ``late`` is ``None`` when training
    never reached 90% of its steps (an interrupted run): no last-tenth figure then, and no "still moving" mark.
    ``curve`` is ``[step, largest change so far]`` at every logged step: whether the change flattened, which two
    snapshots cannot say, is what a sweep over learning rates compares.
    """
    if not final:
        return None
    tensors = []
    for name, value in final.items():
        start = initial[name]
        row = {
            "name": name,
            "shape": list(value.shape),
            "initial_norm": float(start.norm()),
            "floored": float(start.norm()) < RMS_FLOOR * math.sqrt(start.numel()),
            "total_change": relative_change(value, start),
            "late_change": relative_change(value, late[name]) if late is not None else None,
        }
        tensors.append(row)
    total = max(row["total_change"] for row in tensors)
    late_changes = [row["late_change"] for row in tensors if row["late_change"] is not None]
    late_max = max(late_changes) if late_changes else None
    return {
        "tensors": tensors,
        "late_from_step": late_step if late is not None else None,
        "max_total_change": total,
        "max_late_change": late_max,
        "still_moving": late_max is not None and late_max > STILL_MOVING,
        "barely_moved": total < BARELY_MOVED,
        "thresholds": {"still_moving": STILL_MOVING, "barely_moved": BARELY_MOVED, "rms_floor": RMS_FLOOR},
        "curve": [[int(step), float(value)] for step, value in curve or []],
    }


def from_checkpoint(callbacks_state: dict[str, Any], model: nn.Module) -> dict[str, Any] | None:
    """The record of a saved run: ``model``'s weights against the snapshots its checkpoint kept (``None``: none)."""
    state = callbacks_state.get(PositionalDrift.__qualname__) or {}
    if not state.get("initial"):
        return None
    return drift_record(
        scheme_tensors(model), state["initial"], state.get("late"), state.get("late_step"), state.get("curve")
    )


def console_lines(record: dict[str, Any] | None, label: str) -> list[str]:
    """The table printed at the end of training: each tensor's total and last-tenth change, and the marks."""
    if record is None:
        return []
    since = record["late_from_step"]
    out = [
        f"\nPositional parameters of {label}: relative change since the start, and since step {since} (90%)"
        if since is not None
        else f"\nPositional parameters of {label}: relative change since the start (90% of the steps not reached)",
        f"  {'tensor':<28} {'shape':>10} {'total':>8} {'last 10%':>9}",
    ]
    for row in record["tensors"]:
        late = "" if row["late_change"] is None else f"{row['late_change']:.4f}"
        shape = "×".join(map(str, row["shape"])) or "scalar"
        floored = " (size floored)" if row["floored"] else ""
        out.append(f"  {row['name']:<28} {shape:>10} {row['total_change']:>8.4f} {late:>9}{floored}")
    marks = [
        f"still moving (last 10% > {STILL_MOVING:g})" if record["still_moving"] else "",
        f"barely moved (total < {BARELY_MOVED:g})" if record["barely_moved"] else "",
    ]
    out.append("  " + ("; ".join(m for m in marks if m) or "settled: moved, and no longer moving"))
    return out


class PositionalDrift(Callback):
    """Snapshots of the scheme parameters at the start and at 90% of ``max_steps``; the change logged as it goes.

    The snapshots are saved in every checkpoint, so a resumed run still compares with its true start and a later
    ``posenc.evaluate`` can rebuild the record. Each logged step gets ``drift/<tensor>`` (the relative change
    since the start) and ``drift/max``: with W&B or the CSV logger the drift curve needs no script.
    """

    def __init__(self, max_steps: int) -> None:
        self.late_step = math.floor(max_steps * (1 - LATE_FRACTION))
        self.initial: dict[str, Tensor] = {}
        self.late: dict[str, Tensor] | None = None
        self.logged_step = -1
        self.curve: list[tuple[int, Tensor | float]] = []  # (step, drift/max): read off the device only at the end

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.initial:
            self.initial = scheme_tensors(pl_module.model)
        self._snapshot_late(trainer.global_step, pl_module)

    def _snapshot_late(self, step: int, pl_module: L.LightningModule) -> None:
        if self.late is None and step >= self.late_step and self.initial:
            self.late = scheme_tensors(pl_module.model)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        self._snapshot_late(step, pl_module)
        if not self.initial or step % trainer.log_every_n_steps or step == self.logged_step:
            return
        self.logged_step = step  # with gradient accumulation several batches end at one step
        changes = {}
        with torch.no_grad():  # on the parameters' device: no host sync, Lightning reads them when it logs
            for name, p in pl_module.model.scheme_parameters().items():
                start = self.initial[short_name(name)]
                scale = max(float(start.norm()), RMS_FLOOR * math.sqrt(start.numel()))
                changes[f"drift/{short_name(name)}"] = (p.float() - start.to(p.device)).norm() / scale
        if changes:
            changes["drift/max"] = torch.stack(list(changes.values())).max()
            self.curve.append((step, changes["drift/max"]))
            pl_module.log_dict(changes)

    def record(self, model: nn.Module) -> dict[str, Any] | None:
        """The run's ``positional_drift`` record for the current weights of ``model``."""
        if not self.initial:
            return None
        return drift_record(scheme_tensors(model), self.initial, self.late, self.late_step, self._curve())

    def _curve(self) -> list[list[float]]:
        return [[step, float(value)] for step, value in self.curve]

    def state_dict(self) -> dict[str, Any]:
        late = None if self.late is None else dict(self.late)
        return {"initial": dict(self.initial), "late": late, "late_step": self.late_step, "curve": self._curve()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.initial = dict(state_dict.get("initial") or {})
        self.late = state_dict.get("late")
        self.curve = [(int(step), float(value)) for step, value in state_dict.get("curve") or []]
