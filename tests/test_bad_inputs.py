"""The bad-input catalogue, through the real CLI: exit ≠ 0, one clear line on stderr, no traceback, nothing written.

Every row runs ``python -m posenc.<command>`` in its own empty working directory; the rows run two at a time (a
Python start costs seconds) from one module fixture, and each row is its own test. The error table of
docs/guide/errors.md lists the same inputs and messages (a test holds it to them); every setting's wrong kinds and
ranges are tested from the schema in tests/test_schema.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import FAST, compose_train

from posenc.train import train

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ["+encoding=alibi", *FAST]
MULTIPLES = "a non-empty list, each a whole number ≥ 1 (e.g. eval.multiples=[1,2,4])"
# Rows that need the machine to have no GPU.
NO_GPU = ("gpu on a CPU machine", "evaluate, cuda on a CPU machine", "flex on CPU")
# (id, command, arguments, what stderr's first line says, or one of several); {files} / {run} come from fixtures.
ROWS = [
    ("missing scheme", "train", FAST, "needs a positional scheme: add +encoding=<name>"),
    (
        "unknown scheme",
        "train",
        ["+encoding=alibbi", *FAST],
        "unknown positional scheme 'alibbi' (+encoding=alibbi): did you mean alibi?",
    ),
    ("scheme without +", "train", ["encoding=alibi", *FAST], "add it with +encoding=alibi"),
    ("unknown scheme name", "train", [*TRAIN, "encoding.name=nosuch"], "unknown positional scheme 'nosuch'"),
    ("dim not divisible by heads", "train", [*TRAIN, "model.dim=100", "model.heads=3"], "not divisible by"),
    ("unknown model init", "train", [*TRAIN, "model.init=xavier"], "model.init=xavier must be one of gpt2, pytorch"),
    ("pytorch init, tied head", "train", [*TRAIN, "model.init=pytorch"], "set model.tie_embeddings=false with it"),
    ("odd head_dim, rotary", "train", ["+encoding=rope", *FAST, "model.dim=72", "model.heads=8"], "is odd"),
    ("seq_len 0", "train", [*TRAIN, "data.seq_len=0"], "data.seq_len=0 must be a whole number ≥ 1"),
    ("batch_size 0", "train", [*TRAIN, "data.batch_size=0"], "data.batch_size=0 must be a whole number ≥ 1"),
    ("max_steps 0", "train", [*TRAIN, "trainer.max_steps=0"], "trainer.max_steps=0 must be a whole number ≥ 1"),
    ("eval multiple 0", "train", [*TRAIN, "eval.multiples=[0]"], f"eval.multiples=[0] must be {MULTIPLES}"),
    ("eval multiple fraction", "train", [*TRAIN, "eval.multiples=[0.5]"], f"eval.multiples=[0.5] must be {MULTIPLES}"),
    ("eval multiples not a list", "train", [*TRAIN, "eval.multiples=4"], f"eval.multiples=4 must be {MULTIPLES}"),
    (
        "sliding fractions not a list",
        "train",
        [*TRAIN, "eval.sliding_fractions=0.5"],
        "eval.sliding_fractions=0.5 must be a list, each a number in (0, 1]",
    ),
    ("betas not a list", "train", [*TRAIN, "optim.betas=0.9"], "optim.betas=0.9 must be a list of 2, each a number"),
    ("seed not a number", "train", [*TRAIN, "seed=x"], "seed=x must be a whole number in [0, 4294967295]"),
    ("gpu on a CPU machine", "train", [*TRAIN, "trainer.accelerator=gpu"], "trainer.accelerator=gpu asks for a GPU"),
    (
        "W&B mode misspelt",
        "train",
        [*TRAIN, "logger=wandb", "logger.mode=ofline"],
        "logger.mode=ofline must be one of auto, online, offline, disabled",
    ),
    (
        "W&B online without a key",
        "train",
        [*TRAIN, "logger=wandb", "logger.mode=online"],
        "logger.mode=online needs a W&B API key and none is configured",
    ),
    (
        "run directory cannot be made",
        "train",
        [*TRAIN, "hydra.run.dir={files}/empty.txt/run"],
        "hydra.run.dir={files}/empty.txt/run: {files}/empty.txt is a file; choose a writable place",
    ),
    (
        "scheme chosen twice",
        "train",
        ["+encoding=alibi", "+encoding=rope", *FAST],
        "encoding is chosen twice (+encoding=alibi and +encoding=rope): give one",
    ),
    (
        "sweep with one bad value",
        "train",
        ["-m", "+encoding=alibi,nope", "seed=0,x", *FAST],
        "job +encoding=alibi seed=x",
    ),
    (
        "learned past max_positions",
        "train",
        ["+encoding=learned", *FAST, "encoding.max_positions=8"],
        "learned represents at most 8 positions but data.seq_len=16",
    ),
    ("text without paths", "train", [*TRAIN, "data=text"], "data.corpus_options.paths must be set"),
    (
        "text, a folder",
        "train",
        [*TRAIN, "data=text", "data.corpus_options.paths=[{files}/empty-dir]"],
        "data=text: {files}/empty-dir is a folder: give its files as a glob",
    ),
    (
        "text, missing files",
        "train",
        [*TRAIN, "data=text", "data.corpus_options.paths=[{files}/nothing-*.txt]"],
        "data=text found no files",
    ),
    (
        "text, empty file",
        "train",
        [*TRAIN, "data=text", "data.corpus_options.paths=[{files}/empty.txt]"],
        "is empty: give files with text in them",
    ),
    (
        "text, binary file",
        "train",
        [*TRAIN, "data=text", "data.corpus_options.paths=[{files}/binary.txt]"],
        "looks binary",
    ),
    (
        "text, too short",
        "train",
        [*TRAIN, "data=text", "data.corpus_options.paths=[{files}/short.txt]"],
        "fewer than one window of data.seq_len=16",
    ),
    (
        "hf offline",
        "train",
        [*TRAIN, "data=hf"],
        ("data=hf needs the datasets package", "could not load Hugging Face dataset"),
    ),
    ("negative learning rate", "train", [*TRAIN, "optim.lr=-1"], "optim.lr=-1 must be a positive number"),
    (
        "unknown override key",
        "train",
        [*TRAIN, "trainer.max_step=50"],
        "unknown key trainer.max_step (in trainer.max_step=50): did you mean trainer.max_steps?",
    ),
    (
        "unknown key added",
        "train",
        [*TRAIN, "+trainer.max_step=50"],
        "unknown key trainer.max_step (in +trainer.max_step=50): did you mean trainer.max_steps?",
    ),
    ("flex on CPU", "train", [*TRAIN, "attention=flex"], "attention=flex trains only on a CUDA GPU"),
    (
        "init_from, head count differs",
        "train",
        [*TRAIN, "init_from={run}", "model.heads=2"],
        "the parent has model.heads=4 but this run asks for model.heads=2",
    ),
    (
        "init_from, missing",
        "train",
        [*TRAIN, "init_from={files}/no-run"],
        "is neither a run directory nor a checkpoint",
    ),
    ("init_from, no checkpoint", "train", [*TRAIN, "init_from={files}/empty-dir"], "no checkpoint at"),
    ("init_from, truncated", "train", [*TRAIN, "init_from={files}/truncated.ckpt"], "cannot be read as a checkpoint"),
    ("evaluate, missing dir", "evaluate", ["{files}/no-run"], "is neither a run directory nor a checkpoint"),
    ("evaluate, no checkpoint", "evaluate", ["{files}"], "no checkpoint at"),
    ("evaluate, truncated checkpoint", "evaluate", ["{files}/truncated.ckpt"], "cannot be read as a checkpoint"),
    ("evaluate, mismatched override", "evaluate", ["{run}", "+encoding=rope"], "checkpoint/config mismatch"),
    (
        "evaluate, eval multiple 0",
        "evaluate",
        ["{run}", "eval.multiples=[0]"],
        f"eval.multiples=[0] must be {MULTIPLES}",
    ),
    (
        "W&B online without a key, evaluate",
        "evaluate",
        ["{run}", "wandb=true"],
        "WANDB_MODE=online needs a W&B API key and none is configured (WANDB_API_KEY, or ~/.netrc from `wandb login`): "
        "log in first, or evaluate with wandb=false",
    ),
    (
        "evaluate, cuda on a CPU machine",
        "evaluate",
        ["{run}", "device=cuda"],
        "device=cuda: this machine has no CUDA GPU",
    ),
    (
        "evaluate, a results.json",
        "evaluate",
        ["{run}/eval/results.json"],
        "{run}/eval/results.json is not a checkpoint (a .ckpt file): evaluate its run: python -m posenc.evaluate {run}",
    ),
    (
        "evaluate, unknown key added",
        "evaluate",
        ["{run}", "+eval.multiple=[1,4]"],
        "unknown key eval.multiple (in +eval.multiple=[1,4]): did you mean eval.multiples?",
    ),
    ("report, empty dir", "report", ["{files}/empty-dir"], "no results.json found"),
    ("report, missing path", "report", ["{files}/no-run"], "{files}/no-run does not exist"),
    (
        "report, malformed W&B view",
        "report",
        ["{run}/eval", "--out", "report", "--wandb-view", "posenc"],
        "--wandb-view posenc: give ENTITY/PROJECT",
    ),
    ("report, corrupt results", "report", ["{files}/corrupt"], "corrupt/results.json: cut short or damaged JSON"),
]


def test_every_row_is_in_the_error_table() -> None:
    """docs/guide/errors.md lists every row tested here with its message (fine-tuning.md those of init_from)."""
    docs = ROOT / "docs"
    table = (docs / "guide" / "errors.md").read_text() + (docs / "fine-tuning.md").read_text()
    unlisted = []
    for name, _, _, message in ROWS:
        messages = (message,) if isinstance(message, str) else message
        # a path is the table's <file>, <run>: the longest stretch of the message between paths must be there
        stretches = [max(re.split(r"\{(?:files|run)\}\S*", text), key=len) for text in messages]
        if not any(stretch in table for stretch in stretches):
            unlisted.append(name)
    assert unlisted == []


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The inputs the rows name: ``files`` (text, binary, empty, damaged) and ``run``, a trained run."""
    files = tmp_path_factory.mktemp("inputs")
    (files / "empty.txt").write_text("")
    (files / "binary.txt").write_bytes(bytes(range(256)) * 8)
    (files / "short.txt").write_text("too short for one window\n" * 3)
    (files / "empty-dir").mkdir()
    (files / "corrupt").mkdir()
    (files / "corrupt" / "results.json").write_text('{"label": "alibi", "perp')
    run = tmp_path_factory.mktemp("run")
    train(compose_train(*TRAIN), run)
    (files / "truncated.ckpt").write_bytes((run / "checkpoints" / "last.ckpt").read_bytes()[:4096])
    return {"files": str(files), "run": str(run)}


@pytest.fixture(scope="module")
def outcomes(
    paths: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[subprocess.CompletedProcess, list[str]]]:
    def launch(row: tuple) -> tuple[subprocess.CompletedProcess, list[str]]:
        name, command, args, _ = row
        cwd = tmp_path_factory.mktemp("cwd")
        args = [a.format(**paths) for a in args]
        env = {**os.environ, "WANDB_MODE": "disabled"}
        if name.startswith("W&B"):  # W&B as a user without a key has it: no key, no mode forced, a home of its own
            home = str(tmp_path_factory.mktemp("home"))
            env = {k: v for k, v in env.items() if k not in ("WANDB_MODE", "WANDB_API_KEY", "NETRC")} | {"HOME": home}
            if command == "evaluate":  # W&B asked for online by the environment, which wins over the run's setting
                env["WANDB_MODE"] = "online"
        result = subprocess.run(
            [sys.executable, "-m", f"posenc.{command}", *args],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        return result, sorted(str(p.relative_to(cwd)) for p in cwd.rglob("*"))

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip([row[0] for row in ROWS], pool.map(launch, ROWS), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize(("name", "message"), [(row[0], row[3]) for row in ROWS], ids=[row[0] for row in ROWS])
def test_bad_input_fails_clearly_and_writes_nothing(name: str, message: str, outcomes: dict, paths: dict) -> None:
    if name in NO_GPU and torch.cuda.is_available():
        pytest.skip("this machine has the GPU the row asks for")
    result, written = outcomes[name]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0, result.stdout[-1000:]
    assert "Traceback" not in result.stderr, result.stderr
    expected = [text.format(**paths) for text in ((message,) if isinstance(message, str) else message)]
    assert lines and any(text in lines[0] for text in expected), result.stderr
    assert len(lines) == 1, result.stderr
    assert written == [], written
