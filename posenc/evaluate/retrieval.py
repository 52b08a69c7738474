"""Retrieval-task accuracy by length (multikey, vartrack: ``posenc/data/retrieval.py``; MQAR: ``mqar.py`` here).

Scored by teacher-forced argmax on the answer bytes. Every answer of a window is scored on its own:
``accuracy`` is the fraction of answers whose every byte is the argmax (exactly when greedy decoding would produce
the whole answer), with the Wilson interval of its counts (``low``, ``high``), ``first_byte_accuracy`` the fraction
whose first byte is (the retrieval itself, before any copying of the rest), ``token_accuracy`` the fraction of
answer bytes. Each row carries the floors beside them: the chance rates of a uniform guess over the answer alphabet,
and the keyless rates of the best guess blind to which key goes with which fact, without and with elimination of
the answers already given (``keyless_rates``), the floors that recall has to clear. The same samples are drawn at a
length for every model: generated from (seed, length, task) with the task options the model was trained with.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from posenc.data.retrieval import RETRIEVAL_TASKS, chance_rates, evaluation_options, keyless_rates
from posenc.data.tasks import IGNORE
from posenc.evaluate.mqar import evaluate_mqar
from posenc.evaluate.stats import wilson


def answer_spans(targets: Tensor) -> list[tuple[int, int]]:
    """(start, end) of every run of scored positions in one window's targets (L,): one run per answer."""
    scored = (targets != IGNORE).tolist()
    spans, start = [], None
    for i, flag in enumerate([*scored, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            spans.append((start, i))
            start = None
    return spans


@torch.no_grad()
def score_answers(model: nn.Module, inputs: Tensor, targets: Tensor) -> tuple[list[bool], list[bool], int, int]:
    """Per answer in the batch (B, L): (all bytes right, first byte right); and (right bytes, scored bytes)."""
    correct = (model(inputs).argmax(dim=-1) == targets).cpu()
    exact, first = [], []
    for row, window in zip(correct, targets.cpu(), strict=True):
        for start, end in answer_spans(window):
            exact.append(bool(row[start:end].all()))
            first.append(bool(row[start]))
    scored = targets != IGNORE
    return exact, first, int((correct & scored.cpu()).sum()), int(scored.sum())


@torch.no_grad()
def evaluate_retrieval(
    model: nn.Module,
    task: str,
    lengths: Sequence[int],
    samples: int,
    seed: int,
    tokens_per_batch: int = 16384,
    device: torch.device | str | None = None,
    options: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Answer accuracies of ``task`` at every length over ``samples`` windows each (see the module docstring)."""
    generate = RETRIEVAL_TASKS[task]
    options = evaluation_options(options)
    device = device or next(model.parameters()).device
    task_index = list(RETRIEVAL_TASKS).index(task)
    chance_first, chance_exact = chance_rates(task, options)
    keyless = keyless_rates(task, options)
    was_training = model.training
    model.eval()
    rows = []
    try:
        for length in lengths:
            rng = np.random.default_rng([seed, length, task_index])
            batch = [generate(length, rng, **options) for _ in range(samples)]
            size = max(1, tokens_per_batch // length)
            exact, first, right, scored = [], [], 0, 0
            for start in range(0, samples, size):
                chunk = batch[start : start + size]
                inputs = torch.stack([s.inputs for s in chunk]).to(device)
                targets = torch.stack([s.targets for s in chunk]).to(device)
                chunk_exact, chunk_first, chunk_right, chunk_scored = score_answers(model, inputs, targets)
                exact, first, right, scored = (
                    exact + chunk_exact,
                    first + chunk_first,
                    right + chunk_right,
                    scored + chunk_scored,
                )
            rows.append(
                {
                    "task": task,
                    "length": length,
                    "samples": samples,
                    "answers": len(exact),
                    "correct": int(sum(exact)),
                    "accuracy": float(np.mean(exact)),
                    **dict(zip(("low", "high"), wilson(int(sum(exact)), len(exact)), strict=True)),
                    "first_byte_accuracy": float(np.mean(first)),
                    "token_accuracy": right / scored,
                    "chance_exact": chance_exact,
                    "chance_first_byte": chance_first,
                    **keyless,
                }
            )
    finally:
        model.train(was_training)
    return rows


def evaluate_retrieval_tasks(
    model: nn.Module,
    eval_cfg: dict[str, Any],
    trained_task: str | None,
    lengths_for: Callable[[Sequence[float]], list[int]],
    tokens_per_batch: int,
    task_options: Mapping[str, Any] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """{task: rows} for every retrieval task enabled in ``eval_cfg`` (``auto``: the task the model trained on).

    ``lengths_for(multiples)`` turns a task's length multiples into the lengths the model supports;
    ``task_options`` (the training data's) size the trained task's samples, the other tasks take their defaults.
    MQAR adds its breakdowns by distance, by query and by distance × position (``mqar_by_distance``,
    ``mqar_by_query``, ``mqar_by_distance_position``).
    """
    seed = int(eval_cfg.get("seed", 1234))
    out = {}
    for task in RETRIEVAL_TASKS:
        options = eval_cfg.get(task) or {}
        enabled = options.get("enabled", "auto")
        if enabled is True or (enabled == "auto" and trained_task == task):
            lengths = lengths_for(options["multiples"])
            generator_options = task_options if task == trained_task else None
            if task == "mqar":
                train_len = lengths_for([1])[0]  # the training length itself (multiple 1, always supported)
                out |= evaluate_mqar(
                    model, lengths, train_len, options["samples"], seed, tokens_per_batch, generator_options
                )
                continue
            out[task] = evaluate_retrieval(
                model, task, lengths, options["samples"], seed, tokens_per_batch, options=generator_options
            )
    return out
