"""The notebook API: ``posenc.load_run`` gives back the trained model and its config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import FAST, compose_train

import posenc
from posenc.model import Decoder
from posenc.runs import load_module
from posenc.train import train


def test_load_run_returns_the_trained_decoder_and_config(tmp_path: Path) -> None:
    train(compose_train("+encoding=rope_alibi", *FAST), tmp_path)
    model, config = posenc.load_run(tmp_path)
    assert isinstance(model, Decoder) and not model.training and config["encoding"]["name"] == "rope+alibi"
    trained, _ = load_module(tmp_path / "checkpoints" / "last.ckpt", "cpu", None)
    tokens = torch.randint(0, 256, (1, 40))
    with torch.no_grad():
        assert torch.equal(model(tokens), trained.model(tokens))
    assert model.generate(tokens, 5, temperature=0).shape == (1, 45)
    assert model.attention_maps(tokens, layer=-1).shape == (1, 4, 40, 40)
    same, _ = posenc.load_run(tmp_path / "checkpoints" / "last.ckpt", attention="eager")
    assert same.blocks[0].attn.backend_name == "eager"


def test_load_run_refuses_what_is_not_a_run(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="neither a run directory nor a checkpoint"):
        posenc.load_run(tmp_path / "missing")
    with pytest.raises(SystemExit, match="no checkpoint at"):
        posenc.load_run(tmp_path)
    with pytest.raises(AttributeError, match="no attribute 'load_runs'"):
        posenc.load_runs  # noqa: B018 - the attribute access is the test
