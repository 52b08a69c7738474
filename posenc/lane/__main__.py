"""``python -m posenc.lane``: compile every GPU kernel posenc's CUDA paths take, for GPUs that are not here.

    python -m posenc.lane                          # every case on the H100, A100 and L4; a table per device
    python -m posenc.lane --gpu l4 --scheme t5     # a subset
    python -m posenc.lane --only table             # just attention=triton's kernels (a minute or two)
    python -m posenc.lane --markdown docs/gpu-kernels.md   # write the table the docs show
    python -m posenc.lane --json                   # one JSON row per stage (what the tests read)
    python -m posenc.lane --torch-defaults --gpu h100 --scheme t5   # what torch's own tile choices would do

The cases (``posenc.lane.cases``) are FlexAttention's (compiled by ``posenc.lane.flex``) and ``attention=triton``'s
kernels, the table's and stick-breaking's (``posenc.lane.table``).
Each GPU's cases run in processes of their own (the fake device is process-wide), ``--jobs`` at once. Exit status 1
when a stage that must compile did not, or compiled over its device's shared memory, or a table kernel spills
registers; 0 otherwise. Needs the pinned
torch and triton (``posenc.lane.PINNED``): anything else gets one line saying so, and exit status 2; so does a
``--scheme`` whose declarations keep every CUDA path off FlexAttention (``flex.not_on_flex`` says why).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from posenc.jsonio import write_text
from posenc.lane import version_mismatch
from posenc.lane.gpus import GPUS

ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}


def run_gpu(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every stage of every case on one fake GPU (``args.worker``), in this process, before torch is imported."""
    os.environ.update(ENV)
    from posenc.lane import fake

    gpu = args.worker
    fake.install(GPUS[gpu])
    from posenc.lane.cases import cases
    from posenc.lane.flex import run_case

    if args.torch_defaults:  # every backend asks posenc.attention.flex for its options: answer with torch's own
        import posenc.attention.flex as flex
        import posenc.attention.flex_learnable as flex_learnable

        flex.kernel_options = flex_learnable.kernel_options = lambda encoding, q=None: None
    dtypes, head_dims = args.dtype, args.head_dim

    rows = []
    index, count = (int(part) for part in args.shard.split("/"))
    if args.only != "flex":
        from posenc.lane.table import compile_kernel, units

        for kernel, dtype, head_dim, length in units(dtypes, head_dims)[index::count]:
            row = compile_kernel(kernel, dtype, head_dim, length, GPUS[gpu])  # registers always: a spill is a finding
            rows.append({"kind": "table", **row})
            print(json.dumps(rows[-1]), flush=True)
    if args.only == "table":
        return rows
    for case in cases(args.scheme)[index::count]:
        if (dtypes and case.dtype not in dtypes) or (head_dims and case.head_dim not in head_dims):
            continue
        for result in run_case(case, GPUS[gpu], registers=not args.no_registers):
            rows.append({"gpu": gpu, **result.as_dict(), "refused": case.refused})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def failures(rows: list[dict[str, Any]]) -> list[str]:
    """One line per finding, naming the device, the case and the stage.

    Findings: a stage did not compile; a refusal the scheme declares did not happen; a compiled kernel needs more
    shared memory than its device has.
    """
    found = []
    for row in rows:
        mode = "train" if row["training"] else "eval"
        where = f"{row['gpu']}: {row['scheme']} {row['path']} {mode} {row['dtype']} d{row['head_dim']} {row['stage']}"
        if row["refused"] and row["stage"] == "backward":
            if row["ok"]:
                found.append(f"{where}: compiled, but the scheme declares FlexAttention cannot differentiate it")
            continue
        if not row["ok"]:
            found.append(f"{where}: {row['error']}")
        for kernel in row["kernels"]:
            if kernel["shared"] > kernel["limit"]:
                found.append(
                    f"{where}: {kernel['name']} needs {kernel['shared']} B of shared memory, the device has "
                    f"{kernel['limit']} B"
                )
    return found


STAGES = ("forward", "backward", "bias gradient")


def row_order(row: dict[str, Any], names: list[str]) -> tuple:
    """Rows by GPU, then case (in the order of ``names``, the lane's schemes), then stage: the table's order."""
    scheme = names.index(row["scheme"]) if row["scheme"] in names else len(names)
    return (list(GPUS).index(row["gpu"]), scheme, row["path"], not row["training"], row["dtype"], row["head_dim"],
            STAGES.index(row["stage"]))  # fmt: skip


def progress(row: dict[str, Any]) -> str:
    """One line for a finished stage: where, what, and how it went."""
    if row.get("kind") == "table":
        verdict = row.get("error") or row.get("refused") or f"{row['shared']} B shared, {row['spills']} B spilled"
        return f"{row['gpu']}: table kernel {row['kernel']} {row['dtype']} d{row['head_dim']}: {verdict}"
    mode = "train" if row["training"] else "eval"
    verdict = "ok" if row["ok"] else ("refused, as declared" if row["refused"] else f"FAILED: {row['error']}")
    shared = max((kernel["shared"] for kernel in row["kernels"]), default=0)
    case = f"{row['scheme']} {row['path']} {mode} {row['dtype']} d{row['head_dim']} {row['stage']}"
    return f"{row['gpu']}: {case}: {verdict} ({shared} B shared, {row['seconds']:.0f} s)"


def markdown(rows: list[dict[str, Any]], table_rows: list[dict[str, Any]] | None = None) -> str:
    """The docs' page: what wrote it, then per device and stage the largest template kernel's figures."""
    import datetime

    import torch
    import triton

    lines = [
        "# Every FlexAttention kernel posenc compiles, per GPU",
        "",
        "Written by `python -m posenc.lane --markdown docs/gpu-kernels.md`",
        f"(torch {torch.__version__}, triton {triton.__version__}, {datetime.date.today().isoformat()}; nothing was",
        "launched). Per stage, the largest FlexAttention template kernel: its shared memory, and ptxas's registers",
        "and spilled bytes for that device (`?` when the report was skipped). What the stages are, and which options",
        "each case gets: [gpu.md](gpu.md).",
        "",
        "| GPU | scheme | path | mode | dtype | head dim | stage | result | shared memory (B) | registers "
        "| spilled (B) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        kernels = row["kernels"] or [{"shared": "", "registers": "", "spills": ""}]
        worst = max(kernels, key=lambda kernel: kernel["shared"] or 0)
        result = "ok" if row["ok"] else ("refused, as declared: " if row["refused"] else "FAILED: ") + row["error"]
        lines.append(
            f"| {row['gpu']} | {row['scheme']} | {row['path']} | {'train' if row['training'] else 'eval'} | "
            f"{row['dtype']} | {row['head_dim']} | {row['stage']} | {result} | {worst['shared']} | "
            f"{worst['registers'] if worst['registers'] is not None else '?'} | "
            f"{worst['spills'] if worst['spills'] is not None else '?'} |"
        )
    from posenc.lane.cases import skipped

    lines += ["", "Compiled for no GPU, as their declarations say no CUDA path takes FlexAttention:", ""]
    lines += [f"- {name}: {reason}" for name, reason in skipped().items()]
    if table_rows:
        from posenc.lane.table import markdown as table_markdown

        lines += table_markdown(table_rows)
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    """The command line: what to compile for, and how to show it."""
    parser = argparse.ArgumentParser(prog="python -m posenc.lane", description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="append", choices=sorted(GPUS), help="a GPU to compile for (default: all)")
    parser.add_argument("--scheme", action="append", help="a scheme or stack (default: every one that reaches flex)")
    parser.add_argument("--dtype", action="append", choices=["bf16", "fp32"], help="a dtype (default: both)")
    parser.add_argument("--head-dim", action="append", type=int, choices=[64, 128], help="a head dim (default: both)")
    parser.add_argument("--json", action="store_true", help="print one JSON row per stage")
    parser.add_argument("--no-registers", action="store_true", help="no ptxas report for FlexAttention's kernels")
    parser.add_argument("--torch-defaults", action="store_true", help="torch's kernel options instead of posenc's")
    parser.add_argument("--only", choices=["flex", "table"], help="FlexAttention's kernels, or attention=triton's")
    parser.add_argument("--markdown", help="write the table to this file")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="GPUs compiled for at once")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one GPU, in this process
    parser.add_argument("--shard", default="0/1", help=argparse.SUPPRESS)  # which share of the cases: i/n
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    problem = version_mismatch()
    if problem:
        print(f"posenc.lane: {problem}; see the README's GPU check for the environment", file=sys.stderr)
        return 2
    if args.worker:
        run_gpu(args)
        return 0
    if args.scheme:
        from posenc.encodings import build
        from posenc.lane.cases import HEADS, not_on_flex

        for name in args.scheme:
            reason = not_on_flex(build(name, num_heads=HEADS, head_dim=64))
            if reason is not None:
                print(f"posenc.lane: nothing to compile for {name}: it {reason}", file=sys.stderr)
                return 2
    flags = [
        flag for flag, on in (("--no-registers", args.no_registers), ("--torch-defaults", args.torch_defaults)) if on
    ]
    flags += ["--only", args.only] if args.only else []
    for flag, values in (("--scheme", args.scheme), ("--dtype", args.dtype), ("--head-dim", args.head_dim)):
        flags += [item for value in values or [] for item in (flag, str(value))]

    def worker(unit: tuple[str, int]) -> tuple[int, list[dict[str, Any]], str]:
        """One GPU's share of the cases, each stage announced on stderr as it comes (a full run takes a while)."""
        gpu, shard = unit
        command = [sys.executable, "-m", "posenc.lane", "--worker", gpu, "--shard", f"{shard}/{shards}", *flags]
        with tempfile.TemporaryFile("w+") as errors:
            process = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=errors, text=True, env={**os.environ, **ENV}
            )
            got = []
            for line in process.stdout:
                if line.startswith("{"):
                    got.append(json.loads(line))
                    print(f"posenc.lane: {progress(got[-1])}", file=sys.stderr, flush=True)
            process.wait()
            errors.seek(0)
            return process.returncode, got, errors.read()

    # Each GPU's cases split in as many shares as processes run at once, so that none waits on the slowest GPU.
    jobs = max(1, args.jobs)
    shards = jobs
    units = [(gpu, shard) for gpu in args.gpu or list(GPUS) for shard in range(shards)]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = dict(zip(units, pool.map(worker, units), strict=True))
    rows = []
    for (gpu, _), (code, got, errors) in results.items():
        if code != 0:
            print(f"posenc.lane: the {gpu} worker stopped (exit {code}): {errors.strip()[-500:]}", file=sys.stderr)
            return 1
        rows += got
    from posenc.lane import table
    from posenc.lane.cases import schemes

    names = schemes()
    table_rows = [row for row in rows if row.get("kind") == "table"]
    table_rows.sort(key=lambda row: (list(GPUS).index(row["gpu"]), table.units().index(
        (row["kernel"], row["dtype"], row["head_dim"], row["length"]))))  # fmt: skip
    rows = sorted((row for row in rows if row.get("kind") != "table"), key=lambda row: row_order(row, names))
    if args.json:
        for row in rows + table_rows:
            print(json.dumps(row))
    else:
        print(markdown(rows, table_rows), end="")
    if args.markdown:
        write_text(Path(args.markdown), markdown(rows, table_rows))
    found = failures(rows) + table.failures(table_rows)
    for line in found:
        print(f"FAILED {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
