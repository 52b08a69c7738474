"""What a run prints, typed as a user would: one line per event on the console, train.log as plain text.

The first line names the run (with what it is beyond its scheme) and its directory, the last where its results are;
Lightning's records print once and none of the libraries' noise (tips, deprecations, a FLOPs count never made);
Ctrl-C's notice prints once; a resume does not warn that earlier logs will be deleted (they are continued), and its
run.json gives steps, tokens and seconds over the same span.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import FAST, compose_train

from posenc.report import build_report, find_results
from posenc.train import train

ROOT = Path(__file__).resolve().parent.parent
TINY = ["logger=csv", "data.batch_size=4", "data.val_windows=4", "eval.max_tokens=256", "eval.multiples=[1,2]"]
QUIET = ["+encoding=alibi", "data.seq_len=16", "eval.plots=false", "trainer.enable_progress_bar=false"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}


def _train(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "posenc.train", *TINY, f"hydra.run.dir={run_dir}", *args]
    done = subprocess.run(command, capture_output=True, timeout=300, env=_env(), cwd=run_dir.parent)
    # Decoded by hand: text mode would turn a progress bar's carriage returns into newlines.
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(), done.stderr.decode())


NOISE = ("Tip:", "LeafSpec", "Total Flops", "FLOPs", "anonymous setting")


def test_a_fine_tuned_run_says_what_and_where_and_resumes_cleanly(tmp_path: Path) -> None:
    parent, run_dir = tmp_path / "alibi", tmp_path / "run"
    train(compose_train("+encoding=alibi", *FAST), parent)  # no RoPE: the scaling below has nothing to extend
    yarn = ["+encoding=rope", f"init_from={parent}", "model.context_scaling={method:yarn,factor:2,original_length:16}"]
    tiny = ["data.seq_len=32", "eval.plots=false", "trainer.log_every_n_steps=1"]  # the progress bar on
    first = _train(run_dir, *yarn, *tiny, "trainer.max_steps=2")
    assert first.returncode == 0, first.stderr[-2000:]
    console, log = first.stdout + first.stderr, (run_dir / "train.log").read_text()
    lines = first.stdout.splitlines()
    assert lines[0] == (
        "run rope-yarn2-from-alibi-L32-s0 (yarn×2 from 16 in training; fine-tuned from alibi-L16-s0 at step 3): run"
    )  # the run directory as typed from where the command ran
    assert lines[-1] == "done: results in run/eval/results.json; no plots (eval.plots=false); run/run.json"
    assert (
        "note: model.context_scaling=yarn×2 from 16 stretches RoPE, but the parent (alibi-L16-s0, alibi) had no RoPE"
        in console
    )
    assert (
        "Perplexity of rope (yarn×2 from 16 in training; fine-tuned from alibi-L16-s0 at step 3) trained at L=32"
        in console
    )
    for line in ("GPU available: False", "Trainable params", "`Trainer.fit` stopped"):
        assert console.count(line) == 1, (line, console[-3000:])
        assert log.count(line) == 1, (line, log[-3000:])
    assert not [noise for noise in NOISE if noise in console], console[-3000:]
    # train.log is the console as plain lines: no progress-bar redraws, no ANSI sequences, every record whole
    assert "\r" in first.stdout and "\r" not in log and "\x1b" not in log and "it/s]" not in log, log[-3000:]
    assert "\n`Trainer.fit` stopped: `max_steps=2` reached.\n" in log
    markdown = build_report(find_results([run_dir]), tmp_path / "report", make_plots=False)
    assert "| rope · yarn×2 in training · from alibi (n=1" in markdown  # never a plain rope column

    (run_dir / "done.json").unlink()
    resumed = _train(run_dir, *yarn, *tiny, "trainer.max_steps=4", "resume=last")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming at step 2" in resumed.stdout
    assert "will be deleted" not in resumed.stdout + resumed.stderr
    summary = json.loads((run_dir / "run.json").read_text())
    segment = summary["segment"]
    assert summary["steps"] == 4 and summary["tokens"] == 4 * 4 * 32  # the whole run, from step 0
    assert segment["from_step"] == 2 and segment["steps"] == 2 and segment["tokens"] == 2 * 4 * 32
    assert summary["train_seconds"] > segment["train_seconds"] > 0  # the earlier process's seconds counted too
    assert summary["train_loop_seconds"] > segment["train_loop_seconds"] > 0


def test_ctrl_c_is_reported_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "posenc.train",
        *TINY,
        *QUIET,
        f"hydra.run.dir={run_dir}",
        "trainer.max_steps=100000",
    ]
    # A suite started in the background by a non-interactive shell inherits SIGINT ignored, and so would the run;
    # the run must see Ctrl-C as a terminal user's would, so its SIGINT goes back to the default before exec.
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env(),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines = []
    assert process.stdout is not None
    for line in process.stdout:  # wait until training runs, then press Ctrl-C
        lines.append(line)
        if "global batch" in line:
            break
    # "global batch" is printed as fit starts; a signal sent in that instant, before the loop runs, was once
    # lost under load. A few seconds later the run is inside its training loop, which is what Ctrl-C is about.
    time.sleep(3)
    process.send_signal(signal.SIGINT)
    try:
        rest, _ = process.communicate(timeout=120)
    finally:  # a run that ignored the signal must not train on beside the rest of the suite
        process.kill()
    console = "".join(lines) + rest
    assert console.count("interrupted at step") == 1, console[-3000:]
    assert console.count("KeyboardInterrupt") <= 1, console[-3000:]  # Lightning's own notice, if any, once
    assert (run_dir / "checkpoints" / "last.ckpt").exists()
