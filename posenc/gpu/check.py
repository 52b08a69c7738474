"""``python -m posenc.gpucheck``: one command that proves the GPU path, in ≤ 8 minutes on one H100.

It runs, each in its own process so that one crash (a segfault included) is one failed row, not a lost check:

- the GPU tests (``pytest -m "gpu and not slow" tests/test_gpu.py``, each test with a timeout);
- a short training run of every config in ``conf/encoding/`` with the default ``compile: auto``, through the
  end-of-training evaluation to 32× the training length;
- one run of a learnable distance-only scheme (``--triton``, KERPLE-log by default) with ``attention=triton``, the
  Triton kernels' only end-to-end check;
- one ``trainer=ddp trainer.devices=1 model=small`` run (the papers' model size, through DDP's wrapping);

then prints one table (config | trained | evaluated | steps/s | ppl@1× | ppl@32× | error) and exits non-zero on
any failure. With ``--jobs`` above 1 the runs share the GPU, so their steps/s say that a run trains, not how fast:
the column says how many ran at once, and ``--jobs 1`` (or ``posenc.bench``) measures speed. Every run logs to CSV
(``logger=csv``; wandb is never imported) and, on CUDA, treats torch's warning that FlexAttention ran uncompiled
(the unfused path) as an error. Runs go ``--jobs`` at a time: compilation is
CPU-bound and the GPU has room for several tiny models. ``--device cpu`` runs the same on CPU (small, for tests).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

import torch

from posenc.attention.flex import FALLBACK_WARNING
from posenc.config import CONF_DIR, encoding_choices
from posenc.jsonio import write_text

ROOT = CONF_DIR.parent
DDP = "ddp"  # the row name of the data-parallel run
TRITON = "triton"  # the row name of the attention=triton run
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Warning|Exit|Interrupt|Hit|Exceeded)\b(:|$)")
CRASH_LINE = re.compile(r"Segmentation fault|core dumped|Killed|Aborted")


@dataclass
class Check:
    """One training run: what was asked and what came of it."""

    name: str
    overrides: list[str]
    run_dir: Path
    multiples: list[int]
    returncode: int | None = None
    seconds: float = 0.0
    trained: bool = False
    evaluated: bool = False
    steps_per_s: float | None = None
    ppl: dict[float, float] = field(default_factory=dict)
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.trained and self.evaluated and not self.error


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m posenc.gpucheck", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the same check, small")
    parser.add_argument("--configs", help="comma-separated conf/encoding names (default: all of them)")
    parser.add_argument("--steps", type=int, help="training steps per run (default: 50 on cuda, 3 on cpu)")
    parser.add_argument("--multiples", help="evaluation multiples, e.g. 1,2 (default: 1,2,4,8,16,32)")
    parser.add_argument("--jobs", type=int, default=6, help="training runs at once (default 6)")
    parser.add_argument("--timeout", type=float, default=420, help="seconds per training run (default 420)")
    parser.add_argument("--no-tests", action="store_true", help="skip the GPU tests")
    parser.add_argument("--no-ddp", action="store_true", help="skip the trainer=ddp run")
    parser.add_argument(
        "--triton", default="kerple_log", metavar="CONFIG", help="config trained with attention=triton ('' to skip)"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="[CONFIG:]KEY=VALUE",
        help="a Hydra override for every run, or for one config's run with a CONFIG: prefix (repeatable)",
    )
    parser.add_argument("--out", type=Path, help="where runs and logs go (default: a new temporary directory)")
    args = parser.parse_args(argv)
    known = encoding_choices()
    args.configs = args.configs.split(",") if args.configs else known
    unknown = sorted(set(args.configs) - set(known))
    if unknown:
        parser.error(f"unknown config(s) {unknown}; choose from {known}")
    if args.triton and args.triton not in known:
        parser.error(f"--triton {args.triton}: not a config; choose from {known}")
    args.steps = args.steps or (50 if args.device == "cuda" else 3)
    args.multiples = [int(m) for m in (args.multiples or "1,2,4,8,16,32").split(",")]
    return args


def plan(args: argparse.Namespace, out: Path) -> list[Check]:
    """Every training run of the check, with its overrides (the triton and DDP ones last)."""
    common = [
        "logger=csv",
        f"trainer.max_steps={args.steps}",
        "trainer.enable_progress_bar=false",
        f"eval.multiples=[{','.join(map(str, args.multiples))}]",
        "eval.plots=false",
    ]
    if args.device == "cpu":
        common += ["trainer.accelerator=cpu", "data.batch_size=4", "data.seq_len=16", "data.val_windows=4"]
        common += ["eval.max_tokens=256", "model.depth=1", "trainer.log_every_n_steps=1"]
    scoped: dict[str, list[str]] = {}
    for override in args.set:
        name = override.split("=", 1)[0].rpartition(":")[0]
        if name and name not in args.configs:
            raise SystemExit(f"posenc.gpucheck: --set {override}: {name!r} is not one of the configs {args.configs}")
        scoped.setdefault(name, []).append(override.removeprefix(f"{name}:") if name else override)
    common += scoped.get("", [])
    checks = [
        Check(name, [f"+encoding={name}", *common, *scoped.get(name, [])], out / name, args.multiples)
        for name in args.configs
    ]
    if args.triton and args.device == "cuda":  # the kernels run on CUDA only (the CPU suite interprets them)
        triton = [f"+encoding={args.triton}", *common, "attention=triton"]
        checks.append(Check(TRITON, triton, out / TRITON, args.multiples))
    if not args.no_ddp:
        ddp = ["trainer=ddp", "trainer.devices=1"]
        if args.device == "cpu":
            ddp += ["trainer.precision=32-true"]
        else:
            ddp += ["model=small"]
        first = "alibi" if "alibi" in args.configs else args.configs[0]
        checks.append(Check(DDP, [f"+encoding={first}", *common, *ddp], out / DDP, args.multiples))
    return checks


def run_training(check: Check, timeout: float, device: str) -> Check:
    """Train (and evaluate) one config in a subprocess; fill in what it produced.

    On CUDA, torch's warning that FlexAttention ran uncompiled is an error (on CPU that path is the only one).
    """
    check.run_dir.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "posenc.train", *check.overrides, f"hydra.run.dir={check.run_dir}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    if device == "cuda":
        env["PYTHONWARNINGS"] = f"error:{FALLBACK_WARNING}:UserWarning"
    # Beside the run directory, not in it: a run refused before its first step leaves no directory behind.
    log = check.run_dir.parent / f"{check.run_dir.name}.log"
    started = time.perf_counter()
    with log.open("w") as handle:
        try:
            done = subprocess.run(
                command, stdout=handle, stderr=subprocess.STDOUT, env=env, timeout=timeout, check=False
            )
            check.returncode = done.returncode
        except subprocess.TimeoutExpired:
            check.error = f"timed out after {timeout:.0f} s"
    check.seconds = time.perf_counter() - started
    read_results(check, log)
    return check


def read_results(check: Check, log: Path) -> None:
    """Fill in trained / evaluated / steps/s / ppl from the run directory, and the error from the log if it failed."""
    summary_path = check.run_dir / "run.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    steps = summary.get("steps", 0)
    check.trained = check.returncode == 0 and steps > 0 and math.isfinite(summary.get("val_loss", math.nan))
    check.steps_per_s = steps_per_second(check.run_dir, summary)
    results_path = check.run_dir / "eval" / "results.json"
    if results_path.exists():
        rows = json.loads(results_path.read_text()).get("perplexity", [])
        check.ppl = {row["multiple"]: row["ppl"] for row in rows if row["error"] is None}
        # A scheme that cannot extrapolate (learned) refuses the longer lengths by design: that is evaluated.
        refused = {row["multiple"] for row in rows if str(row["error"]).startswith("max_positions=")}
        wanted = {float(m) for m in check.multiples}
        check.evaluated = check.trained and bool(check.ppl) and wanted <= set(check.ppl) | refused
        if check.trained and not check.error and len(rows) < len(wanted):
            check.error = "held-out data too short for the longest evaluation length"
    if not check.error and check.returncode not in (0, None):
        check.error = last_error(log) or f"exit code {check.returncode}"


def steps_per_second(run_dir: Path, summary: dict) -> float | None:
    """Training speed without compilation or validation: the last ``train/tokens_per_sec`` logged, in steps."""
    metrics = run_dir / "csv" / "metrics.csv"
    if not metrics.exists() or not summary.get("tokens_per_step"):
        return None
    with metrics.open() as handle:
        rates = [
            float(row["train/tokens_per_sec"]) for row in csv.DictReader(handle) if row.get("train/tokens_per_sec")
        ]
    return rates[-1] / summary["tokens_per_step"] if rates else None


def last_error(log: Path) -> str:
    """The log's last exception line (``SomeError: why``), else its last crash report, else its last line."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    for pattern in (EXCEPTION_LINE, CRASH_LINE):
        for line in reversed(lines):
            if pattern.search(line):
                return line[:200]
    return lines[-1][:200] if lines else ""


def run_tests(out: Path, device: str) -> tuple[bool, str]:
    """The GPU tests without the speed assertions; (passed, pytest's summary line). On CPU they all skip."""
    command = [sys.executable, "-m", "pytest", "-m", "gpu and not slow", "tests/test_gpu.py", "-q", "-rfE"]
    command += ["-p", "no:cacheprovider", "--timeout=240"]
    log = out / "gpu_tests.log"
    with log.open("w") as handle:
        done = subprocess.run(command, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, check=False)
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    summary = lines[-1].strip("= ") if lines else "no output"
    passed = done.returncode == 0 and (device == "cpu" or "skipped" not in summary)
    return passed, summary


def gpu_tests_verdict(passed: bool, summary: str) -> str:
    """``passed``, ``skipped`` (pytest ran nothing: no CUDA here), ``not run`` or ``FAILED``: skips never pass."""
    if not passed:
        return "FAILED"
    if summary.startswith("not run"):
        return "not run"
    return "passed" if " passed" in f" {summary}" else "skipped"


def table(checks: list[Check], multiples: list[int], jobs: int = 1) -> str:
    """The check's one table, as markdown; steps/s names how many runs shared the device when they did."""
    top = max(multiples)
    speed = "steps/s" if jobs <= 1 else f"steps/s ({jobs} runs at once)"
    lines = [
        f"| config | trained | evaluated | {speed} | ppl@1× | ppl@{top}× | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for check in checks:
        cells = [
            check.name,
            "yes" if check.trained else "NO",
            "yes" if check.evaluated else "NO",
            f"{check.steps_per_s:.1f}" if check.steps_per_s else "",
            f"{check.ppl[1.0]:.3f}" if 1.0 in check.ppl else "",
            f"{check.ppl[float(top)]:.3f}" if float(top) in check.ppl else ("refused" if check.evaluated else ""),
            check.error.replace("|", "/"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("posenc.gpucheck: no CUDA GPU here; run it on a GPU machine, or pass --device cpu", file=sys.stderr)
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="posenc-gpucheck-"))
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"posenc.gpucheck: torch {torch.__version__} on {device}; runs and logs in {out}", flush=True)
    started = time.perf_counter()
    checks = plan(args, out)
    with ThreadPoolExecutor(max_workers=max(1, args.jobs) + (0 if args.no_tests else 1)) as pool:
        tests = None if args.no_tests else pool.submit(run_tests, out, args.device)
        futures = [pool.submit(run_training, check, args.timeout, args.device) for check in checks]
        for future in as_completed(futures):
            check = future.result()
            status = "ok" if check.ok else f"FAILED ({check.error or 'see its log'})"
            print(f"{check.name}: {status} in {check.seconds:.0f} s", flush=True)
        tests_passed, tests_summary = tests.result() if tests is not None else (True, "not run (--no-tests)")
    print(f"\nGPU tests: {gpu_tests_verdict(tests_passed, tests_summary)}: {tests_summary}")
    rows = table(checks, args.multiples, min(args.jobs, len(checks)))
    print(rows)
    write_text(out / "table.md", rows + "\n")
    if args.jobs > 1:
        print(f"steps/s: up to {args.jobs} runs shared the device; a smoke figure, not a speed (--jobs 1 measures it)")
    failed = [check.name for check in checks if not check.ok]
    elapsed = time.perf_counter() - started
    verdict = "FAILED: " + ", ".join(failed) if failed else "every config trained and evaluated"
    print(f"\n{verdict}; {elapsed:.0f} s in all; logs: {out}/<config>.log", flush=True)
    return 1 if failed or not tests_passed else 0


if __name__ == "__main__":
    sys.exit(main())
