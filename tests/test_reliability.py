"""Findings of the reliability probe: report identity, divergence, failed sweep jobs, damaged files, re-evaluation."""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import FAST, HostReads, compose_train
from omegaconf import OmegaConf

import posenc.model
import posenc.training.lit
from posenc.data.cache import tokenized_splits
from posenc.data.corpora import Corpus
from posenc.data.tokenizer import ByteTokenizer
from posenc.report import ReportOnSweepEnd, build_report, find_results
from posenc.runs import (
    CHECKPOINT,
    DONE_FILE,
    FAILED_FILE,
    PREVIOUS_CHECKPOINT,
    RunError,
    read_checkpoint,
    wandb_id,
    write_failed,
)
from posenc.train import train
from posenc.training.sweep import job_state


def _config(seed: int, max_steps: int = 40, corpus: str = "stdlib", **eval_options) -> dict:
    return {
        "encoding": {"name": "alibi"},
        "model": {"dim": 64, "depth": 2, "heads": 4},
        "data": {"corpus": corpus, "seq_len": 64, "batch_size": 32, "cache_dir": f"/cache{seed}"},
        "trainer": {"max_steps": max_steps},
        "optim": {"lr": 2e-3},
        "seed": seed,
        "run_name": f"alibi-L64-s{seed}",
        "logger": {"kind": "csv"},
        "eval": eval_options,
    }


def _result(folder: Path, config: dict | None, ppl: float, fingerprint: str = "stdlib-fp", **eval_options) -> None:
    rows = [
        {
            "length": 64 * m,
            "mode": "nonoverlap",
            "stride": None,
            "tokens": 4096,
            "loss": math.log(ppl),
            "ppl": ppl * m,
            "bpb": 1.0,
            "error": None,
            "multiple": m,
            "ratio": float(m),
            "loss_by_position": None,
        }
        for m in (1, 2)
    ]
    result = {
        "label": "alibi",
        "train_len": 64,
        "seed": 0 if config is None else config["seed"],
        "data": {"corpus": "stdlib", "fingerprint": fingerprint},
        "eval": {"mode": "nonoverlap", "stride": None, "multiples": [1, 2], "plots": False, **eval_options},
        "perplexity": rows,
        "loss_by_position": {},
    }
    if config is not None:
        result["config"] = config
    (folder / "eval").mkdir(parents=True)
    (folder / "eval" / "results.json").write_text(json.dumps(result))


def _header(markdown: str) -> str:
    return next(line for line in markdown.splitlines() if line.startswith("| length |"))


def test_report_pools_only_runs_that_differ_in_their_seed(tmp_path: Path) -> None:
    _result(tmp_path / "a0", _config(0), 10.0)
    _result(tmp_path / "a1", _config(1), 12.0)
    _result(tmp_path / "short", _config(0, max_steps=30), 30.0)
    _result(tmp_path / "text", _config(0, corpus="text"), 50.0, fingerprint="text-fp")
    _result(tmp_path / "yarn", _config(0), 20.0, rope_scaling="yarn")
    _result(tmp_path / "factor", _config(0), 25.0)
    recorded = json.loads((tmp_path / "factor" / "eval" / "results.json").read_text())
    recorded["rope_scaling_factor"] = 8  # an evaluation-time option recorded beside the run info
    (tmp_path / "factor" / "eval" / "results.json").write_text(json.dumps(recorded))
    markdown = build_report(find_results([tmp_path]), tmp_path / "report", make_plots=False)
    header = _header(markdown)
    assert "| alibi (n=2 ·" not in header  # the four configurations are never one column
    columns = [cell.strip() for cell in header.strip("|").split("|")[2:]]
    assert len(columns) == 5, columns
    assert any("rope_scaling_factor=8" in c for c in columns), columns
    assert any("max_steps=40" in c and "(n=2 ·" in c for c in columns), columns
    assert any("max_steps=30" in c and "(n=1 ·" in c for c in columns), columns
    assert any("data=text" in c for c in columns), columns
    assert any("rope_scaling=yarn" in c for c in columns), columns
    assert "differ only in their seed" in markdown
    # the two seeds of one configuration (10, 12), pooled over seeds alone (no documents recorded): exp of the mean
    # log perplexity and of its t interval, t_{0.975,1} · s/√2 with s the two logs' standard deviation
    mean, half = math.log(120) / 2, 12.706205 * abs(math.log(12 / 10)) / 2
    assert f"{math.exp(mean):.2f} [{math.exp(mean - half):.2f}, {math.exp(mean + half):.2f}]ᵗ" in markdown


def test_report_reads_an_older_runs_config_and_fills_its_defaults(tmp_path: Path) -> None:
    _result(tmp_path / "new", _config(1) | {"checkpoint_every_n_steps": 5, "sweep_name": "x"}, 12.0)
    older = _config(0)
    del older["optim"]["lr"]  # not recorded then: the project's default (2e-3) is what it ran with
    _result(tmp_path / "old", None, 10.0)
    (tmp_path / "old" / DONE_FILE).write_text(json.dumps({"config": older}))
    markdown = build_report(find_results([tmp_path]), tmp_path / "report", make_plots=False)
    assert "| length | ×L | alibi (n=2 · ? steps · ? tokens) |" in markdown


def test_report_lists_failed_runs_apart_and_never_counts_them(tmp_path: Path) -> None:
    _result(tmp_path / "a0", _config(0), 10.0)
    _result(tmp_path / "a1", _config(1), 12.0)
    diverged = tmp_path / "a2"
    diverged.mkdir()
    write_failed(diverged, _config(2), "the training loss became nan at step 3", 3)
    nan_run = tmp_path / "a3"  # an older run that went on after NaN: null perplexities, no error
    _result(nan_run, _config(3), 10.0)
    results = json.loads((nan_run / "eval" / "results.json").read_text())
    for row in results["perplexity"]:
        row["ppl"] = None
    (nan_run / "eval" / "results.json").write_text(json.dumps(results))
    markdown = build_report(find_results([tmp_path]), tmp_path / "report", make_plots=False)
    assert "| length | ×L | alibi (n=2 · ? steps · ? tokens) |" in markdown
    assert "## Failed runs (2, not counted in any column)" in markdown
    assert "- alibi-L64-s2: the training loss became nan at step 3" in markdown


def test_sweep_end_reports_failed_jobs_with_a_nonzero_exit(tmp_path: Path) -> None:
    _result(tmp_path / "a0", _config(0), 10.0)
    (tmp_path / "a1").mkdir()
    write_failed(tmp_path / "a1", _config(1), "the training loss became nan at step 3", 3)
    with pytest.raises(SystemExit, match=r"1 job\(s\) of this sweep failed \(alibi-L64-s1\)"):
        ReportOnSweepEnd().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    assert "Failed runs" in (tmp_path / "report.md").read_text()


def test_a_failed_job_is_retried_not_skipped(tmp_path: Path) -> None:
    config = _config(0)
    write_failed(tmp_path, config, "the training loss became nan at step 3", 3)
    state = job_state(tmp_path, config)
    assert not state.finished and state.failed and "retrying" in state.action


def test_report_skips_a_corrupt_results_file_and_names_it(tmp_path: Path) -> None:
    _result(tmp_path / "good", _config(0), 10.0)
    (tmp_path / "bad" / "eval").mkdir(parents=True)
    (tmp_path / "bad" / "eval" / "results.json").write_text('{"label": "alibi", "perplex')
    unreadable: list[str] = []
    results = find_results([tmp_path], unreadable)
    assert len(results) == 1 and str(tmp_path / "bad" / "eval" / "results.json") in unreadable[0]


def _nan_from_call(monkeypatch: pytest.MonkeyPatch, call: int) -> None:
    loss, calls = posenc.model.Decoder.loss, []

    def poisoned(self, inputs, targets):
        value = loss(self, inputs, targets)
        if self.training:
            calls.append(1)
            if len(calls) >= call:
                return value * float("nan")
        return value

    monkeypatch.setattr(posenc.model.Decoder, "loss", poisoned)


def test_a_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _nan_from_call(monkeypatch, 4)  # steps 0-2 train, the loss of step 3 is NaN
    overrides = [*FAST, "trainer.max_steps=6", "checkpoint_every_n_steps=2", "trainer.val_check_interval=100"]
    with pytest.raises(RunError, match=r"training diverged: the training loss became nan at step 3; the last good"):
        train(compose_train("+encoding=alibi", *overrides), tmp_path)
    assert not (tmp_path / DONE_FILE).exists() and not (tmp_path / "eval").exists()
    assert json.loads((tmp_path / FAILED_FILE).read_text())["step"] == 3
    assert read_checkpoint(tmp_path / "checkpoints" / "last.ckpt")[0] == 2


def test_the_last_step_is_saved_when_the_checkpoint_interval_does_not_divide_it(tmp_path: Path) -> None:
    # Checkpoints every 2 steps of 5: steps 2 and 4 by the interval, and the weights training ended with, which a
    # re-evaluation or a fine-tune reads; step 4 stays behind them as the fallback of an unreadable last.ckpt.
    overrides = [*FAST, "trainer.max_steps=5", "checkpoint_every_n_steps=2", "eval.at_end=false"]
    train(compose_train("+encoding=alibi", *overrides), tmp_path)
    assert read_checkpoint(tmp_path / CHECKPOINT)[0] == 5
    assert read_checkpoint(tmp_path / PREVIOUS_CHECKPOINT)[0] == 4


def test_a_nan_found_at_a_later_check_is_reported_at_its_step_and_never_checkpointed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As on a GPU, where the record of a non-finite loss is read every few steps: the NaN of step 3 is found at the
    # check after step 4's checkpoint would have been written, so that checkpoint must be refused.
    monkeypatch.setattr(posenc.training.lit, "finite_check_interval", lambda device, log_every: 5)
    _nan_from_call(monkeypatch, 4)
    overrides = [*FAST, "trainer.max_steps=8", "checkpoint_every_n_steps=2", "trainer.val_check_interval=100"]
    with pytest.raises(RunError, match=r"the training loss became nan at step 3; the last good"):
        train(compose_train("+encoding=alibi", *overrides), tmp_path)
    assert json.loads((tmp_path / FAILED_FILE).read_text())["step"] == 3
    assert read_checkpoint(tmp_path / "checkpoints" / "last.ckpt")[0] == 2


def test_a_training_step_reads_nothing_back_to_the_host_between_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    from posenc.training.lit import LitDecoder

    config = OmegaConf.to_container(compose_train("+encoding=alibi", *FAST), resolve=True)
    module = LitDecoder(config, vocab_size=257)
    module.log_dict = lambda *args, **kwargs: None  # Lightning's logging is its own business
    module.check_every = 50
    batch = (torch.randint(0, 257, (2, 16)), torch.randint(0, 257, (2, 16)))
    loss = module.model.loss(*batch)  # the model's own forward is not what this test reads
    loss.backward(retain_graph=True)
    module.model.loss = lambda inputs, targets: loss
    reads = HostReads(monkeypatch)
    module.training_step(batch, 0)
    module.on_before_optimizer_step(None)
    module.on_train_batch_end(loss, batch, 0)  # global_step 0 is a check step: step 1 is not
    assert reads.calls == ["__int__"], reads.calls  # the one check
    reads.calls.clear()
    module.training_step(batch, 1)
    module.on_before_optimizer_step(None)
    assert reads.calls == [], reads.calls


def test_an_infinite_gradient_stops_the_run(tmp_path: Path) -> None:
    with pytest.raises(RunError, match=r"a gradient became non-finite at step \d"):
        train(compose_train("+encoding=alibi", *FAST, "optim.lr=1e4", "trainer.max_steps=8"), tmp_path)
    assert (tmp_path / FAILED_FILE).exists() and not (tmp_path / DONE_FILE).exists()


def test_ctrl_c_saves_a_checkpoint_and_prints_how_to_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    loss, calls = posenc.model.Decoder.loss, []

    def interrupted(self, inputs, targets):
        calls.append(self.training)
        if sum(calls) == 3:  # the third training step
            raise KeyboardInterrupt
        return loss(self, inputs, targets)

    monkeypatch.setattr(posenc.model.Decoder, "loss", interrupted)
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit):
            train(compose_train("+encoding=alibi", *FAST, "trainer.max_steps=6"), tmp_path, "python -m posenc.train X")
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores Ctrl-C while it shuts down
    assert read_checkpoint(tmp_path / "checkpoints" / "last.ckpt")[0] == 2
    assert "interrupted at step 2" in capsys.readouterr().out
    assert not (tmp_path / DONE_FILE).exists()


def test_a_resumed_run_continues_its_csv_metrics_and_wandb_id(tmp_path: Path) -> None:
    overrides = [o for o in FAST if not o.startswith("logger")] + ["logger=csv", "trainer.log_every_n_steps=1"]
    train(compose_train("+encoding=alibi", *overrides, "checkpoint_every_n_steps=2"), tmp_path)
    (tmp_path / DONE_FILE).unlink()
    train(compose_train("+encoding=alibi", *overrides, "trainer.max_steps=5", "resume=last"), tmp_path)
    with (tmp_path / "csv" / "metrics.csv").open() as handle:
        steps = sorted({int(row["step"]) for row in csv.DictReader(handle) if row.get("train/loss")})
    assert steps == [0, 1, 2, 3, 4]  # the first launch's steps are kept, none twice
    assert wandb_id(tmp_path) == wandb_id(tmp_path)


def test_a_damaged_token_cache_is_rebuilt_and_orphans_removed(tmp_path: Path) -> None:
    corpus = Corpus("tiny", {"train": [b"a" * 500], "validation": [b"b" * 200], "test": [b"c" * 200]})
    tokenizer = ByteTokenizer()
    tokenized_splits(corpus, tokenizer, tmp_path)
    folder = next(tmp_path.iterdir())
    (folder / "train.bin").write_bytes((folder / "train.bin").read_bytes()[:100])  # truncated
    orphan = folder / ".train.bin.abc.tmp"
    orphan.write_bytes(b"x")
    os.utime(orphan, (0, 0))
    again = tokenized_splits(corpus, tokenizer, tmp_path)
    expected = tokenizer.concat(corpus.documents["train"])
    assert np.array_equal(np.asarray(again["train"]), expected) and not orphan.exists()


def _cli(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True, timeout=300, env=os.environ
    )


def test_learned_reevaluated_from_its_own_directory_replaces_eval_and_run_json(tmp_path: Path) -> None:
    plots = [o for o in FAST if not o.startswith("eval.plots")] + ["eval.plots=true"]
    trained = _cli("posenc.train", "+encoding=learned", *plots, cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-2000:]
    (run_dir,) = (tmp_path / "outputs" / "runs" / "learned-L16-s0").iterdir()
    assert "Perplexity of learned trained at L=16" in (run_dir / "train.log").read_text()
    assert "ppl@1x" in json.loads((run_dir / "run.json").read_text())["eval"]
    assert (run_dir / "eval" / "ppl_vs_length.png").exists()
    same = ["eval.max_tokens=256", "eval.multiples=[1,2,4]"]  # the settings of the end-of-training evaluation
    again = _cli("posenc.evaluate", str(run_dir), *same, "eval.plots=false", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    written = {p.name for p in (run_dir / "eval").iterdir()}
    assert "results.json" in written and not any(name.endswith(".png") for name in written)  # old plots gone
    summary = json.loads((run_dir / "run.json").read_text())["eval"]
    assert summary == json.loads((run_dir / "eval" / "results.json").read_text())["summary"]
    other = _cli("posenc.evaluate", str(run_dir), "eval.max_tokens=256", "eval.multiples=[1]", cwd=tmp_path)
    assert other.returncode == 0, other.stderr[-2000:]
    results = json.loads((run_dir / "eval_multiples1" / "results.json").read_text())  # other settings: beside
    assert [row["length"] for row in results["perplexity"]] == [16]
    assert json.loads((run_dir / "run.json").read_text())["eval"] == summary  # run.json follows eval/ only


def test_sweep_configs_are_found_from_any_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from posenc.config import CONF_DIR
    from posenc.train import _config_dir

    monkeypatch.chdir(tmp_path)
    assert _config_dir("sweeps") == str(CONF_DIR.parent / "sweeps")  # `-cd sweeps` outside the repository
    (tmp_path / "sweeps").mkdir()
    assert _config_dir("sweeps") == "sweeps"  # a directory of that name here wins
