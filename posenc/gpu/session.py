"""``python -m posenc.gpusession``: one stage of a GPU session (proof, speed or repro) as one bounded command.

Why: time on a lent GPU is short (a command may run ten minutes, the machine a quarter of an hour with its start),
starts cold, and returns only a few files. So one command runs one stage (``posenc/gpu/plan.py`` says what each
holds and how long it is planned to take), ends by its ``--deadline`` with its summary written, stops a step that
overruns with its whole process group, leaves no process behind when it is killed itself, and returns at most eight
files (``posenc/gpu/pack.py``). ``--rehearse`` runs the same plan on CPU with tiny settings, as the GPU machine's
packages would run it (no wandb, no submitit), which is how the test suite proves all of this without a GPU.

A machine without a package registry may lack packages the project needs (Hydra, OmegaConf, pydantic): wheels in
``--wheels`` (default ``.whl``) are installed into the work folder first and put on every step's ``PYTHONPATH``.
Inductor's and Triton's caches live in the work folder too, so a second command on a still-warm machine reuses what the
first compiled.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from posenc.gpu import leases, pack, plan
from posenc.gpu.runner import RESERVE_S, ROOT, Runner, SessionStoppedError, Step

# Packages the GPU machine lacks that the project can import: a rehearsal makes them fail to import, as they would.
MISSING_ON_GPU_IMAGE = ("wandb", "submitit")
# Packages every command needs that a GPU image may lack, brought as wheels in .whl/.
NEEDED_FROM_WHEELS = ("hydra", "pydantic")


def install_wheels(wheels: Path, work: Path) -> Path | None:
    """Install the wheels in ``wheels`` into ``work/site`` when Hydra or pydantic is missing; the folder for the path.

    Both are what every posenc command imports that a GPU image may lack (pydantic checks the config's values).
    """
    missing = [name for name in NEEDED_FROM_WHEELS if importlib.util.find_spec(name) is None]
    if not missing or not wheels.is_dir() or not any(wheels.glob("*.whl")):
        return None
    site = work / "site"
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
        "--upgrade",
        "--target",
        str(site),
        *map(str, sorted(wheels.glob("*.whl"))),
    ]
    subprocess.run(command, check=True)
    sys.path.insert(0, str(site))
    return site


def step_env(site: Path | None, work: Path) -> dict[str, str]:
    """Every step's environment: unbuffered output, no W&B, the wheels and the project on the path, caches in work."""
    paths = [str(site)] if site else []
    paths += [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)),
        "PYTHONUNBUFFERED": "1",
        "WANDB_MODE": "disabled",
        "TORCHINDUCTOR_CACHE_DIR": str(work / "cache" / "inductor"),
        "TRITON_CACHE_DIR": str(work / "cache" / "triton"),
    }


def gpu_image(work: Path) -> Path:
    """A folder that, first on ``PYTHONPATH``, makes the packages the GPU machine lacks fail to import there."""
    folder = work / "gpu-image"
    for name in MISSING_ON_GPU_IMAGE:
        package = folder / name
        package.mkdir(parents=True, exist_ok=True)
        message = f"No module named {name!r} (posenc.gpusession --rehearse: the GPU machine does not have it)"
        (package / "__init__.py").write_text(f"raise ModuleNotFoundError({message!r}, name={name!r})\n")
    return folder


def plan_lines(steps: list[Step], deadline_s: float) -> list[str]:
    """The plan as printed by ``--dry-run`` and at the start of a session: each step, the graphs, the fit."""
    lines = []
    for step in steps:
        how = "overlaps the next" if step.overlap else "alone" if step.exclusive else ""
        budget = f"  budget {step.budget_s:.0f} s" if step.budget_s is not None else ""
        lines.append(f"{step.stage:6} {step.name:22} {step.planned_s:5.0f} s {step.graphs:4d} graphs  {how}{budget}")
        lines.append(f"       {shlex.join(step.argv)}")
    total, graphs = planned_s(steps), sum(step.graphs for step in steps)
    fits = "fits" if total <= deadline_s - RESERVE_S else "does NOT fit: expect steps to time out"
    lines.append(
        f"{len(steps)} steps, {graphs} compiled graphs, planned {total:.0f} s; deadline {deadline_s:.0f} s: {fits}"
    )
    return lines


def planned_s(steps: list[Step]) -> float:
    """Planned seconds in all: an overlapping step runs beside the steps after it and adds only what exceeds them."""
    total, beside = 0.0, 0.0
    for step in steps:
        if step.overlap:
            beside = max(beside, step.planned_s)
            continue
        total += max(step.planned_s, beside)
        beside = 0.0
    return total + beside


def extra_lines(steps: list[Step], work: Path) -> list[str]:
    """What is worth reading in ``summary.md`` itself: the proof's table, the bias decomposition, a paper-scale row."""
    lines = []
    table = work / "gpucheck" / "table.md"
    if table.exists():
        lines += ["## Every config trained and evaluated (posenc.gpucheck)", "", table.read_text().strip()]
    bias = work / "bias" / "bias.md"
    if bias.exists():
        lines += ["## The bias decomposition (posenc.bench, bias.run=true)", "", bias.read_text().strip()]
    for results in sorted((work / "repro").glob("*/eval/results.json")):
        rows = json.loads(results.read_text()).get("perplexity", [])
        lines += [
            f"## {results.parent.parent.name}: perplexity by evaluation length",
            "",
            "| length | ppl |",
            "|---:|---:|",
        ]
        lines += [f"| {row['length']} | {_ppl(row)} |" for row in rows]
    return lines


def _ppl(row: dict) -> str:
    return f"{row['ppl']:.2f}" if row.get("ppl") is not None else str(row.get("error"))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m posenc.gpusession", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--lease",
        type=int,
        choices=sorted(leases.LEASES),
        help="run lease N of the GPU plan, all its parts in this one command (posenc/gpu/leases.py); the plan's order",
    )
    parser.add_argument("--stage", choices=plan.STAGES, default="proof", help="what this command runs (default proof)")
    parser.add_argument("--length", type=int, default=8192, help="speed: the attention table's length (8192 first)")
    parser.add_argument(
        "--part",
        choices=("attention", "train-step", "bias", "kernels"),
        default="attention",
        help="speed: the attention table, the train step, the bias decomposition, or the fused kernels (attention)",
    )
    parser.add_argument("--scheme", default="alibi", help="repro: the paper-scale scheme of this command")
    parser.add_argument("--configs", default="", help="proof: comma-separated configs (default: every one)")
    parser.add_argument("--jobs", type=int, default=8, help="proof: trainings at once (default 8)")
    parser.add_argument(
        "--deadline", type=float, help="seconds the whole command may take (a stage 540; a lease its budgets' sum)"
    )
    parser.add_argument("--out", type=Path, default=Path("outputs/gpusession"), help="the files that come back")
    parser.add_argument("--work", type=Path, default=None, help="where steps write (default outputs/gpusession-work)")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="wheels to install when Hydra is missing")
    parser.add_argument("--rehearse", action="store_true", help="the same plan on CPU, tiny, as the GPU image runs it")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    out = args.out.resolve()
    work = (args.work or ROOT / "outputs" / "gpusession-work").resolve()
    if out == work or work in out.parents or out in work.parents:
        print(f"error: --out {out} and --work {work} must not contain each other: give two folders", file=sys.stderr)
        return 2
    if not (args.dry_run or args.rehearse):
        import torch

        if not torch.cuda.is_available():
            print(
                "error: no CUDA device here: run this on a machine with a GPU (--rehearse runs the plan on CPU, "
                "--dry-run prints it)",
                file=sys.stderr,
            )
            return 2
    site = None if args.dry_run else install_wheels(args.wheels, work)
    configs = tuple(name for name in args.configs.split(",") if name)
    deadline = args.deadline or (leases.deadline_s(args.lease) if args.lease else 540.0)
    options = plan.Options(
        stage=args.stage,
        work=work,
        deadline_s=deadline,
        length=args.length,
        part=args.part,
        scheme=args.scheme,
        configs=configs,
        rehearse=args.rehearse,
        jobs=args.jobs,
    )
    try:
        steps = leases.build(args.lease, work, args.rehearse) if args.lease else plan.build(options)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    lines = (leases.lines(args.lease) if args.lease else []) + plan_lines(steps, deadline)
    if args.dry_run:
        print("\n".join(lines))
        return 0
    print("\n".join(lines), flush=True)
    env = step_env(site, work)
    if args.rehearse:
        env["PYTHONPATH"] = os.pathsep.join([str(gpu_image(work)), env["PYTHONPATH"]])
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["TRITON_INTERPRET"] = "1"  # the Triton kernels run, as Python, where the GPU would run them compiled
    stage = f"lease {args.lease}" if args.lease else args.stage
    meta = {"stage": stage, "rehearse": args.rehearse, "deadline_s": deadline, **pack.environment()}
    meta |= {"planned_s": planned_s(steps), "graphs": sum(step.graphs for step in steps)}

    def write_back() -> None:
        elapsed = {"elapsed_s": round(time.monotonic() - started, 1), "extra": extra_lines(steps, work)}
        pack.write(out, work, steps, meta | elapsed)

    runner = Runner(steps, work / "logs", started + deadline - RESERVE_S, env, on_change=write_back)
    try:
        runner.run()
    except SessionStoppedError as stop:
        write_back()
        print(f"== stopped by {stop}: summary in {out}", flush=True)
        return 128 + stop.signum
    failed = [step.name for step in steps if step.status != "passed"]
    print("== summary: " + ("every step passed" if not failed else "not passed: " + ", ".join(failed)), flush=True)
    print(f"== {len(list(out.iterdir()))} files in {out}", flush=True)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
