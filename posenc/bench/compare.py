"""posenc against x-transformers: the same decoder with each scheme both libraries have, trained side by side.

For every length × scheme in ``compare`` (``conf/bench.yaml``), posenc's ``Decoder`` and x-transformers'
``TransformerWrapper(Decoder(...))`` are built with the same width, depth, heads, batch, vocabulary, RMSNorm, a
bias-free 4× GELU MLP, tied embeddings and no absolute position embedding, then one forward and backward step of
each (next-token cross-entropy, gradients cleared, no optimiser) is timed in turns: posenc, x-transformers,
posenc, ... so that load from other processes falls on both. The medians and their ratio are reported.

Each length × scheme runs in a child process of its own, so that a case the machine cannot hold (the kernel kills
a process that runs out of memory; no exception reaches Python) is a result, not the end of the benchmark: when
the child dies, each library is run alone in a child of its own, which tells whose step did not fit, and the
other's time is kept. Every child reports its peak resident memory.

x-transformers runs in its fastest setting that accepts the scheme: ``attn_flash=True`` (SDPA) where it allows it,
its own einsum attention where it refuses flash with that bias (T5, CoPE, dynamic position bias). The scheme's
x-transformers flags come from the config, so this module never names a scheme. x-transformers is optional: it is
imported only when a comparison is asked for.
"""

from __future__ import annotations

import importlib.metadata
import multiprocessing
import resource
import signal
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from posenc.config import to_container
from posenc.model import Decoder


def x_transformers_module() -> Any:
    """The x_transformers package, or one clear line saying how to get it."""
    try:
        import x_transformers
    except ImportError:
        raise SystemExit(
            "compare.schemes needs x-transformers: pip install x-transformers (or leave compare.schemes empty)"
        ) from None
    return x_transformers


def build_pair(scheme: str, flags: dict[str, Any], cfg: DictConfig, length: int) -> tuple[torch.nn.Module, ...]:
    """The decoder of posenc and that of x-transformers for ``scheme``, the same architecture on both sides."""
    xt = x_transformers_module()
    common = {"dim": cfg.dim, "depth": cfg.depth, "heads": cfg.heads}
    head_dim = cfg.dim // cfg.heads
    posenc_model = Decoder(scheme, vocab_size=cfg.vocab_size, attention=cfg.attention, **common)
    x_model = xt.TransformerWrapper(
        num_tokens=cfg.vocab_size,
        max_seq_len=length,
        use_abs_pos_emb=False,
        tie_embedding=True,
        # rotary_emb_dim: posenc rotates every dimension of a head, x-transformers half of them unless told.
        attn_layers=xt.Decoder(
            **common,
            attn_dim_head=head_dim,
            rotary_emb_dim=head_dim,
            use_rmsnorm=True,
            ff_no_bias=True,
            **flags,
        ),
    )
    return posenc_model, x_model


def train_step(model: torch.nn.Module, tokens: torch.Tensor) -> Callable[[], None]:
    """One forward and backward of next-token cross-entropy (fp32 loss), gradients cleared after."""

    def step() -> None:
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
        model.zero_grad(set_to_none=True)

    return step


def interleaved_ms(steps: list[Callable[[], None]], warmup: int, repeats: int) -> list[float]:
    """Median wall time in ms of each step, the steps run in turn in every repetition (CPU: ``perf_counter``)."""
    for _ in range(warmup):
        for step in steps:
            step()
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for index, step in enumerate(steps):
            started = time.perf_counter()
            step()
            times[index].append((time.perf_counter() - started) * 1e3)
    return [statistics.median(samples) for samples in times]


SIDES = ("posenc", "x")


def measure(cfg: dict[str, Any], scheme: str, flags: dict[str, Any], length: int, sides: tuple[str, ...]) -> dict:
    """Time ``sides`` (both libraries interleaved, or one alone) for one case; runs in a child process."""
    from omegaconf import OmegaConf

    conf = OmegaConf.create(cfg)
    torch.manual_seed(0)
    models = dict(zip(SIDES, build_pair(scheme, flags, conf, length), strict=True))
    tokens = torch.randint(0, conf.vocab_size, (conf.batch_size, length + 1))
    out: dict[str, Any] = {f"{side}_params": sum(p.numel() for p in models[side].parameters()) for side in SIDES}
    steps = [train_step(models[side], tokens) for side in sides]
    for side, ms in zip(sides, interleaved_ms(steps, conf.warmup, conf.repeats), strict=True):
        out[f"{side}_ms"] = ms
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    return out


def _child(connection: Any, threads: int, function: Callable[..., dict], args: tuple) -> None:
    torch.set_num_threads(threads)
    try:
        connection.send(function(*args))
    except Exception as err:  # a case that cannot run (a refused flag, an allocation) is a result
        connection.send({"error": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"})


def in_child(args: tuple, function: Callable[..., dict] = measure) -> dict[str, Any]:
    """``function(*args)`` in a fresh process with this one's thread count; a killed child is reported, not raised.

    ``function`` must be importable by name (the child is spawned, so that no thread pool is forked).
    """
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(send, torch.get_num_threads(), function, args))
    process.start()
    send.close()
    try:
        result = receive.recv()
    except EOFError:  # the child died before answering
        result = None
    process.join()
    if result is not None:
        return result
    code = process.exitcode or 0
    if code == -signal.SIGKILL:
        return {"error": "killed (SIGKILL: out of memory, most likely)", "killed": True}
    return {"error": f"the process running it exited with status {code}", "killed": True}


def compare_cases(cfg: DictConfig, device: torch.device) -> list[dict[str, Any]]:
    """Every length × scheme of ``cfg`` (the ``compare`` section): both step times, tokens/s and their ratio."""
    if device.type != "cpu":
        raise SystemExit("compare times CPU steps (perf_counter, fp32); run it with device=cpu")
    x_transformers_module()  # fail at once, in one line, when it is missing
    flags_by_scheme = to_container(cfg.x_transformers)
    version = importlib.metadata.version("x-transformers")
    plain = to_container(cfg)
    rows = []
    for length in cfg.lengths:
        for scheme in cfg.schemes:
            if scheme not in flags_by_scheme:
                raise SystemExit(f"compare.x_transformers has no flags for {scheme!r}: add them to conf/bench.yaml")
            flags = flags_by_scheme[scheme]
            row: dict[str, Any] = {"scheme": scheme, "length": length, "batch": cfg.batch_size, "x_flags": flags}
            row["x_transformers"] = version
            result = in_child((plain, scheme, flags, length, SIDES))
            if result.get("killed"):  # whose step did not fit: each alone
                alone = {side: in_child((plain, scheme, flags, length, (side,))) for side in SIDES}
                died = [name for side, name in zip(SIDES, ("posenc", "x-transformers"), strict=True)
                        if "error" in alone[side]]  # fmt: skip
                result = {
                    key if key != "peak_rss_mib" else f"{side}_peak_rss_mib": value
                    for side in SIDES
                    for key, value in alone[side].items()
                    if key not in ("error", "killed")
                }
                result["error"] = f"{' and '.join(died) or 'neither alone; together'}: {_first_error(alone, result)}"
                result["alone"] = True
            row.update(result)
            tokens_per_step = cfg.batch_size * length
            for side in SIDES:
                if f"{side}_ms" in row:
                    row[f"{side}_tokens_per_s"] = tokens_per_step / row[f"{side}_ms"] * 1e3
            if "posenc_ms" in row and "x_ms" in row:
                row["ratio"] = row["posenc_ms"] / row["x_ms"]
            rows.append(row)
            print(compare_line(row), flush=True)
    return rows


def _first_error(alone: dict[str, dict[str, Any]], fallback: dict[str, Any]) -> str:
    errors = [result["error"] for result in alone.values() if "error" in result]
    return errors[0] if errors else "killed when both ran in one process"


def compare_line(row: dict[str, Any]) -> str:
    what = f"compare      {row['scheme']:<22} L={row['length']:<6}"
    times = "  ".join(
        f"{name} {row[f'{side}_ms']:10.1f} ms" for side, name in zip(SIDES, ("posenc", "x-transformers"), strict=True)
        if f"{side}_ms" in row
    )  # fmt: skip
    if "error" in row:
        return f"{what} {times + '  ' if times else ''}failed: {row['error']}"
    memory = f"  peak {row['peak_rss_mib']:,.0f} MiB" if row.get("peak_rss_mib") else ""
    return f"{what} {times}  ratio {row['ratio']:.2f}{memory}"


def compare_markdown(rows: list[dict[str, Any]], failed: Callable[[str], str]) -> list[str]:
    """The comparison as a markdown table (lines); ``failed`` turns an error into a cell pointing at a note.

    A case where one library's step did not run shows the other's time beside the failure; ``peak MiB`` is the
    child process's peak resident memory (both libraries when they ran together, one when alone).
    """
    first = rows[0]
    lines = [
        "",
        f"### posenc against x-transformers {first.get('x_transformers') or ''}: fwd+bwd step, batch {first['batch']}",
        "",
        "| scheme | L | posenc ms | x-transformers ms | posenc / x-transformers | posenc tok/s | x-transformers tok/s "
        "| peak MiB | x-transformers flags | params posenc / x-transformers |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        flags = ", ".join(f"{key}={value}" for key, value in row["x_flags"].items())
        note = failed(row["error"]) if "error" in row else ""

        def number(field: str, digits: int = 1, row: dict[str, Any] = row, note: str = note) -> str:
            return f"{row[field]:,.{digits}f}" if field in row else note

        params = (
            f"{row['posenc_params']:,} / {row['x_params']:,}" if "posenc_params" in row and "x_params" in row else ""
        )
        cells = [
            row["scheme"],
            str(row["length"]),
            number("posenc_ms"),
            number("x_ms"),
            f"**{row['ratio']:.2f}**" if "ratio" in row else note,
            number("posenc_tokens_per_s", 0),
            number("x_tokens_per_s", 0),
            _peak(row),
            flags,
            params,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _peak(row: dict[str, Any]) -> str:
    if row.get("peak_rss_mib"):
        return f"{row['peak_rss_mib']:,.0f}"
    alone = [f"{name} {row[f'{side}_peak_rss_mib']:,.0f}" for side, name in zip(SIDES, ("posenc", "x"), strict=True)
             if row.get(f"{side}_peak_rss_mib")]  # fmt: skip
    return " / ".join(alone)
