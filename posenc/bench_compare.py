"""posenc against x-transformers: the same decoder with each scheme both libraries have, trained side by side.

For every length × scheme in ``compare`` (``conf/bench.yaml``), posenc's ``Decoder`` and x-transformers'
``TransformerWrapper(Decoder(...))`` are built with the same width, depth, heads, batch, vocabulary, RMSNorm, a
bias-free 4× GELU MLP, tied embeddings and no absolute position embedding, then one forward and backward step of
each (next-token cross-entropy, gradients cleared, no optimiser) is timed in turns: posenc, x-transformers,
posenc, ... so that load from other processes falls on both. The medians and their ratio are reported.

x-transformers runs in its fastest setting that accepts the scheme: ``attn_flash=True`` (SDPA) where it allows it,
its own einsum attention where it refuses flash with that bias (T5, CoPE, dynamic position bias). The scheme's
x-transformers flags come from the config, so this module never names a scheme. x-transformers is optional: it is
imported only when a comparison is asked for.
"""

from __future__ import annotations

import gc
import importlib.metadata
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


def compare_cases(cfg: DictConfig, device: torch.device) -> list[dict[str, Any]]:
    """Every length × scheme of ``cfg`` (the ``compare`` section): both step times, tokens/s and their ratio."""
    if device.type != "cpu":
        raise SystemExit("compare times CPU steps (perf_counter, fp32); run it with device=cpu")
    x_transformers_module()  # fail at once, in one line, when it is missing
    flags_by_scheme = to_container(cfg.x_transformers)
    version = importlib.metadata.version("x-transformers")
    rows = []
    for length in cfg.lengths:
        for scheme in cfg.schemes:
            if scheme not in flags_by_scheme:
                raise SystemExit(f"compare.x_transformers has no flags for {scheme!r}: add them to conf/bench.yaml")
            flags = flags_by_scheme[scheme]
            row: dict[str, Any] = {"scheme": scheme, "length": length, "batch": cfg.batch_size, "x_flags": flags}
            row["x_transformers"] = version
            models: tuple[torch.nn.Module, ...] = ()
            try:
                torch.manual_seed(0)
                models = build_pair(scheme, flags, cfg, length)
                tokens = torch.randint(0, cfg.vocab_size, (cfg.batch_size, length + 1))
                row["posenc_params"], row["x_params"] = (sum(p.numel() for p in m.parameters()) for m in models)
                steps = [train_step(model, tokens) for model in models]
                row["posenc_ms"], row["x_ms"] = interleaved_ms(steps, cfg.warmup, cfg.repeats)
                tokens_per_step = cfg.batch_size * length
                row["posenc_tokens_per_s"] = tokens_per_step / row["posenc_ms"] * 1e3
                row["x_tokens_per_s"] = tokens_per_step / row["x_ms"] * 1e3
                row["ratio"] = row["posenc_ms"] / row["x_ms"]
            except Exception as err:  # a case that cannot run (memory, a refused flag) is a result
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
            del models
            gc.collect()
            rows.append(row)
            print(compare_line(row), flush=True)
    return rows


def compare_line(row: dict[str, Any]) -> str:
    what = f"compare      {row['scheme']:<22} L={row['length']:<6}"
    if "error" in row:
        return f"{what} failed: {row['error']}"
    return f"{what} posenc {row['posenc_ms']:10.1f} ms  x-transformers {row['x_ms']:10.1f} ms  ratio {row['ratio']:.2f}"


def compare_markdown(rows: list[dict[str, Any]], failed: Callable[[str], str]) -> list[str]:
    """The comparison as a markdown table (lines); ``failed`` turns an error into a cell pointing at a note."""
    first = rows[0]
    lines = [
        "",
        f"### posenc against x-transformers {first.get('x_transformers') or ''}: fwd+bwd step, batch {first['batch']}",
        "",
        "| scheme | L | posenc ms | x-transformers ms | posenc / x-transformers | posenc tok/s | x-transformers tok/s "
        "| x-transformers flags | params posenc / x-transformers |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        flags = ", ".join(f"{key}={value}" for key, value in row["x_flags"].items())
        if "error" in row:
            cells = [row["scheme"], str(row["length"]), failed(row["error"]), "", "", "", "", flags, ""]
        else:
            cells = [
                row["scheme"],
                str(row["length"]),
                f"{row['posenc_ms']:,.1f}",
                f"{row['x_ms']:,.1f}",
                f"**{row['ratio']:.2f}**",
                f"{row['posenc_tokens_per_s']:,.0f}",
                f"{row['x_tokens_per_s']:,.0f}",
                flags,
                f"{row['posenc_params']:,} / {row['x_params']:,}",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines
