"""Composing the project's configs the way the CLI does, for tests."""

from __future__ import annotations

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
    "final_eval.max_tokens=256",
]


def compose_train(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))
