"""How far a run's positional bias moved: from its start, and over the last tenth of training.

A learnable scheme (T5's table, KERPLE's r1/r2, FIRE's MLP, data-dependent ALiBi's gates) is compared as *learned*
only if it did learn: a table that an Adam run at a small learning rate barely moved is still its initialisation,
and one that was still moving at the end had not settled. What matters is what attention sees, so the marks read the
**bias function**, not the tensors: each layer's bias over a window of the training length (``bias_function``: three
query rows over every key, each row's constant removed, since softmax ignores it). A parameter that moves only such a
constant (FIRE's output bias) moves nothing attention sees, and marks nothing. Schemes without a bias (an absolute
table, stick-breaking's head vector) are read by their tensors instead.

``PositionalDrift`` (a training callback) keeps the function and the tensors at the start and at 90% of the steps,
and the learning rate spent by then; ``drift_record`` compares the final values with both. Every change is relative,
‖f_T − f_ref‖ / ‖f_ref‖, against a floor on the reference's size (a bias that starts at zero has no size of its own).

"Still moving" does not depend on how many steps a run took: it compares the speed of the last tenth with the
average speed, each per unit of learning rate spent (the sum of the rate over the steps), so a run twice as long or a
schedule that ends lower reads the same. The record lands in ``run.json`` and ``results.json``
(``positional_drift``), on the console at the end of training, and in the loggers: the change so far at every logged
step (``drift/<tensor>``, ``drift/max``), the curve a sweep over learning rates compares.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

from posenc.evaluate.bias_curve import bias_function

LATE_FRACTION = 0.1  # "late": the last tenth of the optimizer steps
# A tensor's size below which relative change is measured against this RMS per entry instead: 0.01 is the floor
# KERPLE's projection keeps r1 and r2 at and half GPT-2's initial std, so a zero-initialised tensor (ALiBi-DD's gate
# weights) that moved by a typical first Adam step reads as a change of order 1, not as infinity.
RMS_FLOOR = 0.01
STILL_MOVING = 0.5
"""Ratio of the last tenth's speed to the average speed (each per unit of learning rate) marked "still moving".

A function that has settled only wanders at the end, by steps that cancel: over the last tenth it covers far less
per unit of learning rate than it did on average (a tenth or less, measured on ALiBi-like settled biases). One still
travelling at half its average speed or more had not flattened: its final value depends on when training stopped,
and a longer budget would have given another scheme.
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
    return _change(new, reference, reference)


def _change(new: Tensor, old: Tensor, size_of: Tensor) -> float:
    """‖new − old‖ relative to ``size_of``'s size, floored (``relative_change``)."""
    scale = max(float(size_of.norm()), RMS_FLOOR * math.sqrt(size_of.numel()))
    return float((new.float() - old.float()).norm()) / scale


def bias_functions(model: nn.Module, length: int, on_device: bool = False) -> dict[str, Tensor]:
    """{layer name: ``bias_function`` over a window of ``length``} of every layer whose scheme has a learnable bias.

    In fp32 on the CPU (what snapshots keep), or ``on_device``, where the model is (no host sync while training).
    """
    out = {}
    for index, scheme in enumerate(model.layer_encodings):
        if scheme.learnable_bias and (function := bias_function(scheme, length)) is not None:
            out[f"layer{index}"] = function if on_device else function.cpu()
    return out


def _changes(final: dict[str, Tensor], initial: dict[str, Tensor], late: dict[str, Tensor] | None) -> list[dict]:
    rows = []
    for name, value in final.items():
        start = initial[name]
        rows.append(
            {
                "name": name,
                "shape": list(value.shape),
                "initial_norm": float(start.norm()),
                "floored": float(start.norm()) < RMS_FLOOR * math.sqrt(start.numel()),
                "total_change": relative_change(value, start),
                # against the start's size too, so that late and total changes are shares of one scale
                "late_change": _change(value, late[name], start) if late is not None and name in late else None,
            }
        )
    return rows


def drift_record(
    final: dict[str, Tensor],
    initial: dict[str, Tensor],
    late: dict[str, Tensor] | None,
    late_step: int | None,
    curve: list[list[float]] | None = None,
    functions: tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor] | None] | None = None,
    lr_spent: tuple[float, float | None] | None = None,
) -> dict[str, Any] | None:
    """The bias function's (and each tensor's) total and last-tenth relative change, the two marks, and the curve.

    ``None`` for a model without trainable scheme parameters (nothing to watch). ``late`` is ``None`` when training
    never reached 90% of its steps (an interrupted run): no last-tenth figure then, and no "still moving" mark.
    ``functions`` (final, initial, late): the layers' bias functions, which the marks read where there are any;
    ``lr_spent`` (in all, by the late snapshot): the learning rate summed over the steps, which makes "still moving"
    a ratio of speeds (module docstring). ``curve`` is ``[step, largest change so far]`` at every logged step.
    """
    if not final:
        return None
    tensors = _changes(final, initial, late)
    layers = _changes(*functions) if functions is not None and functions[0] else []
    marked = layers or tensors  # the marks read what attention sees where the scheme has a bias
    total = max(row["total_change"] for row in marked)
    late_changes = [row["late_change"] for row in marked if row["late_change"] is not None]
    late_max = max(late_changes) if late_changes else None
    speed = None
    if late_max is not None and lr_spent is not None and lr_spent[1] is not None and total > 0:
        spent, by_late = lr_spent
        speed = (late_max / max(spent - by_late, 1e-12)) / (total / max(spent, 1e-12))
    return {
        "tensors": tensors,
        "function": layers or None,
        "measured_on": "bias function" if layers else "tensors",
        "late_from_step": late_step if late is not None else None,
        "max_total_change": total,
        "max_late_change": late_max,
        "late_speed_ratio": speed,
        "still_moving": speed is not None and speed > STILL_MOVING,
        "barely_moved": total < BARELY_MOVED,
        "thresholds": {"still_moving": STILL_MOVING, "barely_moved": BARELY_MOVED, "rms_floor": RMS_FLOOR},
        "curve": [[int(step), float(value)] for step, value in curve or []],
    }


def from_checkpoint(callbacks_state: dict[str, Any], model: nn.Module) -> dict[str, Any] | None:
    """The record of a saved run: ``model``'s weights against the snapshots its checkpoint kept (``None``: none)."""
    state = callbacks_state.get(PositionalDrift.__qualname__) or {}
    if not state.get("initial"):
        return None
    functions, spent = None, None
    if state.get("length") and state.get("initial_functions"):
        final = bias_functions(model, state["length"])
        functions = (final, state["initial_functions"], state.get("late_functions"))
        spent = (state.get("lr_spent", 0.0), state.get("lr_spent_late"))
    return drift_record(
        scheme_tensors(model),
        state["initial"],
        state.get("late"),
        state.get("late_step"),
        state.get("curve"),
        functions,
        spent,
    )


def console_lines(record: dict[str, Any] | None, label: str) -> list[str]:
    """The table printed at the end of training: each layer's bias function and tensor's change, and the marks."""
    if record is None:
        return []
    since = record["late_from_step"]
    out = [
        f"\nPositional parameters of {label}: relative change since the start, and since step {since} (90%)"
        if since is not None
        else f"\nPositional parameters of {label}: relative change since the start (90% of the steps not reached)",
        f"  {'bias function (row-centred) or tensor':<28} {'shape':>10} {'total':>8} {'last 10%':>9}",
    ]
    for row in [*({**r, "name": f"{r['name']} bias"} for r in record.get("function") or []), *record["tensors"]]:
        late = "" if row["late_change"] is None else f"{row['late_change']:.4f}"
        shape = "×".join(map(str, row["shape"])) or "scalar"
        floored = " (size floored)" if row["floored"] else ""
        out.append(f"  {row['name']:<28} {shape:>10} {row['total_change']:>8.4f} {late:>9}{floored}")
    speed = record.get("late_speed_ratio")
    marks = [
        f"still moving (the last 10% at {speed:.2f} of the average speed per unit of learning rate, > {STILL_MOVING:g})"
        if record["still_moving"]
        else "",
        f"barely moved (total < {BARELY_MOVED:g})" if record["barely_moved"] else "",
    ]
    measured = record.get("measured_on", "tensors")
    out.append(
        f"  marks from the {measured}: " + ("; ".join(m for m in marks if m) or "settled: moved, and no longer moving")
    )
    return out


class PositionalDrift(Callback):
    """Snapshots of the scheme parameters at the start and at 90% of ``max_steps``; the change logged as it goes.

    The snapshots are saved in every checkpoint, so a resumed run still compares with its true start and a later
    ``posenc.evaluate`` can rebuild the record. Each logged step gets ``drift/<tensor>`` (the relative change
    since the start) and ``drift/max``: with W&B or the CSV logger the drift curve needs no script.
    """

    def __init__(self, max_steps: int, length: int) -> None:
        self.late_step = math.floor(max_steps * (1 - LATE_FRACTION))
        self.length = length  # the window the bias functions are read over: the training length
        self.initial: dict[str, Tensor] = {}
        self.late: dict[str, Tensor] | None = None
        self.initial_functions: dict[str, Tensor] = {}
        self.late_functions: dict[str, Tensor] | None = None
        self.lr_spent, self.lr_spent_late = 0.0, None  # the model's learning rate summed over the steps
        self.logged_step = -1
        self.curve: list[tuple[int, Tensor | float]] = []  # (step, drift/max): read off the device only at the end

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.initial:
            self.initial = scheme_tensors(pl_module.model)
            self.initial_functions = bias_functions(pl_module.model, self.length)
        self._snapshot_late(trainer.global_step, pl_module)

    def _snapshot_late(self, step: int, pl_module: L.LightningModule) -> None:
        if self.late is None and step >= self.late_step and self.initial:
            self.late = scheme_tensors(pl_module.model)
            self.late_functions = bias_functions(pl_module.model, self.length)
            self.lr_spent_late = self.lr_spent

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step != self.logged_step and trainer.optimizers:  # the rate this step ran at (the model's group)
            self.lr_spent += float(trainer.optimizers[0].param_groups[0]["lr"])
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
            for name, function in bias_functions(pl_module.model, self.length, on_device=True).items():
                start = self.initial_functions[name]
                scale = max(float(start.norm()), RMS_FLOOR * math.sqrt(start.numel()))
                changes[f"drift/{name}.bias"] = (function - start.to(function.device)).norm() / scale
        if changes:
            # The curve follows what the marks read: the bias functions where there are any.
            watched = [v for k, v in changes.items() if k.endswith(".bias")] or list(changes.values())
            changes["drift/max"] = torch.stack(watched).max()
            self.curve.append((step, changes["drift/max"]))
            pl_module.log_dict(changes)

    def record(self, model: nn.Module) -> dict[str, Any] | None:
        """The run's ``positional_drift`` record for the current weights of ``model``."""
        if not self.initial:
            return None
        functions = (bias_functions(model, self.length), self.initial_functions, self.late_functions)
        return drift_record(
            scheme_tensors(model),
            self.initial,
            self.late,
            self.late_step,
            self._curve(),
            functions,
            (self.lr_spent, self.lr_spent_late),
        )

    def _curve(self) -> list[list[float]]:
        return [[step, float(value)] for step, value in self.curve]

    def state_dict(self) -> dict[str, Any]:
        late = None if self.late is None else dict(self.late)
        late_functions = None if self.late_functions is None else dict(self.late_functions)
        return {
            "initial": dict(self.initial),
            "late": late,
            "late_step": self.late_step,
            "curve": self._curve(),
            "length": self.length,
            "initial_functions": dict(self.initial_functions),
            "late_functions": late_functions,
            "lr_spent": self.lr_spent,
            "lr_spent_late": self.lr_spent_late,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.initial = dict(state_dict.get("initial") or {})
        self.late = state_dict.get("late")
        self.curve = [(int(step), float(value)) for step, value in state_dict.get("curve") or []]
        self.initial_functions = dict(state_dict.get("initial_functions") or {})
        self.late_functions = state_dict.get("late_functions")
        self.lr_spent = float(state_dict.get("lr_spent") or 0.0)
        self.lr_spent_late = state_dict.get("lr_spent_late")
