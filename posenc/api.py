"""The notebook API: a trained run as a plain ``Decoder`` and its config, in one call.

    >>> model, config = posenc.load_run("outputs/runs/alibi-L64-s0/2026-01-01_00-00-00")
    >>> model.generate(prompt, max_new_tokens=64, temperature=0.8, top_k=20)
    >>> model.attention_maps(tokens, layer=0)  # (B, H, L, L)

Loading goes through the same checks as ``python -m posenc.evaluate`` (the checkpoint must be a posenc one and
match its run's config); the model comes back uncompiled, in eval mode, on ``device``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from posenc.model import Decoder
from posenc.runs import check_consistency, load_module, resolve_checkpoint


def load_run(path: str | Path, device: str = "cpu", attention: str | None = None) -> tuple[Decoder, dict[str, Any]]:
    """(trained ``Decoder``, the run's resolved config) from a run directory or a ``.ckpt`` file.

    ``attention`` swaps the attention backend (e.g. ``eager``); ``None`` keeps the one the run trained with.
    """
    checkpoint, run_dir = resolve_checkpoint(str(path))
    module, config = load_module(checkpoint, device, attention)
    check_consistency(config, run_dir, OmegaConf.create({}))
    return module.model, config
