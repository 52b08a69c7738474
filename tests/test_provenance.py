"""Results know their provenance, and the report never puts unlike runs side by side unflagged.

An interrupted run evaluated later says so (a warning, ``training.finished`` false in results.json), the report
leaves it out unless asked and lists it apart; every column shows its steps and tokens, settings that differ
across schemes are named above the table, and an appendix names the run directories of every column. A
re-evaluation with other settings writes beside the earlier one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import FAST, compose_train

from posenc.report import build_report, find_results
from posenc.report.common import by_setting
from posenc.runs import CHECKPOINT, DONE_FILE
from posenc.train import train

ROOT = Path(__file__).resolve().parent.parent


def _evaluate(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``posenc.evaluate`` with the settings the runs were evaluated with at the end of training, then ``args``."""
    same = [o for o in FAST if o.startswith("eval.") and o != "eval.plots=false"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's posenc, from any working directory
    command = [sys.executable, "-m", "posenc.evaluate", *same, *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)


def _interrupt(run_dir: Path, max_steps: int) -> None:
    """Make ``run_dir`` what Ctrl-C leaves: a checkpoint short of ``trainer.max_steps``, no done.json."""
    path = run_dir / CHECKPOINT
    state = torch.load(path, weights_only=False)
    state["hyper_parameters"]["config"]["trainer"]["max_steps"] = max_steps
    torch.save(state, path)
    (run_dir / DONE_FILE).unlink()
    shutil.rmtree(run_dir / "eval", ignore_errors=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    dirs = {}
    for name, steps in (("t5", 3), ("rope", 2), ("kerple_log", 2)):
        dirs[name] = root / name
        train(compose_train(f"+encoding={name}", *FAST, f"trainer.max_steps={steps}"), dirs[name])
    _interrupt(dirs["t5"], max_steps=100)
    return dirs


def test_evaluating_an_unfinished_run_warns_and_records_it(runs: dict[str, Path], tmp_path: Path) -> None:
    done = _evaluate(str(runs["t5"]), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "unfinished" in warnings[0] and "step 3 of trainer.max_steps=100" in warnings[0]
    training = json.loads((runs["t5"] / "eval" / "results.json").read_text())["training"]
    assert training["steps"] == 3 and training["checkpoint_step"] == 3 and training["max_steps"] == 100
    assert training["finished"] is False and training["tokens"] == 3 * 4 * 16  # steps × batch × seq_len
    finished = json.loads((runs["rope"] / "eval" / "results.json").read_text())["training"]
    assert finished == {**finished, "steps": 2, "finished": True, "tokens": 2 * 4 * 16, "checkpoint_step": 2}


def test_report_leaves_unfinished_runs_out_and_flags_what_differs(runs: dict[str, Path], tmp_path: Path) -> None:
    if not (runs["t5"] / "eval").exists():
        _evaluate(str(runs["t5"]), cwd=tmp_path)
    markdown = build_report(find_results(runs.values()), tmp_path / "report", make_plots=False)
    header = next(line for line in markdown.splitlines() if line.startswith("| length |"))
    assert "t5" not in header  # unfinished: not a column ...
    assert "## Unfinished runs (1," in markdown and f"trained to step 3 of 100 ({runs['t5']})" in markdown
    assert "rope (n=1 · 2 steps · 128 tokens)" in header and "kerple_log‡ (n=1 · 2 steps · 128 tokens)" in header
    appendix = markdown.split("## Appendix: the runs in each column")[1]
    assert f"- rope: {runs['rope']}" in appendix and f"- kerple_log: {runs['kerple_log']}" in appendix

    everything = build_report(find_results(runs.values()), tmp_path / "all", False, include_unfinished=True)
    header = next(line for line in everything.splitlines() if line.startswith("| length |"))
    assert "t5‡ (n=1 · 3 steps · 192 tokens)" in header  # ... unless asked, and then with its steps
    flagged = next(line for line in everything.splitlines() if "differ in more than their scheme" in line)
    assert "trainer.max_steps=100 in t5; trainer.max_steps=2 in the other 2" in flagged


def test_a_difference_is_said_by_setting_naming_only_the_columns_that_differ() -> None:
    differ = {
        "alibi": {"eval.attention_scale": None, "model.depth": 4},
        "gemma3": {"eval.attention_scale": None, "model.depth": 6},
        "irope": {"eval.attention_scale": None, "model.depth": 4},
        "irope · llama4": {"eval.attention_scale": "llama4", "model.depth": 4},
    }
    assert by_setting(differ) == (
        "eval.attention_scale=llama4 in irope · llama4; eval.attention_scale=None in the other 3; "
        "model.depth=6 in gemma3; model.depth=4 in the other 3"
    )


def test_reevaluation_with_other_settings_writes_beside_the_first(runs: dict[str, Path], tmp_path: Path) -> None:
    first = (runs["rope"] / "eval" / "results.json").read_text()
    done = _evaluate(str(runs["rope"]), "eval.max_tokens=128", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (runs["rope"] / "eval" / "results.json").read_text() == first  # the end-of-training evaluation stays
    beside = json.loads((runs["rope"] / "eval_max_tokens128" / "results.json").read_text())
    assert beside["eval"]["max_tokens"] == 128
    same = _evaluate(str(runs["rope"]), "eval.plots=true", cwd=tmp_path)
    assert same.returncode == 0 and "wrote " + str(runs["rope"] / "eval") + "/results.json" in same.stdout
