"""The standalone evaluator, task training and the report, run end to end on small trained runs and fake records."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import FAST, compose_train

from posenc.report import build_report, find_results
from posenc.train import train


def _fake_result(label: str, seed: int, ppls: list[float], tmp: Path) -> None:
    rows = [
        {
            "length": 64 * m,
            "mode": "nonoverlap",
            "stride": None,
            "tokens": 4096,
            "loss": math.log(p),
            "ppl": p,
            "bpb": math.log2(p),
            "error": None,
            "multiple": m,
            "ratio": p / ppls[0],
            "loss_by_position": None,
        }
        for m, p in zip([1, 2, 4], ppls, strict=True)
    ]
    folder = tmp / f"{label}-s{seed}" / "eval"
    folder.mkdir(parents=True)
    result = {
        "label": label,
        "train_len": 64,
        "seed": seed,
        "perplexity": rows,
        "loss_by_position": {"256": [1.0] * 256},
    }
    (folder / "results.json").write_text(json.dumps(result))


def test_report_builds_the_expected_table(tmp_path: Path) -> None:
    _fake_result("alibi", 0, [10.0, 10.0, 10.0], tmp_path)
    _fake_result("alibi", 1, [12.0, 12.0, 13.0], tmp_path)
    _fake_result("sinusoidal", 0, [10.0, 40.0, 200.0], tmp_path)
    markdown = build_report(find_results([tmp_path]), tmp_path / "report")
    lines = markdown.splitlines()
    assert "| length | ×L | alibi (n=2 · ? steps · ? tokens) | sinusoidal (n=1 · ? steps · ? tokens) |" in lines

    # No loss per document recorded: over seeds only (ᵗ), exp of the mean log and of its 95% t interval over two seeds
    # (t = 12.706 at 1 degree of freedom: 12.706 · s / √2); ◆ the best at each length; a one-seed column shows its
    # value alone, and one shared seed is no test (no word).
    def over_seeds(a: float, b: float, digits: int) -> str:
        mean, half = (math.log(a) + math.log(b)) / 2, 12.706205 * abs(math.log(a / b)) / 2
        return f"{math.exp(mean):.{digits}f} [{math.exp(mean - half):.{digits}f}, {math.exp(mean + half):.{digits}f}]ᵗ"

    assert f"| 64 | 1 | {over_seeds(10, 12, 2)} | 10.00ᵗ ◆ |" in lines
    assert f"| 256 | 4 | {over_seeds(10, 13, 2)} ◆ | 200.00ᵗ |" in lines
    assert f"| 256 | 4 | {over_seeds(1.0, 13 / 12, 3)} ? | 20.000ᵗ |" in lines  # ratios (1, 13/12), 20: against 1
    assert (tmp_path / "report" / "report.md").exists()
    assert (tmp_path / "report" / "ppl_vs_length_L64_nonoverlap.png").stat().st_size > 0


def test_report_without_results_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"no results\.json found"):
        build_report(find_results([tmp_path]), tmp_path)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("run")
    train(compose_train("+encoding=alibi", *FAST), run_dir)
    return run_dir


def _evaluate(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "posenc.evaluate", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_standalone_evaluate_writes_results(trained_run: Path, tmp_path: Path) -> None:
    result = _evaluate(
        str(trained_run),
        "eval.multiples=[1,2]",
        "eval.mode=sliding",
        "eval.stride=8",
        "eval.max_tokens=512",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    saved = json.loads((trained_run / "eval_sliding_s8_multiples1-2_max_tokens512" / "results.json").read_text())
    assert saved["label"] == "alibi" and [r["length"] for r in saved["perplexity"]] == [16, 32]
    assert saved["precision"] == "32-true"  # trained on CPU in fp32: evaluated in it
    assert (trained_run / "eval_sliding_s8_multiples1-2_max_tokens512" / "ppl_vs_length.png").exists()
    assert list(tmp_path.iterdir()) == []  # nothing written to the working directory
    mask = os.umask(0)
    os.umask(mask)
    folder = trained_run / "eval_sliding_s8_multiples1-2_max_tokens512"
    assert folder.stat().st_mode & 0o777 == 0o777 & ~mask  # as mkdir makes it: collaborators read it as before


def test_lengths_the_sample_cannot_fill_are_said_in_results_and_on_the_console(
    trained_run: Path, tmp_path: Path
) -> None:
    result = _evaluate(str(trained_run), "eval.multiples=[1,100000]", "eval.max_tokens=256", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    saved = json.loads((trained_run / "eval_multiples1-100000" / "results.json").read_text())
    rows = {row["length"]: row for row in saved["perplexity"]}
    assert rows[16]["error"] is None and rows[1_600_000]["ppl"] is None
    assert rows[1_600_000]["error"].startswith("not evaluated: the sample holds")
    assert "1600000" in result.stdout and "raise eval.max_tokens" in result.stdout


def test_ctrl_c_during_an_evaluation_ends_in_one_line_and_keeps_the_folder(trained_run: Path, tmp_path: Path) -> None:
    before = (trained_run / "eval" / "results.json").read_bytes()
    evaluation = subprocess.Popen(
        [sys.executable, "-m", "posenc.evaluate", str(trained_run)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A suite started in the background (`pytest &`, nohup) hands its children SIGINT ignored, and Python then
        # never turns Ctrl-C into KeyboardInterrupt: give the child the default, as a terminal would.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert evaluation.stdout is not None
    started = evaluation.stdout.readline()
    assert started.startswith(f"evaluating {trained_run}"), started  # said at once, before the work
    evaluation.send_signal(signal.SIGINT)
    _, stderr = evaluation.communicate(timeout=120)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert evaluation.returncode == 1 and "Traceback" not in stderr, stderr
    assert len(lines) == 1 and lines[0].startswith("interrupted"), stderr
    assert f"{trained_run / 'eval'} is as it was" in lines[0] or "nothing was written" in lines[0]
    assert (trained_run / "eval" / "results.json").read_bytes() == before


def test_a_bf16_mixed_run_is_evaluated_in_bf16_mixed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The in-length figure must come from the precision training used, at the end of training and later from the
    # checkpoint; fp32 evaluation of a bf16-trained run would also refuse backends that need half precision.
    import posenc.model

    seen: list[torch.dtype] = []
    forward = posenc.model.Attention.forward

    def recording(self, x, pos, cache=None):
        if not torch.is_grad_enabled():
            seen.append(self.qkv(x).dtype)
        return forward(self, x, pos, cache)

    monkeypatch.setattr(posenc.model.Attention, "forward", recording)
    run_dir = tmp_path / "run"
    train(compose_train("+encoding=alibi", *FAST, "trainer.precision=bf16-mixed"), run_dir)
    results = json.loads((run_dir / "eval" / "results.json").read_text())
    assert results["precision"] == "bf16-mixed" and seen and set(seen) == {torch.bfloat16}
    from posenc.runs.checkpoints import load_module

    module, _ = load_module(run_dir / "checkpoints" / "last.ckpt", "cpu", None)
    assert module.hparams.precision == "bf16-mixed"


def test_evaluate_refuses_a_checkpoint_config_mismatch(trained_run: Path, tmp_path: Path) -> None:
    result = _evaluate(str(trained_run), "+encoding=rope", cwd=tmp_path)
    assert result.returncode != 0 and "checkpoint/config mismatch in 'encoding'" in result.stderr
    # A run directory whose config disagrees with the checkpoint inside it (a checkpoint copied across runs).
    other = tmp_path / "other"
    (other / ".hydra").mkdir(parents=True)
    (other / "checkpoints").mkdir()
    (other / "checkpoints" / "last.ckpt").write_bytes((trained_run / "checkpoints" / "last.ckpt").read_bytes())
    (other / ".hydra" / "config.yaml").write_text("encoding:\n  name: t5\nmodel:\n  dim: 128\n")
    result = _evaluate(str(other), cwd=tmp_path)
    assert result.returncode != 0 and "checkpoint/config mismatch in 'encoding'" in result.stderr


def test_evaluate_usage_errors(tmp_path: Path) -> None:
    assert "usage: python -m posenc.evaluate" in _evaluate(cwd=tmp_path).stderr
    assert "neither a run directory nor a checkpoint" in _evaluate(str(tmp_path / "nope"), cwd=tmp_path).stderr


def test_task_training_is_scored_on_the_task(tmp_path: Path) -> None:
    summary = train(compose_train("+encoding=rope", "data=passkey", *FAST), tmp_path)
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert "perplexity" not in results
    assert sorted({row["length"] for row in results["passkey"]}) == [16, 32]
    figures = {key for key in summary["eval"] if not key.startswith("effective_length_")}
    assert figures == {"passkey_acc@1x", "passkey_acc@2x", "passkey_byte_acc@1x", "passkey_byte_acc@2x"}
    effective = set(summary["eval"]) - figures  # a metric whose in-length figure is 0 has no effective length
    rules = {f"effective_length_{rule}/{metric}" for rule in ("absolute", "relative") for metric in ("passkey",
             "passkey_token_accuracy")}  # fmt: skip
    assert effective <= rules
    assert set(results["effective_length"]["relative"]) == {"passkey", "passkey_token_accuracy"}
    assert set(results["effective_length"]["absolute"]) == {"passkey", "passkey_token_accuracy"}


def test_report_task_tables_by_length_and_depth(tmp_path: Path) -> None:
    for label, near, far in (("alibi", 1.0, 0.0), ("kerple_log", 1.0, 1.0)):
        rows = [
            {
                "task": "passkey",
                "length": length,
                "depth": depth,
                "samples": 4,
                "accuracy": near if depth == 1.0 or length == 64 else far,
            }
            for length in (64, 256)
            for depth in (0.0, 1.0)
        ]
        folder = tmp_path / label / "eval"
        folder.mkdir(parents=True)
        (folder / "results.json").write_text(json.dumps({"label": label, "train_len": 64, "seed": 0, "passkey": rows}))
    markdown = build_report(find_results([tmp_path]), tmp_path / "report")
    lines = markdown.splitlines()
    # one seed each: its accuracy and the Wilson interval of its keys (4 per depth, 8 per length), no marks
    assert "| 64 | 1 | 1.00 [0.68, 1.00] | 1.00 [0.68, 1.00] |" in lines
    assert "| 256 | 4 | 0.50 [0.22, 0.78] | 1.00 [0.68, 1.00] |" in lines  # alibi: the far key lost, the near found
    assert "| 0 | 0.00 [0.00, 0.49] | 1.00 [0.51, 1.00] |" in lines  # by depth at 256: 0 and 4 of 4
    assert (tmp_path / "report" / "passkey_accuracy_L64.png").exists()
