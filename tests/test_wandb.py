"""W&B as a user browses it, read back from an offline run: the config once, every metric once under its
protocol's keys (eval/nonoverlap/ppl@004x, multiples zero-padded to sort), named learning rates, charts and images on
separate keys, loss by position for every length; a re-evaluation and a resumed run continue the run's own W&B run
(resumed by id) and its history (W&B's step never restarts at 0); a side evaluation logs under keys of its own, with
its settings in the config, and leaves the run's own evaluation's keys alone."""

from __future__ import annotations

import contextlib
import io
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

from posenc.evaluate import sortable
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


def _steps(folder: Path) -> list[int]:
    """W&B's step of every history row of an offline run directory."""
    (path,) = folder.glob("*.wandb")
    rows = [r.history for r in _records(path) if r.WhichOneof("record_type") == "history"]
    return [
        int(json.loads(item.value_json))
        for row in rows
        for item in row.item
        if (item.key or "/".join(item.nested_key)) == "_step"
    ]


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


OVERRIDES = [o for o in FAST if o not in ("logger=none", "eval.plots=false")] + ["logger=wandb"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """An offline W&B run of a learnable scheme (three learning-rate groups), and what its console showed."""
    folder = tmp_path_factory.mktemp("wandb_run")
    console = io.StringIO()
    with (
        pytest.MonkeyPatch.context() as patch,
        contextlib.redirect_stdout(console),
        contextlib.redirect_stderr(console),
    ):
        patch.setenv("WANDB_MODE", "offline")
        patch.delenv("WANDB_SILENT", raising=False)  # W&B's own warnings shown, as a user sees them
        train(compose_train("+encoding=kerple_log", *OVERRIDES, "trainer.log_every_n_steps=1"), folder)
    return folder, console.getvalue()


@pytest.fixture(scope="module")
def run_dir(trained: tuple[Path, str]) -> Path:
    return trained[0]


def test_console_names_the_run_and_its_results_and_no_wandb_warning(trained: tuple[Path, str]) -> None:
    folder, console = trained
    lines = console.splitlines()
    assert lines[0] == f"run kerple_log-L16-s0: {folder}"
    assert f"W&B is offline; the run is in {folder}/wandb" in console
    assert lines[-1] == f"done: results in {folder}/eval/results.json; 2 plot(s) beside them; {folder}/run.json"
    assert "anonymous" not in console and "WARNING" not in console, console


def test_offline_run_holds_the_config_once_and_every_metric_once(run_dir: Path) -> None:
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    run_id, config, summary = _read_run(offline)
    assert run_id == (run_dir / "wandb_id").read_text().strip()
    assert "config" not in config and config["encoding"]["name"] == "kerple_log"  # top level, once
    results = json.loads((run_dir / "eval" / "results.json").read_text())
    for key, value in results["summary"].items():
        assert summary[f"eval/nonoverlap/{sortable(key)}"] == pytest.approx(value)
        assert key not in summary and f"eval/{key}" not in summary  # not a second time outside the namespace
    assert sorted(k for k in summary if k.startswith("eval/nonoverlap/ppl@")) == [
        f"eval/nonoverlap/ppl@{m:03d}x" for m in (1, 2, 4)
    ]  # in numeric order as W&B lists them
    assert config["eval/nonoverlap"]["max_tokens"] == 256 and config["eval/nonoverlap"]["folder"] == "eval"
    # the learning rates by the name of their group, not lr-AdamW/pg1..pg3
    assert {"lr-AdamW/weights", "lr-AdamW/norms_and_biases", "lr-AdamW/scheme"} <= set(summary)
    assert not any(key.startswith("lr-AdamW/pg") for key in summary)
    assert _media(summary, "eval/nonoverlap/perplexity_table")["_type"] == "table-file"
    assert _media(summary, "eval/nonoverlap/plots/ppl_vs_length")["_type"] == "image-file"  # its own key
    assert _steps(offline) == [0, 1, 2, 3]  # W&B's step is the optimizer step
    by_position = _media(summary, "eval/nonoverlap/loss_by_position_table")
    assert by_position["_type"] == "table-file" and by_position["ncols"] == 3  # length, position, loss
    table = json.loads((offline / "files" / by_position["path"]).read_text())
    assert table["columns"] == ["length", "position", "loss"]
    assert {row[0] for row in table["data"]} == {16, 32, 64}  # every evaluated length


def test_a_side_evaluation_continues_the_runs_own_wandb_under_keys_of_its_own(run_dir: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline"}
    same = [o for o in FAST if o.startswith("eval.") and o != "eval.plots=false"]
    command = [sys.executable, "-m", "posenc.evaluate", str(run_dir), *same, "eval.max_tokens=128"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1].startswith(f"wrote {run_dir}/eval_max_tokens128/results.json")
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2
    run_id, config, summary = _read_run(runs[-1])
    assert run_id == (run_dir / "wandb_id").read_text().strip()  # the same W&B run, resumed
    beside = json.loads((run_dir / "eval_max_tokens128" / "results.json").read_text())["summary"]
    namespace = "eval/nonoverlap_max_tokens128"
    assert summary[f"{namespace}/ppl@001x"] == pytest.approx(beside["ppl@1x"])  # the folder's keys
    assert not any(
        key.startswith("eval/nonoverlap/") for key in summary
    )  # the run's own evaluation's stay as they were
    assert config[namespace]["max_tokens"] == 128 and config[namespace]["folder"] == "eval_max_tokens128"
    assert "eval/nonoverlap" not in config
    assert min(_steps(runs[-1])) > max(_steps(runs[0]))  # the history goes on past training's last step


def test_resumed_run_continues_its_wandb_history(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        train(compose_train("+encoding=kerple_log", *OVERRIDES, "trainer.max_steps=5", "resume=last"), run_dir)
    runs = sorted((run_dir / "wandb").glob("offline-run-*"), key=lambda folder: folder.stat().st_mtime)
    run_id, _, _ = _read_run(runs[-1])
    assert run_id == (run_dir / "wandb_id").read_text().strip()
    assert min(_steps(runs[-1])) >= 3 and max(_steps(runs[-1])) == 5  # from the checkpoint's step on, not from 0
