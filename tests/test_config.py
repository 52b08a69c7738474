"""Every config composes, and the CLI's contract: `+encoding=<name>` required, one-line error without it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import compose_train, fitting
from omegaconf import OmegaConf

from posenc.config import CONF_DIR, encoding_choices, to_container
from posenc.encodings import available
from posenc.encodings.length import coverage
from posenc.model import Decoder
from posenc.runs import resolve_length_settings

GROUPS = {group.name: sorted(p.stem for p in group.glob("*.yaml")) for group in CONF_DIR.iterdir() if group.is_dir()}


def test_every_scheme_has_a_config() -> None:
    assert set(available()) <= set(encoding_choices())
    assert {"rnope", "rope_alibi"} <= set(encoding_choices())


@pytest.mark.parametrize("name", encoding_choices())
def test_every_encoding_config_builds_a_model(name: str) -> None:
    """Built as a run builds it, at two lengths: its length settings scaled, every positional parameter reached."""
    for seq_len in (64, 128):
        cfg = resolve_length_settings(to_container(compose_train(*fitting(name, f"data.seq_len={seq_len}"))))
        model = Decoder(encoding=cfg["encoding"], vocab_size=257, attention=cfg["attention"]["name"], **cfg["model"])
        assert model.label == cfg["run_name"].split("-L")[0]
        assert coverage(model, seq_len)["gaps"] == [], f"{name} at L={seq_len} leaves parameters untrained"
        assert all(entry["rule"] != "given" or entry["value"] is not None for entry in cfg["length_settings"].values())


@pytest.mark.parametrize(
    ("group", "option"),
    [(g, o) for g, options in GROUPS.items() if g not in ("encoding",) for o in options],
)
def test_every_group_option_composes(group: str, option: str) -> None:
    cfg = compose_train("+encoding=alibi", f"{group}={option}")
    if group == "data" and option == "text":
        assert OmegaConf.is_missing(cfg.data.corpus_options, "paths")
        return
    to_container(cfg)


def test_required_groups_exist() -> None:
    assert {"encoding", "model", "data", "trainer", "logger", "attention"} <= set(GROUPS)
    assert {"tiny", "small"} <= set(GROUPS["model"])
    assert {"wandb", "csv", "none"} <= set(GROUPS["logger"])
    assert {"auto", "eager", "sdpa", "flex"} <= set(GROUPS["attention"])


def test_run_names_are_readable() -> None:
    assert compose_train("+encoding=rnope").run_name == "rope×3,nope-L64-s0"
    # A text run and a task run of one scheme never share a directory.
    assert compose_train("+encoding=alibi", "data=passkey").run_name == "alibi-passkey-L64-s0"
    assert compose_train("+encoding=alibi", "data=text").run_name == "alibi-L64-s0"
    assert compose_train("+encoding=rope_alibi", "seed=2").run_name == "rope+alibi-L64-s2"


def test_small_model_is_the_papers_size() -> None:
    cfg = compose_train("+encoding=alibi", "model=small")
    assert (cfg.model.depth, cfg.model.dim, cfg.model.heads) == (12, 768, 12)


def test_missing_scheme_gives_one_line_and_writes_nothing(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "posenc.train"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "+encoding=<name>" in lines[0] and "alibi" in lines[0] and "rnope" in lines[0]
    assert not (tmp_path / "outputs").exists()
