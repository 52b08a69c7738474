"""``python -m posenc.bench``: what each positional scheme costs, measured against the no-bias limit in one run.

Four measurements, all configured in ``conf/bench.yaml`` (defaults: the shapes of docs/benchmarks.md's H100 reference):

- attention: for each length × scheme × backend, the forward and forward+backward median time, tokens/s, peak
  memory (CUDA: ``max_memory_allocated`` above what the inputs hold; CPU: not measured, "n/a"), and the ratio to
  SDPA flash without a bias (NoPE through ``sdpa``) timed at the same length in the same process. The scheme's
  rotation is part of the timed call, since RoPE and xPos pay for it in every layer;
- a whole-model train step (forward, backward, AdamW) per scheme, in tokens/s and as a ratio to NoPE;
- long context: a batch-1 attention forward of every relative scheme at ``long_context.length`` (64k by default),
  reporting its time and memory, or the error (OOM) that stopped it;
- on CPU, when ``compare.schemes`` names any, posenc's decoder against x-transformers' (``bench_compare.py``).

Each attention length gets its own static compiled kernels, which is what a training run at that length compiles.
Every case prints one line as it finishes (scheme, backend, length, ms, ratio), so a long GPU run shows progress;
the tables go to ``bench.json`` and ``bench.md`` in the run directory at the end.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from posenc.attention import get_backend
from posenc.attention.auto import choose
from posenc.attention.flex_learnable import supports
from posenc.bench_compare import compare_cases, compare_markdown
from posenc.compiling import compile_blocks, should_compile
from posenc.config import CONF_DIR, to_container
from posenc.encodings import build, scheme_class, stack_members
from posenc.encodings.base import PositionalEncoding
from posenc.jsonio import dumps
from posenc.model import Decoder

FLASH = ("nope", "sdpa")  # the reference every attention time is divided by


def resolve_device(name: str) -> torch.device:
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def median_ms(
    fn: Callable[[], Any], device: torch.device, warmup: int, repeats: int, budget_s: float = float("inf")
) -> float:
    """Median wall time of ``fn`` in ms: CUDA events on a GPU, ``perf_counter`` on CPU.

    Timing stops early, after at least three calls, once ``budget_s`` is spent: a case seconds long (the atomics
    backward this benchmark exists to show) does not need ten repeats to be told apart from one taking ms.
    """
    for _ in range(warmup):
        fn()
    times: list[float] = []
    for _ in range(repeats):
        if len(times) >= 3 and sum(times) > budget_s * 1e3:
            break
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def peak_mib(fn: Callable[[], Any], device: torch.device) -> float | None:
    """Peak CUDA memory of one call of ``fn`` above what was allocated before it (None on CPU: not measured)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def failure(err: Exception) -> str:
    """One line saying why a case could not run (an OOM, or a backend refusing the scheme or the device)."""
    if isinstance(err, torch.cuda.OutOfMemoryError):
        torch.cuda.empty_cache()
        return "OOM"
    return f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"


def attention_call(
    encoding: PositionalEncoding, backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> Callable[[], torch.Tensor]:
    """One attention layer's positional work: the scheme's rotation, then the backend with its bias."""
    attend = get_backend(backend)
    pos = torch.arange(q.shape[-2], device=q.device)

    def call() -> torch.Tensor:
        rotated_q, rotated_k = encoding.rotate(q, k, pos, pos)
        return attend(rotated_q, rotated_k, v, encoding, pos, pos)

    return call


def measure_attention(scheme: str, backend: str, length: int, cfg: DictConfig, device: torch.device) -> dict:
    """Forward (no grad) and forward+backward of one scheme × backend at one length."""
    heads, head_dim = cfg.attention.heads, cfg.attention.head_dim
    batch = max(1, cfg.attention.tokens // length)
    dtype = resolve_dtype(cfg.dtype, device)
    row: dict[str, Any] = {"scheme": scheme, "backend": backend, "length": length, "batch": batch}
    encoding = build(scheme, num_heads=heads, head_dim=head_dim).to(device)
    shape = (batch, heads, length, head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(shape, device=device, dtype=dtype)
    call = attention_call(encoding, backend, q, k, v)

    def forward() -> None:
        with torch.no_grad():
            call()

    def train() -> None:
        call().backward(grad_out)
        for tensor in (q, k, v, *encoding.parameters()):
            tensor.grad = None

    tokens = batch * length
    for mode, fn in (("forward", forward), ("train", train)):
        try:
            row[f"{mode}_ms"] = median_ms(fn, device, cfg.warmup, cfg.repeats, cfg.case_budget_s)
            row[f"{mode}_tokens_per_s"] = tokens / row[f"{mode}_ms"] * 1e3
            row[f"{mode}_peak_mib"] = peak_mib(fn, device)
        except Exception as err:  # a refused or failed case is a result, reported as such
            row[f"{mode}_error"] = failure(err)
    return row


def attention_cases(cfg: DictConfig, device: torch.device) -> list[dict]:
    """Every length × scheme × backend, with each time divided by SDPA flash (NoPE) at the same length.

    Each length's table starts with that flash row itself. ``auto`` reuses the measurement of the backend it
    resolves to when that one is also listed.
    """
    rows = []
    for length in cfg.attention.lengths:
        flash = measure_attention(*FLASH, length, cfg, device)
        measured = {FLASH: flash}
        cases = [FLASH] + [(s, b) for s in cfg.attention.schemes for b in cfg.attention.backends if (s, b) != FLASH]
        for scheme, backend in cases:
            encoding = build(scheme, num_heads=cfg.attention.heads, head_dim=cfg.attention.head_dim)
            resolved = choose(encoding, device.type == "cuda") if backend == "auto" else backend
            if resolved == "flex_learnable" and not (encoding.learnable_bias and supports(encoding)):
                continue  # identical to flex for a fixed bias
            if (scheme, resolved) not in measured:
                measured[scheme, resolved] = measure_attention(scheme, resolved, length, cfg, device)
            row = {**measured[scheme, resolved], "backend": backend, "resolved": resolved}
            for mode in ("forward", "train"):
                if f"{mode}_ms" in row and f"{mode}_ms" in flash:
                    row[f"{mode}_x_flash"] = row[f"{mode}_ms"] / flash[f"{mode}_ms"]
            rows.append(row)
            print(case_line(row), flush=True)
    return rows


def train_step_cases(cfg: DictConfig, device: torch.device) -> list[dict]:
    """Whole-model train steps per scheme (tokens/s), each as a ratio to NoPE measured in the same run."""
    step_cfg = cfg.train_step
    model_cfg = to_container(cfg.model)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda" and resolve_dtype(cfg.dtype, device) == torch.bfloat16
        else contextlib.nullcontext()
    )
    compiled = should_compile(step_cfg.compile, "cuda" if device.type == "cuda" else "cpu")
    tokens = torch.randint(0, step_cfg.vocab_size, (step_cfg.batch_size, step_cfg.seq_len + 1), device=device)
    rows = []
    for scheme in dict.fromkeys(["nope", *step_cfg.schemes]):
        row: dict[str, Any] = {"scheme": scheme, "seq_len": step_cfg.seq_len, "batch": step_cfg.batch_size}
        try:
            model = Decoder(scheme, vocab_size=step_cfg.vocab_size, attention=step_cfg.attention, **model_cfg)
            model = model.to(device)
            if compiled:
                compile_blocks(model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def step(model: Decoder = model, optimizer: torch.optim.Optimizer = optimizer) -> None:
                with autocast:
                    loss = model.loss(tokens[:, :-1], tokens[:, 1:])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                model.constrain_()

            row["step_ms"] = median_ms(step, device, cfg.warmup, cfg.repeats, cfg.case_budget_s)
            row["tokens_per_s"] = step_cfg.batch_size * step_cfg.seq_len / row["step_ms"] * 1e3
        except Exception as err:  # reported in the table
            row["error"] = failure(err)
        nope = rows[0].get("tokens_per_s") if rows else row.get("tokens_per_s")
        if nope and "tokens_per_s" in row:
            row["x_nope"] = row["tokens_per_s"] / nope
        rows.append(row)
        print(case_line(row), flush=True)
    return [row for row in rows if row["scheme"] in step_cfg.schemes]


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
            row["error"] = failure(err)
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
            parts.append(f"{name} {row[f'{mode}_ms']:10.3f} ms ({_cell(row.get(f'{mode}_x_flash'))}× flash)")
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
        _cell(row.get(f"{mode}_x_flash")),
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
    columns = ["scheme", "backend"] + [f"{m} {c}" for m in ("fwd", "fwd+bwd") for c in ("ms", "×flash", "tok/s", "MiB")]
    head = "| " + " | ".join(columns) + " |"
    for length in dict.fromkeys(row["length"] for row in results["attention"]):
        rows = [row for row in results["attention"] if row["length"] == length]
        lines += ["", f"### Attention, L = {length} (batch {rows[0]['batch']})", "", head, "|---" * 10 + "|"]
        for row in rows:
            backend = row["backend"] if row["backend"] == row["resolved"] else f"{row['backend']} → {row['resolved']}"
            cells = [row["scheme"], backend, *_times(row, "forward", notes), *_times(row, "train", notes)]
            lines.append("| " + " | ".join(cells) + " |")
    if results["train_step"]:
        first = results["train_step"][0]
        lines += ["", f"### Whole-model train step (L = {first['seq_len']}, batch {first['batch']})", ""]
        lines += ["| scheme | step ms | tokens/s | ×NoPE tokens/s |", "|---|---|---|---|"]
        for row in results["train_step"]:
            step = _failed(row["error"], notes) if "error" in row else _cell(row["step_ms"], 1)
            cells = [row["scheme"], step, _cell(row.get("tokens_per_s"), 0), _cell(row.get("x_nope"))]
            lines.append("| " + " | ".join(cells) + " |")
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
    results = {
        "environment": environment(device, resolve_dtype(cfg.dtype, device)),
        "config": to_container(cfg),
        "attention": attention_cases(cfg, device),
        "train_step": train_step_cases(cfg, device) if cfg.train_step.schemes else [],
        "long_context": long_context_cases(cfg, device),
        "compare": compare_cases(cfg.compare, device) if cfg.compare.schemes else [],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(dumps(results))
    (out_dir / "bench.md").write_text(markdown(results))
    return results


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="bench")
def main(cfg: DictConfig) -> None:
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    results = run(cfg, out_dir)
    print(markdown(results))
    print(f"wrote {out_dir}/bench.json and {out_dir}/bench.md")


if __name__ == "__main__":
    main()
