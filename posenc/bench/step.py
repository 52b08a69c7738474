"""The whole-model train step of ``python -m posenc.bench``: every scheme's step timed in turn, against NoPE's.

Why in turn: a CPU shared with other work, or a GPU whose clock moves, changes a step's time from one moment to the
next. Timing one step of every scheme per repetition puts that change on all of them alike, and pairing each
scheme's step with NoPE's of the same repetition gives its ratio an interval that the load cannot move.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from posenc.bench.attention import record_failure, resolve_dtype, timed_ms
from posenc.bench.profile import profile_step
from posenc.config import CONF_DIR, encoding_choices, to_container
from posenc.encodings.length import scale_to_length
from posenc.layout import encoding_label
from posenc.model import Decoder
from posenc.training.compiling import compile_blocks, should_compile


def train_step_cases(cfg: DictConfig, device: torch.device) -> list[dict]:
    """Whole-model train steps per scheme (tokens/s), each as a ratio to NoPE's, the steps timed in turns.

    Every scheme's model is built first; then each repetition times one step of every scheme in turn, so that a
    change in the machine's load (another job on a shared CPU, a GPU's clock) falls on every scheme alike rather
    than on whichever ran at that moment. A scheme is an encoding config (``conf/encoding/<name>.yaml``, options
    included, named as a training run names it) or a scheme string (``alibi``, ``rope+alibi``).
    """
    step_cfg = cfg.train_step
    model_cfg = to_container(cfg.model)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda" and resolve_dtype(cfg.dtype, device) == torch.bfloat16
        else contextlib.nullcontext()
    )
    compiled = should_compile(step_cfg.compile, "cuda" if device.type == "cuda" else "cpu")
    tokens = torch.randint(0, step_cfg.vocab_size, (step_cfg.batch_size, step_cfg.seq_len + 1), device=device)
    rows: list[dict[str, Any]] = []
    steps: dict[int, Callable[[], None]] = {}
    for scheme in dict.fromkeys(["nope", *step_cfg.schemes]):
        spec = encoding_spec(scheme, step_cfg.seq_len)
        row: dict[str, Any] = {
            "scheme": scheme,
            "label": encoding_label(spec),
            "seq_len": step_cfg.seq_len,
            "batch": step_cfg.batch_size,
        }
        try:
            model = Decoder(spec, vocab_size=step_cfg.vocab_size, attention=step_cfg.attention, **model_cfg)
            model = model.to(device)
            if compiled:
                compile_blocks(model)
            row["parameters"] = sum(p.numel() for p in model.parameters())
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

            def step(model: Decoder = model, optimizer: torch.optim.Optimizer = optimizer) -> None:
                with autocast:
                    loss = model.loss(tokens[:, :-1], tokens[:, 1:])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                model.constrain_()

            steps[len(rows)] = step
        except Exception as err:  # reported in the table
            record_failure(row, "error", err)
        rows.append(row)
    times = interleaved_steps_ms(steps, rows, device, cfg.warmup, cfg.repeats, cfg.case_budget_s)
    for index, samples in times.items():
        rows[index]["step_ms"] = statistics.median(samples)
        rows[index]["repeats"] = len(samples)
        rows[index]["tokens_per_s"] = step_cfg.batch_size * step_cfg.seq_len / rows[index]["step_ms"] * 1e3
    for index, row in enumerate(rows):
        if 0 in times and index in times:
            # Repetition by repetition the two steps ran back to back: the median of their paired ratios, and its
            # interval, are what a change of load cannot move.
            paired = [first / other for first, other in zip(times[0], times[index], strict=True)]
            row["x_nope"] = statistics.median(paired)
            row["x_nope_interval"] = median_interval(paired)
        if index in steps and row["scheme"] in step_cfg.profile_schemes and "error" not in row:
            row["profile"] = profile_step(steps[index], device, step_cfg.profile_steps, step_cfg.profile_rows)
    return [row for row in rows if row["scheme"] in step_cfg.schemes]


def interleaved_steps_ms(
    steps: dict[int, Callable[[], None]],
    rows: list[dict[str, Any]],
    device: torch.device,
    warmup: int,
    repeats: int,
    budget_s: float,
) -> dict[int, list[float]]:
    """Each step's timed calls in ms, every repetition one call of each step in turn.

    Repetitions stop early, after at least three, once the slowest step has spent ``budget_s``. A step that fails
    (out of memory at one size) leaves the rotation with its error in its row; the others go on.
    """
    times: dict[int, list[float]] = {index: [] for index in steps}

    def call(index: int, timed: bool) -> None:
        try:
            if timed:
                times[index].append(timed_ms(steps[index], device))
            else:
                steps[index]()
        except Exception as err:
            record_failure(rows[index], "error", err)
            del steps[index], times[index]

    for _ in range(warmup):
        for index in list(steps):
            call(index, timed=False)
    for repeat in range(repeats):
        if repeat >= 3 and times and max(sum(samples) for samples in times.values()) > budget_s * 1e3:
            break
        for index in list(steps):
            call(index, timed=True)
    return times


def median_interval(samples: list[float], resamples: int = 2000, seed: int = 0) -> list[float]:
    """A 95% bootstrap interval of the median of ``samples`` (percentile method, a fixed seed: reruns agree)."""
    values = np.asarray(samples, dtype=float)
    if values.size < 2:
        return [float(values.min()), float(values.max())] if values.size else []
    draws = np.random.default_rng(seed).choice(values, size=(resamples, values.size))
    low, high = np.percentile(np.median(draws, axis=1), [2.5, 97.5])
    return [float(low), float(high)]


def encoding_spec(name: str, seq_len: int) -> Any:
    """The encoding config ``conf/encoding/<name>.yaml`` as a run training at ``seq_len`` reads it, else ``name``.

    A config may read the run's training length (``${data.seq_len}``, or a length setting left unset that the scheme
    scales to it: a learned table's size, T5's buckets); here that is the step's length.
    """
    if name in encoding_choices():
        root = OmegaConf.create({"data": {"seq_len": seq_len}})
        root.encoding = OmegaConf.load(CONF_DIR / "encoding" / f"{name}.yaml")
        return scale_to_length(to_container(root)["encoding"], seq_len)[0]
    return name
