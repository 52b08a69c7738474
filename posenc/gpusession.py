"""``python -m posenc.gpusession``: a GPU session's work — proof, speed table, paper-scale rows — as one command.

Why a runner and not a list of commands: time on a borrowed GPU is short and starts cold, and a command that is
killed returns only what it printed. So every step here runs under its own time limit, prints as it goes into a log
of its own, and the session writes ``summary.json`` after each step; a session cut short still says what passed,
what failed and what never started. Steps are planned in the order that makes later time worth spending: the proof
first (if the GPU path does not train, speed and paper-scale numbers prove nothing), then speed, then the
reproduction.

What comes back from such a machine is often limited to plain names a folder or two deep, so every file a step
writes under its work directory is also copied, flattened, into ``<out>/<step>/`` (names reduced to letters,
digits, ``.``, ``_``, ``-``).

A machine without a package registry may lack packages the project needs (Hydra, OmegaConf): wheels in ``--wheels``
(default ``.whl``) are installed into the work directory first and put on every step's ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import codecs
import importlib.util
import json
import os
import re
import selectors
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from posenc.jsonio import write_text

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("proof", "speed", "repro")
# The configs gpucheck trains in its first part: one of each attention path, so a broken path shows up early.
FIRST_CONFIGS = ("alibi", "t5", "kerple_log", "rope_alibi", "nope")
PAPER_SCHEMES = ("alibi", "rope", "sinusoidal")  # the ALiBi paper's Table 2
STEP_LIMIT_S = 570  # under a 10-minute command limit, with room to write the summary
COPY_MAX_BYTES = 20 * 2**20
COPY_SUFFIXES = {".json", ".md", ".csv", ".log", ".png", ".xml", ".txt", ".yaml"}


@dataclass
class Step:
    """One bounded command of the session."""

    stage: str
    name: str
    argv: list[str]
    limit_s: float = STEP_LIMIT_S
    status: str = "planned"  # planned | passed | failed | timed out | skipped
    returncode: int | None = None
    seconds: float | None = None
    copied: list[str] = field(default_factory=list)


def plain_name(text: str) -> str:
    """A file name made of letters, digits, ``.``, ``_``, ``-`` only."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "_"


def plan(stages: list[str], work: Path, python: str = sys.executable) -> list[Step]:
    """The session's steps for the chosen stages, in order (see the module docstring for why this order)."""
    from posenc.config import encoding_choices  # after the wheels: it needs OmegaConf

    module = [python, "-m"]
    steps: list[Step] = []
    if "proof" in stages:
        rest = ",".join(name for name in encoding_choices() if name not in FIRST_CONFIGS)
        check = [*module, "posenc.gpucheck", "--no-tests"]
        first = [*check, "--no-ddp", "--triton", "", "--configs", ",".join(FIRST_CONFIGS)]
        tests = [*module, "pytest", "-m", "gpu and not slow", "-q", "-p", "no:cacheprovider"]
        steps += [
            Step("proof", "versions", [python, "-c", VERSIONS], limit_s=60),
            Step("proof", "gpucheck-first", [*first, "--out", str(work / "gpucheck-first")]),
            Step("proof", "gpucheck-rest", [*check, "--configs", rest, "--out", str(work / "gpucheck-rest")]),
            Step("proof", "gpu-tests", [*tests, f"--junitxml={work / 'gpu-tests' / 'junit.xml'}"]),
        ]
    if "speed" in stages:
        bench = [*module, "posenc.bench"]
        no_step, no_long = "train_step.schemes=[]", "long_context.length=null"
        parts = {
            f"bench-{length}": [f"attention.lengths=[{length}]", no_step, no_long] for length in (2048, 8192, 16384)
        }
        parts["bench-train-step"] = ["attention.lengths=[]", no_long]
        parts["bench-64k"] = ["attention.lengths=[]", no_step]
        steps += [Step("speed", name, [*bench, *args, f"hydra.run.dir={work / name}"]) for name, args in parts.items()]
        speed_tests = [*module, "pytest", "-m", "gpu and slow", "-s", "-p", "no:cacheprovider"]
        steps.append(
            Step("speed", "gpu-speed-tests", [*speed_tests, f"--junitxml={work / 'gpu-speed-tests' / 'j.xml'}"])
        )
    if "repro" in stages:
        sweep = [*module, "posenc.train", "-m", "-cd", "sweeps", "-cn", "repro_gpu", "logger=csv"]
        sweep += ["trainer.enable_progress_bar=false", f"output_root={work / 'repro'}"]
        # One scheme a step, so each run has the step's whole time limit; the report reads every run of the sweep.
        steps += [Step("repro", f"repro-{scheme}", [*sweep, f"+encoding={scheme}"]) for scheme in PAPER_SCHEMES]
        report = [*module, "posenc.report", str(work / "repro" / "sweeps" / "repro_gpu")]
        steps.append(Step("repro", "repro-report", [*report, "--out", str(work / "repro-report")], limit_s=120))
    return steps


VERSIONS = (
    "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__);"
    "print('device', torch.cuda.get_device_name(0), 'capability', torch.cuda.get_device_capability(0))"
)


def install_wheels(wheels: Path, work: Path) -> Path | None:
    """Install the wheels in ``wheels`` into ``work/site`` when Hydra is missing; the folder to put on the path."""
    if importlib.util.find_spec("hydra") is not None or not wheels.is_dir() or not any(wheels.glob("*.whl")):
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


def step_env(site: Path | None) -> dict[str, str]:
    """The environment of every step: unbuffered output, no W&B, the installed wheels and the project importable."""
    paths = [str(site)] if site else []
    paths += [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)),
        "PYTHONUNBUFFERED": "1",
        "WANDB_MODE": "disabled",
    }


def run_step(step: Step, out: Path, env: dict[str, str], work: Path) -> None:
    """Run one step under its limit, its output printed and kept in ``<out>/<name>.log``; then copy what it wrote."""
    log_path = out / f"{plain_name(step.name)}.log"
    started = time.monotonic()
    wall_start = time.time()
    print(f"== {step.name} (limit {step.limit_s:.0f} s): {shlex.join(step.argv)}", flush=True)
    with log_path.open("w") as log:
        process = subprocess.Popen(
            step.argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            for text in output_chunks(process, started + step.limit_s):
                sys.stdout.write(text)
                sys.stdout.flush()
                log.write(text)
                log.flush()
            step.returncode = process.wait(timeout=5)
            step.status = "passed" if step.returncode == 0 else "failed"
        except TimeoutError:
            os.killpg(process.pid, 9)  # the step's whole process group: compile workers and DDP ranks too
            process.wait()
            step.status, step.returncode = "timed out", None
            log.write(f"\n[posenc.gpusession] {step.name} stopped at its limit of {step.limit_s:.0f} s\n")
    step.seconds = round(time.monotonic() - started, 1)
    step.copied = copy_outputs(work, out / plain_name(step.name), since=wall_start)
    print(f"== {step.name}: {step.status} in {step.seconds:.0f} s", flush=True)


def output_chunks(process: subprocess.Popen, deadline: float) -> Iterator[str]:
    """The process's output as it comes, not by line: pytest's progress dots end no line.

    Raises TimeoutError at the deadline, also while the process prints nothing.
    """
    assert process.stdout is not None
    descriptor = process.stdout.fileno()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with selectors.DefaultSelector() as selector:
        selector.register(descriptor, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            if not selector.select(timeout=min(remaining, 1.0)):
                continue
            chunk = os.read(descriptor, 65536)
            if not chunk:
                return
            yield decoder.decode(chunk)


def copy_outputs(work: Path, dest: Path, since: float) -> list[str]:
    """Copy the files under ``work`` written since ``since`` into ``dest``, flattened to plain names."""
    copied = []
    for path in sorted(work.rglob("*")) if work.exists() else []:
        if not path.is_file() or path.is_symlink() or path.suffix not in COPY_SUFFIXES:
            continue
        stat = path.stat()
        if stat.st_mtime < since or stat.st_size > COPY_MAX_BYTES or "site" in path.relative_to(work).parts[:1]:
            continue
        dest.mkdir(parents=True, exist_ok=True)
        name = plain_name("-".join(path.relative_to(work).parts))
        shutil.copyfile(path, dest / name)
        copied.append(name)
    return copied


def run_session(steps: list[Step], out: Path, work: Path, budget_s: float, env: dict[str, str]) -> int:
    """Run the steps in order while the budget holds; a step that no longer fits is skipped, not cut short."""
    deadline = time.monotonic() + budget_s
    for step in steps:
        left = deadline - time.monotonic()
        if left < step.limit_s:
            step.status = f"skipped: {left:.0f} s of the budget left, the step may take {step.limit_s:.0f} s"
        else:
            run_step(step, out, env, work)
        write_summary(steps, out)
    failed = [step.name for step in steps if step.status != "passed"]
    print("== summary: " + ("every step passed" if not failed else "not passed: " + ", ".join(failed)), flush=True)
    return 0 if not failed else 1


def write_summary(steps: list[Step], out: Path) -> None:
    """``summary.json`` and ``summary.md``, rewritten after every step so a cut session keeps them."""
    write_text(out / "summary.json", json.dumps([asdict(step) for step in steps], indent=2) + "\n")
    rows = ["| stage | step | status | s | rc |", "|---|---|---|---:|---:|"]
    rows += [
        f"| {s.stage} | {s.name} | {s.status} | {s.seconds if s.seconds is not None else ''} | "
        f"{s.returncode if s.returncode is not None else ''} |"
        for s in steps
    ]
    write_text(out / "summary.md", "\n".join(rows) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m posenc.gpusession", description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default="proof", help=f"comma-separated, in order, of {','.join(STAGES)}")
    parser.add_argument("--out", type=Path, default=Path("outputs/gpusession"), help="logs, summary, copied files")
    parser.add_argument("--work", type=Path, default=None, help="where steps write (default: <out>-work)")
    parser.add_argument("--budget", type=float, default=600.0, help="seconds for the whole session (default 600)")
    parser.add_argument("--step-limit", type=float, default=STEP_LIMIT_S, help="seconds a step may take at most")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="wheels to install when Hydra is missing")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stages = [stage.strip() for stage in args.stages.split(",") if stage.strip()]
    if unknown := [stage for stage in stages if stage not in STAGES]:
        print(f"error: unknown stage {', '.join(unknown)}: choose from {', '.join(STAGES)}", file=sys.stderr)
        return 2
    work = (args.work or args.out.parent / f"{args.out.name}-work").resolve()
    out = args.out.resolve()
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            print(
                "error: no CUDA device here: run this on a machine with a GPU (--dry-run prints the plan)",
                file=sys.stderr,
            )
            return 2
    site = None if args.dry_run else install_wheels(args.wheels, work)
    steps = plan(stages, work)
    for step in steps:
        step.limit_s = min(step.limit_s, args.step_limit)
    if args.dry_run:
        for step in steps:
            print(f"{step.stage:6} {step.name:18} ≤{step.limit_s:4.0f} s  {shlex.join(step.argv)}")
        print(f"{len(steps)} steps, at most {sum(s.limit_s for s in steps):.0f} s; budget {args.budget:.0f} s")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    return run_session(steps, out, work, args.budget, step_env(site))


if __name__ == "__main__":
    sys.exit(main())
