"""W&B as a user browses it, read back from an offline run: the config once, every metric once under one
namespace, charts and images on separate keys, loss by position for every length, and a re-evaluation that lands
in the run's own W&B run (resumed by id) under its own namespace, agreeing with its files."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import FAST, compose_train
from wandb.proto import wandb_internal_pb2

from posenc.train import train

ROOT = Path(__file__).resolve().parent.parent
BLOCK, HEADER = 32 * 1024, 7  # the .wandb file is a LevelDB-style log of protobuf records


def _records(path: Path) -> Iterator[wandb_internal_pb2.Record]:
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, pending = 7, b""
    while position + HEADER <= len(data):
        if BLOCK - position % BLOCK < HEADER:  # a block's tail too short for a header is padding
            position += BLOCK - position % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + HEADER])
        if kind == 0 and length == 0:
            break
        chunk = data[position + HEADER : position + HEADER + length]
        position += HEADER + length
        pending = chunk if kind in (1, 2) else pending + chunk  # full or first piece, else middle or last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def _read_run(folder: Path) -> tuple[str, dict, dict]:
    """(run id, config, summary) of an offline run directory, each value as W&B holds it (JSON)."""
    (path,) = folder.glob("*.wandb")
    run_id, config, summary = "", {}, {}
    for record in _records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update if item.key})
        elif kind == "summary":
            for item in record.summary.update:  # a value may arrive by its path (nested_key), field by field
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return run_id, config, summary


def _media(summary: dict, key: str) -> dict:
    """A table's or image's summary entry, gathered from its fields (``key/_type``, ``key/path``...)."""
    return {name[len(key) + 1 :]: value for name, value in summary.items() if name.startswith(f"{key}/")}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("wandb_run")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        overrides = [o for o in FAST if o not in ("logger=none", "eval.plots=false")]
        train(compose_train("+encoding=alibi", *overrides, "logger=wandb"), folder)
    return folder


def test_offline_run_holds_the_config_once_and_every_metric_once(run_dir: Path) -> None:
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    run_id, config, summary = _read_run(offline)
    assert run_id == (run_dir / "wandb_id").read_text().strip()
    assert "config" not in config and config["encoding"] == {"name": "alibi"}  # top level, once
    results = json.loads((run_dir / "eval" / "results.json").read_text())
    for key, value in results["summary"].items():
        assert summary[f"eval/{key}"] == pytest.approx(value)
        assert key not in summary  # not a second time outside the namespace
    assert _media(summary, "eval/perplexity_table")["_type"] == "table-file"
    assert _media(summary, "eval/plots/ppl_vs_length")["_type"] == "image-file"  # the image has its own key
    by_position = _media(summary, "eval/loss_by_position_table")
    assert by_position["_type"] == "table-file" and by_position["ncols"] == 3  # length, position, loss
    table = json.loads((offline / "files" / by_position["path"]).read_text())
    assert table["columns"] == ["length", "position", "loss"]
    assert {row[0] for row in table["data"]} == {16, 32, 64}  # every evaluated length


def test_reevaluation_updates_the_runs_own_wandb_under_its_namespace(run_dir: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline"}
    same = [o for o in FAST if o.startswith("eval.") and o != "eval.plots=false"]
    command = [sys.executable, "-m", "posenc.evaluate", str(run_dir), *same, "eval.max_tokens=128"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2
    run_id, _, summary = _read_run(runs[-1])
    assert run_id == (run_dir / "wandb_id").read_text().strip()  # the same W&B run, resumed
    beside = json.loads((run_dir / "eval_max_tokens128" / "results.json").read_text())["summary"]
    assert summary["eval_max_tokens128/ppl@1x"] == pytest.approx(beside["ppl@1x"])
    assert not any(key.startswith("eval/") for key in summary)  # the end-of-training figures are not overwritten
