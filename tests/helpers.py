"""Composing the project's configs the way the CLI does, for tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from posenc.config import CONF_DIR

FAST = [
    "logger=none",
    "trainer.max_steps=3",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "data.batch_size=4",
    "data.seq_len=16",
    "data.val_windows=4",
    "eval.max_tokens=256",
    "eval.multiples=[1,2,4]",
    "eval.passkey.multiples=[1,2]",
    "eval.passkey.samples=4",
    "eval.passkey.depths=[0.0,1.0]",
    "eval.copy.multiples=[1,2]",
    "eval.copy.samples=4",
    "eval.plots=false",
]


def encoding_configs(heads: int, head_dim: int, declares: Callable[[Any], bool]) -> list[dict[str, Any]]:
    """The configs of conf/encoding, as a run reads them ({"name": ..., **options}), whose scheme ``declares``.

    Per-layer schedules are left out: each of their layers is a scheme of the registry.
    """
    from posenc.bench.step import encoding_spec
    from posenc.config import encoding_choices
    from posenc.encodings import build

    found = []
    for name in encoding_choices():
        spec = encoding_spec(name, 64)
        spec = dict(spec) if isinstance(spec, dict) else {"name": spec}
        options = {key: value for key, value in spec.items() if key != "name"}
        if not isinstance(spec["name"], str):
            continue
        if declares(build(spec["name"], num_heads=heads, head_dim=head_dim, **options)):
            found.append(spec)
    return found


def fitting(name: str, *overrides: str) -> list[str]:
    """``+encoding=<name>`` and the overrides, with the model's depth raised to a layout's length where it is longer.

    A layout longer than the model (Gemma 3's six layers over the tiny decoder's four) would lose a kind of layer and
    is refused; tests that train or build every config give it the depth it needs.
    """
    config = compose_train(f"+encoding={name}", *overrides)
    layers = config.encoding.name
    deeper = not isinstance(layers, str) and len(layers) > config.model.depth
    return [f"+encoding={name}", *overrides, *([f"model.depth={len(layers)}"] if deeper else [])]


def compose_train(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


class HostReads:
    """Counts what makes the host wait for a device: reading a tensor's value into Python."""

    READS = ("item", "tolist", "__bool__", "__int__", "__float__", "numpy")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        for name in self.READS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counting(name, original))

    def _counting(self, name, original):
        def read(tensor, *args, **kwargs):
            self.calls.append(name)
            return original(tensor, *args, **kwargs)

        return read
