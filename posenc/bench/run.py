"""``python -m posenc.bench``: what each positional scheme costs, measured against the no-bias limit in one run.

Four measurements, all configured in ``conf/bench.yaml`` (defaults: the shapes of docs/benchmarks.md's H100 reference):

- attention: for each length × scheme × backend, the forward and forward+backward median time, tokens/s, peak
  memory (CUDA: ``max_memory_allocated`` above what the inputs hold; CPU: not measured, "n/a"), and the ratio to
  the fastest unbiased causal attention torch offers on the machine (NoPE through SDPA as it dispatches, SDPA held
  to each of its kernels, and FlexAttention without a score_mod, all timed at the same length in the same process;
  the winner per mode is named). The scheme's rotation is part of the timed call, since RoPE and xPos pay for it;
- a whole-model train step (forward, backward, AdamW) per scheme, in tokens/s and as a ratio to NoPE;
- long context: a batch-1 attention forward of every relative scheme at ``long_context.length`` (64k by default),
  reporting its time and memory, or the error (OOM) that stopped it;
- on CPU, when ``compare.schemes`` names any, posenc's decoder against x-transformers' (``posenc/bench/compare.py``).

Each attention length gets its own static compiled kernels, which is what a training run at that length compiles.
Every attention case prints one line as it finishes (scheme, backend, length, ms, ratio), so a long GPU run shows
progress; the train steps, timed in turn, print theirs once all are timed. The tables go to ``bench.json`` and
``bench.md`` in the run directory at the end.
"""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from posenc.attention.auto import choose
from posenc.attention.flex_learnable import supports
from posenc.bench.attention import (
    attention_call,
    fastest,
    measure_attention,
    median_ms,
    peak_mib,
    record_failure,
    reference_backends,
    resolve_device,
    resolve_dtype,
)
from posenc.bench.bias import decomposition
from posenc.bench.compare import compare_cases, compare_markdown
from posenc.bench.profile import profile_markdown
from posenc.bench.step import train_step_cases
from posenc.config import CONF_DIR, to_container
from posenc.encodings import build, scheme_class, stack_members
from posenc.jsonio import write_json, write_text


def attention_cases(cfg: DictConfig, device: torch.device) -> tuple[list[dict], list[dict]]:
    """Every length × scheme × backend, each time divided by the fastest unbiased attention at that length.

    Per length, NoPE is first timed through every reference kernel (``reference_backends``); the fastest per mode
    is the denominator, and which one won is returned beside the rows (one entry per length) and printed. Each
    length's table starts with the references themselves. ``auto`` reuses the measurement of the backend it
    resolves to when that one is also listed.
    """
    rows, winners = [], []
    for length in cfg.attention.lengths:
        measured = {}
        for backend in reference_backends(cfg.attention.references, device):
            measured["nope", backend] = measure_attention("nope", backend, length, cfg, device)
        best = {mode: fastest(list(measured.values()), mode) for mode in ("forward", "train")}
        winners.append({"length": length, **{mode: row and row["backend"] for mode, row in best.items()}})
        print(reference_line(length, best), flush=True)
        cases = list(measured) + [
            (s, b) for s in cfg.attention.schemes for b in cfg.attention.backends if (s, b) not in measured
        ]
        for scheme, backend in cases:
            encoding = build(scheme, num_heads=cfg.attention.heads, head_dim=cfg.attention.head_dim)
            resolved = choose(encoding, device.type == "cuda") if backend == "auto" else backend
            if resolved == "flex_learnable" and not (encoding.learnable_bias and supports(encoding)):
                continue  # identical to flex for a fixed bias
            if (scheme, resolved) not in measured:
                measured[scheme, resolved] = measure_attention(scheme, resolved, length, cfg, device)
            row = {**measured[scheme, resolved], "backend": backend, "resolved": resolved}
            for mode, reference in best.items():
                if f"{mode}_ms" in row and reference is not None:
                    row[f"{mode}_x_best"] = row[f"{mode}_ms"] / reference[f"{mode}_ms"]
            rows.append(row)
            print(case_line(row), flush=True)
    return rows, winners


def reference_line(length: int, best: dict[str, dict | None]) -> str:
    """Which unbiased kernel was fastest at ``length``, per mode: the denominator of every ratio below it."""
    parts = [
        f"{name} {row['backend']} {row[f'{mode}_ms']:.3f} ms" if row else f"{name} none ran"
        for mode, name in (("forward", "fwd"), ("train", "fwd+bwd"))
        for row in [best[mode]]
    ]
    return f"fastest unbiased attention  L={length:<6} " + "  ".join(parts)


def is_relative(scheme: str) -> bool:
    return not any(scheme_class(part).absolute for part in stack_members(scheme))


def long_context_cases(cfg: DictConfig, device: torch.device) -> list[dict]:
    """Batch-1 forward of every relative scheme at ``long_context.length``: does it fit, and how long it takes."""
    length = cfg.long_context.length
    if not length:
        return []
    dtype = resolve_dtype(cfg.dtype, device)
    shape = (1, cfg.attention.heads, length, cfg.attention.head_dim)
    rows = []
    for scheme in [s for s in cfg.attention.schemes if is_relative(s)]:
        row: dict[str, Any] = {"scheme": scheme, "length": length, "backend": cfg.long_context.backend}
        try:
            encoding = build(scheme, num_heads=cfg.attention.heads, head_dim=cfg.attention.head_dim).to(device)
            q, k, v = (torch.randn(shape, device=device, dtype=dtype) for _ in range(3))
            row["resolved"] = choose(encoding, device.type == "cuda") if row["backend"] == "auto" else row["backend"]
            call = attention_call(encoding, row["resolved"], q, k, v)
            with torch.no_grad():
                row["forward_ms"] = median_ms(call, device, 1, 3)
                row["forward_peak_mib"] = peak_mib(call, device)
        except Exception as err:  # an OOM here is the result being checked
            record_failure(row, "error", err)
        rows.append(row)
        print(case_line(row), flush=True)
    return rows


def case_line(row: dict[str, Any]) -> str:
    """One case as a progress line: what it is, its time(s) and ratio(s), or why it failed."""
    if "seq_len" in row:
        what = f"train step   {row['scheme']:<22} L={row['seq_len']:<6}"
        if "error" in row:
            return f"{what} failed: {row['error']}"
        return f"{what} {row['step_ms']:10.3f} ms  {row['tokens_per_s']:12,.0f} tok/s  {_cell(row.get('x_nope'))}× NoPE"
    backend = (
        row["backend"]
        if row.get("resolved", row["backend"]) == row["backend"]
        else f"{row['backend']}→{row['resolved']}"
    )
    what = f"{'attention' if 'batch' in row else 'long context'} {row['scheme']:<22} {backend:<24} L={row['length']:<6}"
    if "batch" not in row:
        return f"{what} failed: {row['error']}" if "error" in row else f"{what} fwd {row['forward_ms']:10.3f} ms"
    parts = []
    for mode, name in (("forward", "fwd"), ("train", "fwd+bwd")):
        if f"{mode}_error" in row:
            parts.append(f"{name} failed: {row[f'{mode}_error']}")
        else:
            parts.append(f"{name} {row[f'{mode}_ms']:10.3f} ms ({_cell(row.get(f'{mode}_x_best'))}× best)")
    return f"{what} " + "  ".join(parts)


def cpu_name() -> str:
    """The CPU's model name where Linux says it, else the architecture."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def environment(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return {
        "device": f"{device.type}: {name}",
        "threads": torch.get_num_threads(),
        # Other processes' load: CPU timings on a shared machine are only as good as this is low.
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def _cell(value: Any, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _failed(message: str, notes: dict[str, int]) -> str:
    """A table cell pointing at the failure's message, listed once under the tables."""
    return f"failed [{notes.setdefault(message, len(notes) + 1)}]"


def _times(row: dict, mode: str, notes: dict[str, int]) -> list[str]:
    if f"{mode}_error" in row:
        return [_failed(row[f"{mode}_error"], notes), "", "", ""]
    return [
        _cell(row[f"{mode}_ms"], 3),
        _cell(row.get(f"{mode}_x_best")),
        _cell(row[f"{mode}_tokens_per_s"], 0),
        _cell(row[f"{mode}_peak_mib"], 1),
    ]


def markdown(results: dict[str, Any]) -> str:
    """The results as markdown tables (attention per length, train steps, long context), failures listed below."""
    env = results["environment"]
    lines = [
        f"Device: {env['device']} ({env['threads']} threads, load average {_cell(env['load_average'])} at the start)"
        f" · torch {env['torch']} · {env['dtype']} · {env['date']}"
    ]
    notes: dict[str, int] = {}
    columns = ["scheme", "backend"] + [f"{m} {c}" for m in ("fwd", "fwd+bwd") for c in ("ms", "×best", "tok/s", "MiB")]
    head = "| " + " | ".join(columns) + " |"
    for length in dict.fromkeys(row["length"] for row in results["attention"]):
        rows = [row for row in results["attention"] if row["length"] == length]
        lines += ["", f"### Attention, L = {length} (batch {rows[0]['batch']})", ""]
        winner = next((w for w in results.get("reference", []) if w["length"] == length), None)
        if winner:
            names = {mode: winner[mode] or "none ran" for mode in ("forward", "train")}
            lines += [
                f"×best: ratio to the fastest unbiased attention here, fwd {names['forward']},"
                f" fwd+bwd {names['train']}.",
                "",
            ]
        lines += [head, "|---" * 10 + "|"]
        for row in rows:
            backend = row["backend"] if row["backend"] == row["resolved"] else f"{row['backend']} → {row['resolved']}"
            cells = [row["scheme"], backend, *_times(row, "forward", notes), *_times(row, "train", notes)]
            lines.append("| " + " | ".join(cells) + " |")
    if results["train_step"]:
        first = results["train_step"][0]
        lines += ["", f"### Whole-model train step (L = {first['seq_len']}, batch {first['batch']})", ""]
        repeats = sorted({row["repeats"] for row in results["train_step"] if "repeats" in row})
        if repeats:
            counts = "–".join(dict.fromkeys(map(str, (repeats[0], repeats[-1]))))
            lines += [
                f"One step of every scheme timed in turn, {counts} times; the median of each, and a bootstrap interval"
                " of the median of its ratios to NoPE's step in the same repetition.",
                "",
            ]
        lines += ["| scheme | step ms | tokens/s | ×NoPE tokens/s [95% interval] |", "|---|---|---|---|"]
        for row in results["train_step"]:
            step = _failed(row["error"], notes) if "error" in row else _cell(row["step_ms"], 1)
            ratio = _cell(row.get("x_nope"))
            if len(row.get("x_nope_interval") or []) == 2:
                ratio += " [{:.2f}, {:.2f}]".format(*row["x_nope_interval"])
            cells = [row["scheme"], step, _cell(row.get("tokens_per_s"), 0), ratio]
            lines.append("| " + " | ".join(cells) + " |")
        for row in results["train_step"]:
            if "profile" in row:
                lines += profile_markdown(row)
    if results["long_context"]:
        lines += ["", f"### Long context: batch-1 forward, L = {results['long_context'][0]['length']}", ""]
        lines += ["| scheme | backend | forward ms | peak MiB |", "|---|---|---|---|"]
        for row in results["long_context"]:
            cells = [row["scheme"], f"{row['backend']} → {row.get('resolved', '?')}"]
            if "error" in row:
                cells += [_failed(row["error"], notes), ""]
            else:
                cells += [_cell(row["forward_ms"], 1), _cell(row["forward_peak_mib"], 1)]
            lines.append("| " + " | ".join(cells) + " |")
    if results.get("compare"):
        lines += compare_markdown(results["compare"], lambda message: _failed(message, notes))
    if notes:
        lines += ["", "Failures:", ""] + [f"- [{number}] {message}" for message, number in notes.items()]
    return "\n".join(lines) + "\n"


def run(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    """Run every measurement ``cfg`` asks for; write ``bench.json`` and ``bench.md`` into ``out_dir``."""
    device = resolve_device(cfg.device)
    env = environment(device, resolve_dtype(cfg.dtype, device))
    bias = decomposition(cfg, device, out_dir, env) if cfg.bias.run else []  # written item by item, first
    attention, reference = attention_cases(cfg, device)
    results = {
        "environment": env,
        "bias": bias,
        "config": to_container(cfg),
        "attention": attention,
        "reference": reference,
        "train_step": train_step_cases(cfg, device) if cfg.train_step.schemes else [],
        "long_context": long_context_cases(cfg, device),
        "compare": compare_cases(cfg.compare, device) if cfg.compare.schemes else [],
    }
    for row in results["train_step"]:  # timed in turn: every step's line once all of them are timed
        print(case_line(row), flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    for row in results["train_step"]:
        if "profile" in row:  # the profiler's full table beside the summary the markdown shows
            write_text(out_dir / f"profile_{row['scheme']}.txt", row["profile"].pop("text") + "\n")
    write_json(out_dir / "bench.json", results)
    write_text(out_dir / "bench.md", markdown(results))
    return results


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="bench")
def main(cfg: DictConfig) -> None:
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    results = run(cfg, out_dir)
    print(markdown(results))
    print(f"wrote {out_dir}/bench.json and {out_dir}/bench.md")
