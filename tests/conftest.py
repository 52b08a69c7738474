"""Offline, isolated test environment: no W&B network, no HF hub, caches and outputs in tmp dirs."""

from __future__ import annotations

import os

import pytest
import torch

os.environ["WANDB_MODE"] = "disabled"
os.environ["WANDB_SILENT"] = "true"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

from posenc.encodings import available, build

HEADS, HEAD_DIM = 4, 8


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ["POSENC_CACHE"] = str(tmp_path_factory.mktemp("posenc-cache"))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def make(name: str, heads: int = HEADS, head_dim: int = HEAD_DIM, **cfg):
    """Build a scheme for tests, giving learned tables room for the lengths tests use."""
    if name == "learned":
        cfg.setdefault("max_positions", 512)
    return build(name, num_heads=heads, head_dim=head_dim, **cfg)


SCHEMES = available()
BIAS_SCHEMES = [n for n in SCHEMES if make(n).adds_bias]
# Position biases that are a function of i - j alone (FIRE's also depends on the query position past its threshold).
DISTANCE_BIAS_SCHEMES = [n for n in BIAS_SCHEMES if make(n).distance_only]
CONTENT_SCHEMES = [n for n in SCHEMES if make(n).adds_content_bias]
RELATIVE_SCHEMES = [n for n in SCHEMES if not make(n).absolute]
