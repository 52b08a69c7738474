"""The GPU plan, lease by lease: what each lent machine runs, as one command that fits the lease.

Why leases: a GPU is lent for fifteen minutes in all, its start (one to three minutes) included; one command may run
ten minutes, and eight files come back. So a lease is one command whose parts run in turn, each with a budget of its
own: a part that overruns is stopped at its budget, keeping what it wrote, and the next part still runs. The budgets
of a lease, with the first step and what the summary keeps back, stay within ``COMMANDS_S``: the lease less the
slowest start seen and less the time to return the files before the machine goes back.

The leases run in order, each building on the last:

1. where a learnable bias's attention step goes (the fused kernel's values checked first, then each piece timed
   against SDPA flash), and the whole-model train step of every scheme: the figures the speed targets are read from;
2. the proof: every config trains in bf16, compiled, and evaluates (its last full run predates the table kernels);
3. stick-breaking's fused kernels (``attention=triton``) beside its blocked form and SDPA flash at L 2k to 16k: the
   scheme the comparison crowns, whether ``auto`` may choose them (``MEASURED_FASTER``);
4. the attention table at L 8,192, every scheme and backend;
5. onwards: a paper-scale row beside the ALiBi paper's Table 2, one scheme a lease (``REPRO_SCHEMES``).

``python -m posenc.gpusession --lease N --dry-run`` prints a lease with its budgets; ``--rehearse`` runs it on CPU.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from posenc.gpu import plan
from posenc.gpu.runner import RESERVE_S, Step

LEASE_S = 900.0  # a lent GPU in all, its start included
MACHINE_START_S = 180.0  # the slowest start seen (one to three minutes)
RETURN_S = 120.0  # the files read back, and the idle wait before the machine goes back
COMMANDS_S = LEASE_S - MACHINE_START_S - RETURN_S  # what one lease's command may take: 600 s
REPRO_SCHEMES = ("alibi", "rope", "t5", "kerple_log")  # the paper-scale rows, one a lease from lease 5


@dataclass(frozen=True)
class Part:
    """One part of a lease: a stage of ``plan`` (with its part, length or scheme) and the seconds it may take."""

    stage: str
    budget_s: float
    part: str = "attention"
    length: int = 8192
    scheme: str = "alibi"


LEASES: dict[int, tuple[Part, ...]] = {
    1: (Part("speed", 360.0, part="bias"), Part("speed", 200.0, part="train-step")),
    2: (Part("proof", 570.0),),
    3: (Part("speed", 300.0, part="kernels"),),
    4: (Part("speed", 570.0, length=8192),),
    **{5 + index: (Part("repro", 570.0, scheme=scheme),) for index, scheme in enumerate(REPRO_SCHEMES)},
}


def deadline_s(lease: int) -> float:
    """The command's deadline: the first step, every part's budget, and what the summary keeps back."""
    return plan.VERSIONS_S + sum(part.budget_s for part in parts(lease)) + RESERVE_S


def parts(lease: int) -> tuple[Part, ...]:
    """The parts of ``lease``, or a ValueError naming the leases there are."""
    if lease not in LEASES:
        raise ValueError(f"there is no lease {lease}: choose one of {', '.join(map(str, LEASES))}")
    return LEASES[lease]


def build(lease: int, work: Path, rehearse: bool = False) -> list[Step]:
    """The steps of ``lease``: the first step once, then each part's steps, each held to the part's budget."""
    steps: list[Step] = []
    for index, part in enumerate(parts(lease)):
        options = plan.Options(
            stage=part.stage,
            work=work,
            deadline_s=plan.VERSIONS_S + part.budget_s + RESERVE_S,  # what a part alone would get: repro sizes by it
            length=part.length,
            part=part.part,
            scheme=part.scheme,
            rehearse=rehearse,
        )
        part_steps = plan.build(options)
        if index:
            part_steps = part_steps[1:]  # the versions step, once a command
        for step in part_steps:
            if step.name == "commands-parse":
                step = dataclasses.replace(step, name=f"commands-parse-{index + 1}")
            steps.append(dataclasses.replace(step, budget_s=None if step.name == "versions" else part.budget_s))
    return steps


def _name(part: Part) -> str:
    what = {"speed": f" {part.part}", "repro": f" {part.scheme}"}.get(part.stage, "")
    return f"{part.stage}{what}" + (f" at {part.length}" if part.stage == "speed" and part.part == "attention" else "")


def lines(lease: int) -> list[str]:
    """What ``--dry-run`` prints above the steps: the lease's parts and how its time adds up."""
    deadline = deadline_s(lease)
    fits = "fits" if deadline <= COMMANDS_S else "does NOT fit"
    described = ", ".join(f"{_name(part)} ({part.budget_s:.0f} s)" for part in parts(lease))
    return [
        f"lease {lease}: {described}",
        f"command deadline {deadline:.0f} s of the {COMMANDS_S:.0f} s a lease leaves to commands "
        f"({LEASE_S:.0f} s less a start of up to {MACHINE_START_S:.0f} s and {RETURN_S:.0f} s to return): {fits}",
    ]
