"""Where a train step's time goes: ``torch.profiler`` over a few more calls of a step already compiled and timed.

Why: a ratio says that a scheme's step is slow, not why. For the schemes named in ``train_step.profile_schemes``
the benchmark records the step it has just timed a few more times under the profiler, so the table of operators
and kernels by their own time comes from the very graphs that were timed, with no second compilation. On CUDA it
also says how busy the device was: a step whose kernels add up to far less than its wall time waits on the host
(launches, Python, a graph break), one whose kernels fill it is bound by those kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

NAME_WIDTH = 90  # kernel names run to hundreds of characters; the full ones are in profile_<scheme>.txt


def profile_step(step: Callable[[], None], device: torch.device, steps: int, rows: int) -> dict[str, Any]:
    """Profile ``steps`` calls of ``step``: the ``rows`` heaviest operators or kernels by their own time, per step.

    On CUDA the rows are the device's kernels (and copies) by device time, whose sum is the time the device was
    busy; on CPU they are the operators by their own CPU time. ``text`` is the profiler's full table.
    """
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
    averages = prof.key_averages()
    if cuda:
        events = [e for e in averages if e.device_type == DeviceType.CUDA]
        own = "self_device_time_total"
    else:
        events = list(averages)
        own = "self_cpu_time_total"
    busy_us = sum(getattr(e, own) for e in events)
    top = sorted(events, key=lambda e: getattr(e, own), reverse=True)[:rows]
    return {
        "steps": steps,
        "clock": "device" if cuda else "cpu",
        "busy_ms_per_step": busy_us / 1e3 / steps,
        "launches_per_step": sum(e.count for e in events) / steps if cuda else None,
        "top": [
            {
                "name": e.key,
                "calls_per_step": e.count / steps,
                "ms_per_step": getattr(e, own) / 1e3 / steps,
                "share": getattr(e, own) / busy_us if busy_us else 0.0,
            }
            for e in top
        ],
        "text": averages.table(sort_by=own, row_limit=max(rows, 40), max_name_column_width=160),
    }


def profile_markdown(row: dict[str, Any]) -> list[str]:
    """One scheme's profile as a markdown section (the bench's ``bench.md``)."""
    prof = row["profile"]
    busy = prof["busy_ms_per_step"]
    lines = ["", f"#### Profile of the train step: {row['scheme']} ({prof['steps']} steps, {prof['clock']} time)", ""]
    if prof["clock"] == "device":
        wall = row.get("step_ms")
        share = f" of the step's {wall:.1f} ms wall time ({busy / wall:.0%})" if wall else ""
        lines += [
            f"The device was busy {busy:.1f} ms a step{share}, over {prof['launches_per_step']:.0f} kernel "
            "launches a step.",
            "",
        ]
    else:
        lines += [f"Operators' own CPU time: {busy:.1f} ms a step.", ""]
    lines += ["| operator or kernel | calls a step | ms a step | share |", "|---|---:|---:|---:|"]
    for entry in prof["top"]:
        name = entry["name"].replace("|", "/")
        name = name if len(name) <= NAME_WIDTH else name[: NAME_WIDTH - 1] + "…"
        lines.append(f"| `{name}` | {entry['calls_per_step']:g} | {entry['ms_per_step']:.3f} | {entry['share']:.1%} |")
    return lines
