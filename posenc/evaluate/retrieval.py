"""Retrieval-task accuracy by length (multikey, vartrack, assoc; generators in ``posenc/data/retrieval.py``).

Scored like passkey and copy: teacher-forced argmax on the answer bytes, a sample solved only when every answer
byte is the argmax (exactly when greedy decoding would produce the whole answer); per-byte accuracy beside it.
The same samples are drawn at a length for every model: generated from (seed, length, task).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from posenc.data.retrieval import RETRIEVAL_TASKS
from posenc.evaluate.tasks import _score_in_batches


@torch.no_grad()
def evaluate_retrieval(
    model: nn.Module,
    task: str,
    lengths: Sequence[int],
    samples: int,
    seed: int,
    tokens_per_batch: int = 16384,
    device: torch.device | str | None = None,
) -> list[dict[str, Any]]:
    """Exact-match and per-byte answer accuracy of ``task`` at every length, ``samples`` samples each."""
    generate = RETRIEVAL_TASKS[task]
    device = device or next(model.parameters()).device
    task_index = list(RETRIEVAL_TASKS).index(task)
    rows = []
    for length in lengths:
        rng = np.random.default_rng([seed, length, task_index])
        batch = [generate(length, rng) for _ in range(samples)]
        exact, token = _score_in_batches(model, batch, length, tokens_per_batch, device)
        rows.append({"task": task, "length": length, "samples": samples, "accuracy": exact, "token_accuracy": token})
    return rows


def evaluate_retrieval_tasks(
    model: nn.Module,
    eval_cfg: dict[str, Any],
    trained_task: str | None,
    lengths_for: Callable[[Sequence[float]], list[int]],
    tokens_per_batch: int,
) -> dict[str, list[dict[str, Any]]]:
    """{task: rows} for every retrieval task enabled in ``eval_cfg`` (``auto``: the task the model trained on).

    ``lengths_for(multiples)`` turns a task's length multiples into the lengths the model supports.
    """
    seed = int(eval_cfg.get("seed", 1234))
    out = {}
    for task in RETRIEVAL_TASKS:
        options = eval_cfg.get(task) or {}
        enabled = options.get("enabled", "auto")
        if enabled is True or (enabled == "auto" and trained_task == task):
            lengths = lengths_for(options["multiples"])
            out[task] = evaluate_retrieval(model, task, lengths, options["samples"], seed, tokens_per_batch)
    return out
