"""The bias decomposition: each piece a learnable bias's attention step pays, timed against SDPA flash in one process.

Why: a train-step ratio says that KERPLE and T5 are slow on a GPU, not where the time goes. At one shape
(conf/bench.yaml ``bias``: B 8, H 12, L 2048, D 64, bf16 on a GPU) this times, forward and forward+backward where both
exist:

- SDPA flash with no bias: the denominator of every ratio;
- the constant-bias attention ``flex_learnable`` runs (FlexAttention reading KERPLE-log's table, detached): its forward,
  and its backward for q, k, v;
- each gradient pass: Identity 1's extra forward per KERPLE-log derivative form (reading the bias plus log f by
  distance), and T5's band pass (Identity 2);
- the whole of ``flex_learnable`` for KERPLE-log and for T5, to check that the pieces add up;
- the fused table kernel (``attention=triton``: one kernel, the table's gradient reduced per distance in its backward),
  with atomics and in its deterministic mode;
- FlexAttention's own captured-buffer gradient (the table requiring grad: one atomic add per score), which posenc does
  not use: a measured row, so that the reason stays a measurement;
- ALiBi through ``flex`` from its table (its table tiles), and from its own formula with torch's default tiles, the
  path it took before: what reading a table costs, or saves, a fixed bias;

first, the fused kernel's values against the dense fp32 reference (``bias_values``: head dims 64 and 128, a length
that is no multiple of its tiles, atomic and deterministic); then a profile of the heaviest kernels of the two
learnable paths (``flex_learnable`` and the fused kernel). Each item is written to ``bias.json`` and ``bias.md`` as
soon as it is timed, so a run stopped at a deadline keeps every item measured before it. An item that cannot run here
(FlexAttention's CPU backward, Triton without a GPU) records its error and the rest go on: on CPU the stage rehearses,
it does not measure.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch.nn.attention import SDPBackend, sdpa_kernel

from posenc.attention import get_backend
from posenc.attention.bias_grad import derivative_sums, diagonal_sums, row_deltas
from posenc.attention.flex import flex_run, kernel_options
from posenc.attention.tables import distance_table, plan_gradient, table_score_mod
from posenc.bench.attention import median_ms, record_failure, resolve_dtype
from posenc.bench.bias_values import markdown as values_markdown
from posenc.bench.bias_values import value_checks
from posenc.bench.profile import profile_step
from posenc.encodings import build
from posenc.jsonio import write_json, write_text

Call = Callable[[], Any]


@dataclass
class _Inputs:
    """One shape's tensors and schemes, shared by every item: each item times the same q, k, v and the same tables.

    Why a class: the items are closures over one set of inputs; as methods they read what they share by name, and
    the list of items stays a list.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    pos: torch.Tensor
    kerple: Any
    t5: Any
    alibi: Any

    @classmethod
    def make(cls, cfg: DictConfig, device: torch.device) -> _Inputs:
        bias = cfg.bias
        shape = (bias.batch, bias.heads, bias.length, bias.head_dim)
        dtype = resolve_dtype(cfg.dtype, device)
        q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        dout = torch.randn(shape, device=device, dtype=dtype)
        schemes = (
            build(name, num_heads=bias.heads, head_dim=bias.head_dim).to(device)
            for name in (bias.derivative_scheme, bias.table_scheme, bias.fixed_scheme)
        )
        return cls(q, k, v, dout, torch.arange(bias.length, device=device), *schemes)

    @functools.cached_property
    def options(self) -> dict | None:
        return kernel_options(self.kerple, self.q)

    @functools.cached_property
    def plan(self) -> Any:
        return plan_gradient(self.kerple, self.length)

    @functools.cached_property
    def t5_plan(self) -> Any:
        return plan_gradient(self.t5, self.length)

    @property
    def length(self) -> int:
        return self.q.shape[-2]

    def table(self, detached: bool = False) -> torch.Tensor:
        return distance_table(self.kerple, self.length, detached=detached)

    def backward(self, out: torch.Tensor, *leaves: torch.Tensor) -> None:
        out.backward(self.dout)
        for tensor in (self.q, self.k, self.v, *leaves):
            tensor.grad = None

    def flex(self, mod: Callable[[], Any], options: dict | None) -> tuple[Call, Call]:
        q, k, v = self.q, self.k, self.v

        def forward() -> Any:
            with torch.no_grad():
                return flex_run(q, k, v, mod(), options=options)

        return forward, lambda: self.backward(flex_run(q, k, v, mod(), options=options), *self.kerple.parameters())

    def backend(self, name: str, encoding: Any) -> tuple[Call, Call]:
        def run() -> torch.Tensor:
            return get_backend(name)(self.q, self.k, self.v, encoding, self.pos, self.pos)

        return torch.no_grad()(run), lambda: self.backward(run(), *encoding.parameters())

    def identity_pass(self, index: int) -> Any:
        """One derivative form: its extra forward, then the per-head sum."""
        q, k, v, options = self.q, self.k, self.v, self.options
        with torch.no_grad():
            out, lse = flex_run(q, k, v, table_score_mod(self.plan.bias), return_lse=True, options=options)
            shifted = flex_run(q, k, v, table_score_mod(self.plan.shifted[index]), return_lse=True, options=options)
            return derivative_sums(lse, self.dout, row_deltas(out, self.dout), *shifted)

    def band_pass(self) -> Any:
        q, k, v, plan = self.q, self.k, self.v, self.t5_plan
        with torch.no_grad():
            out, lse = flex_run(
                q, k, v, table_score_mod(plan.bias), return_lse=True, options=kernel_options(self.t5, q)
            )
            return diagonal_sums(q, k, v, lse, self.dout, row_deltas(out, self.dout), plan.band)

    def fused_forward(self) -> Any:
        from posenc.attention.triton_table import table_attention

        with torch.no_grad():
            return table_attention(self.q, self.k, self.v, self.table())

    def fused_train(self, deterministic: bool) -> Call:
        def train() -> None:
            from posenc.attention.triton_table import table_attention

            previous = torch.are_deterministic_algorithms_enabled()
            torch.use_deterministic_algorithms(deterministic)
            try:
                self.backward(table_attention(self.q, self.k, self.v, self.table())[0], *self.kerple.parameters())
            finally:
                torch.use_deterministic_algorithms(previous)

        return train

    def flash_forward(self) -> Any:
        with torch.no_grad(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(self.q, self.k, self.v, is_causal=True)

    def flash_train(self) -> None:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            self.backward(F.scaled_dot_product_attention(self.q, self.k, self.v, is_causal=True))


def _items(cfg: DictConfig, device: torch.device) -> list[tuple[str, str, Call | None, Call | None]]:
    """(name, what it is, forward, forward+backward) of every item, in the order they are timed."""
    x = _Inputs.make(cfg, device)
    kerple, t5, alibi = x.kerple, x.t5, x.alibi
    passes = [
        (f"gradient pass {i + 1}", f"Identity 1, {kerple.label}'s form {i + 1}: a forward reading bias + log f",
            functools.partial(x.identity_pass, i), None)
        for i in range(len(x.plan.shifted))
    ]  # fmt: skip
    return [
        ("sdpa flash", "SDPA's flash kernel, no bias: every ratio's denominator", x.flash_forward, x.flash_train),
        ("constant bias", f"FlexAttention reading {kerple.label}'s table, detached: q, k, v grads",
            *x.flex(lambda: table_score_mod(x.table(detached=True)), x.options)),
        *passes,
        ("band pass", f"Identity 2, {t5.label}'s band of {x.t5_plan.band.shape[-1]} distances (with its forward)",
            x.band_pass, None),
        (f"flex_learnable {kerple.label}", "the whole backend: constant bias plus the gradient passes",
            *x.backend("flex_learnable", kerple)),
        (f"flex_learnable {t5.label}", "the whole backend: constant bias plus the band",
            *x.backend("flex_learnable", t5)),
        ("fused table kernel", "attention=triton: dtable per distance in its backward (atomics)", x.fused_forward,
            x.fused_train(False)),
        ("fused, deterministic", "the same, each block of distances written once, summed in order", None,
            x.fused_train(True)),
        ("captured-buffer gradient", "FlexAttention differentiating the table: an atomic add per score",
            *x.flex(lambda: table_score_mod(x.table()), x.options)),
        (f"{alibi.label}, table", f"flex reading {alibi.label}'s (H, L) table", *x.backend("flex", alibi)),
        (f"{alibi.label}, formula", f"flex with {alibi.label}'s own score_mod and torch's tiles (its path before)",
            *x.flex(alibi.score_mod, None)),
    ]  # fmt: skip


PROFILED = ("flex_learnable", "fused table kernel")  # the items (by prefix) whose fwd+bwd is profiled


def decomposition(cfg: DictConfig, device: torch.device, out_dir: Path, environment: dict[str, Any]) -> list[dict]:
    """Time every item (see the module docstring), writing ``bias.json`` and ``bias.md`` after each one."""
    out_dir.mkdir(parents=True, exist_ok=True)
    bias = cfg.bias
    shape = {"batch": bias.batch, "heads": bias.heads, "length": bias.length, "head_dim": bias.head_dim}
    header = {**environment, "shape": shape}
    rows: list[dict[str, Any]] = []
    reference: dict[str, float] = {}

    values: list[dict[str, Any]] = []

    def write() -> None:
        write_json(out_dir / "bias.json", {"environment": header, "values": values, "items": rows})
        write_text(out_dir / "bias.md", markdown(header, rows, values))

    values += value_checks(cfg, device)  # before any timing: a kernel that computes wrong values is not timed first
    write()
    for name, what, forward, train in _items(cfg, device):
        row: dict[str, Any] = {"item": name, "what": what}
        for mode, fn in (("forward", forward), ("train", train)):
            if fn is None:
                continue
            try:
                row[f"{mode}_ms"] = median_ms(fn, device, cfg.warmup, cfg.repeats, cfg.case_budget_s)
            except Exception as err:  # a refused or failed piece is a result, reported as such
                record_failure(row, f"{mode}_error", err)
                continue
            if name == "sdpa flash":
                reference[mode] = row[f"{mode}_ms"]
            if reference.get(mode):
                row[f"{mode}_x_flash"] = row[f"{mode}_ms"] / reference[mode]
        profiled = name.startswith(PROFILED) and name != f"flex_learnable {cfg.bias.table_scheme}"
        if profiled and train is not None and "train_error" not in row:
            profile = profile_step(train, device, bias.profile_steps, bias.profile_rows)
            write_text(out_dir / f"profile_{name.replace(' ', '_')}.txt", profile.pop("text") + "\n")
            row["profile"] = profile
        rows.append(row)
        write()
        print(line(row), flush=True)
    return rows


def line(row: dict[str, Any]) -> str:
    """One item as a progress line."""
    parts = []
    for mode, label in (("forward", "fwd"), ("train", "fwd+bwd")):
        if f"{mode}_error" in row:
            parts.append(f"{label} failed: {row[f'{mode}_error']}")
        elif f"{mode}_ms" in row:
            ratio = row.get(f"{mode}_x_flash")
            parts.append(f"{label} {row[f'{mode}_ms']:9.3f} ms" + (f" ({ratio:.2f}× flash)" if ratio else ""))
    return f"bias decomposition  {row['item']:<26} " + "  ".join(parts)


def markdown(header: dict[str, Any], rows: list[dict[str, Any]], values: list[dict[str, Any]] = ()) -> str:
    """``bias.md``: the shape and device, one row per item, the fused kernel's values, the profiles below."""
    shape = header["shape"]
    lines = [
        f"### Bias decomposition: B {shape['batch']}, H {shape['heads']}, L {shape['length']}, D {shape['head_dim']}",
        "",
        f"Device: {header['device']} · torch {header['torch']} · {header['dtype']} · load average "
        f"{header['load_average']} at the start · {header['date']}. ×flash: the item's time over SDPA flash's, same "
        "mode, same process.",
        "",
        "| item | what it is | fwd ms | ×flash | fwd+bwd ms | ×flash |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        cells = [row["item"], row["what"]]
        for mode in ("forward", "train"):
            if f"{mode}_error" in row:
                cells += [f"failed: {row[f'{mode}_error']}".replace("|", "/"), ""]
            elif f"{mode}_ms" in row:
                ratio = row.get(f"{mode}_x_flash")
                cells += [f"{row[f'{mode}_ms']:.3f}", "" if ratio is None else f"{ratio:.2f}"]
            else:
                cells += ["", ""]
        lines.append("| " + " | ".join(cells) + " |")
    lines += values_markdown(list(values))
    for row in rows:
        if "profile" in row:
            prof = row["profile"]
            lines += ["", f"#### Heaviest kernels: {row['item']} (fwd+bwd, {prof['clock']} time)", ""]
            lines += ["| kernel or operator | calls a step | ms a step | share |", "|---|---:|---:|---:|"]
            lines += [
                f"| {entry['name'][:90].replace('|', '/')} | {entry['calls_per_step']:.0f} | "
                f"{entry['ms_per_step']:.3f} | {entry['share']:.0%} |"
                for entry in prof["top"]
            ]
    return "\n".join(lines) + "\n"
