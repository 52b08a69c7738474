"""End to end: a few training steps per scheme through the real config, checkpoints and final evaluation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import FAST, compose_train, fitting

from posenc.config import encoding_choices
from posenc.runs.loggers import resolve_wandb_mode
from posenc.train import train
from posenc.training.lit import LitDecoder, warmup_cosine


def strict_json(path: Path) -> dict:
    """Parse as a non-Python JSON reader would: NaN / Infinity are errors."""

    def refuse(token: str) -> None:
        raise ValueError(f"{path.name} holds {token}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.mark.parametrize("name", encoding_choices())
def test_three_steps_per_scheme(name: str, tmp_path: Path) -> None:
    summary = train(compose_train(*fitting(name, *FAST)), tmp_path)
    assert summary["steps"] == 3
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()
    saved = strict_json(tmp_path / "run.json")
    assert saved["data"]["fingerprint"] and saved["label"] == summary["label"]
    results = strict_json(tmp_path / "eval" / "results.json")
    evals = {row["length"]: row for row in results["perplexity"]}
    assert sorted(evals) == [16, 32, 64]
    if name == "learned":  # a table of 16 rows cannot score 32 or 64 positions, and says so
        assert evals[32]["error"] and evals[64]["error"] and evals[16]["ppl"] > 1
        assert evals[32]["ppl"] is None  # no perplexity: null, not the non-JSON token NaN
    else:
        assert all(row["ppl"] > 1 and row["error"] is None for row in evals.values())


def test_run_records_the_training_loops_throughput_without_evaluation(tmp_path: Path) -> None:
    """The cost plot compares schemes by ``tokens_per_sec``: the loop's time alone, not the 32x evaluation's."""
    summary = train(compose_train("+encoding=alibi", *FAST), tmp_path)
    saved = strict_json(tmp_path / "run.json")
    assert saved["tokens_per_sec"] == summary["tokens_per_sec"]
    loop = saved["train_loop_seconds"]
    assert 0 < loop < saved["train_seconds"]
    assert saved["tokens_per_sec"] == pytest.approx(saved["tokens"] / loop)
    assert saved["tokens_per_sec"] > saved["tokens"] / saved["train_seconds"]
    assert saved["train_conditions"]["resolved"] == {"alibi": "sdpa"}  # what attention=auto trained with on CPU


def test_checkpoint_restores_the_model(tmp_path: Path) -> None:
    train(compose_train("+encoding=kerple_log", *FAST), tmp_path)
    restored = LitDecoder.load_from_checkpoint(tmp_path / "checkpoints" / "last.ckpt")
    assert restored.model.label == "kerple_log"
    assert torch.all(restored.model.layer_encodings[0].r1 >= 0.01)


def test_csv_logger_records_metrics(tmp_path: Path) -> None:
    overrides = [o for o in FAST if not o.startswith("logger")] + ["logger=csv", "trainer.log_every_n_steps=1"]
    train(compose_train("+encoding=alibi", *overrides), tmp_path)
    header = (tmp_path / "csv" / "metrics.csv").read_text().splitlines()[0]
    names = ("train/loss", "train/ppl", "val/loss", "val/ppl", "lr-AdamW/weights", "eval/nonoverlap/ppl@002x")
    for column in (*names, "eval/nonoverlap/ppl_ratio@004x"):
        assert column in header


def test_wandb_logs_offline_into_the_run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    assert resolve_wandb_mode("auto") == "offline"
    overrides = [o for o in FAST if not o.startswith("logger")] + ["logger=wandb"]
    train(compose_train("+encoding=alibi", *overrides), tmp_path)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


def test_cli_runs_end_to_end(tmp_path: Path) -> None:
    env = {**os.environ, "WANDB_MODE": "disabled"}
    cmd = [sys.executable, "-m", "posenc.train", "+encoding=alibi", *FAST]
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Perplexity of alibi trained at L=16" in result.stdout
    run_dirs = list((tmp_path / "outputs" / "runs" / "alibi-L16-s0").iterdir())
    assert len(run_dirs) == 1 and (run_dirs[0] / ".hydra" / "config.yaml").exists()
    # logger=none: the console alone says where the run went, first, and where its results are, last
    run = run_dirs[0].relative_to(tmp_path)  # as typed from where the command ran
    lines = result.stdout.splitlines()
    assert lines[0] == f"run alibi-L16-s0: {run}"
    assert lines[-1] == f"done: results in {run}/eval/results.json; no plots (eval.plots=false); {run}/run.json"


def test_warmup_cosine_schedule() -> None:
    assert warmup_cosine(0, 10, 100, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(9, 10, 100, 0.1) == pytest.approx(1.0)
    assert warmup_cosine(55, 10, 100, 0.1) == pytest.approx(0.55)
    assert warmup_cosine(100, 10, 100, 0.1) == pytest.approx(0.1)
