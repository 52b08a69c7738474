"""Every entry point's --help, typed as a user would: exit status 0, and what the command runs before anything else.

The commands a user of the README types (train, evaluate, bench, report) run as ``python -m posenc.<name> --help``,
two at a time; the other tools run the same way in this process (``runpy``, as ``-m`` does), which spares a Python
start and an import of torch each. Every module with a ``__main__`` is found
here, so a new tool is covered when it is added. Also the command-line check on a sweep's command line.
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from posenc.config import check_command_line

ROOT = Path(__file__).resolve().parent.parent
SWEEPS = ROOT / "sweeps"
# Typed by users of the README, or light enough (no torch) that a Python start costs under a second.
AS_TYPED = {
    "train",
    "evaluate",
    "bench",
    "report",
    "gpusession",
    "lane",
    "gpu.session",
    "gpu.watchdog",
    "cluster.local",
}


def entry_points() -> list[str]:
    """``posenc.<name>`` of every package with a ``__main__.py`` and every module with a ``__main__`` block."""
    found = set()
    for path in (ROOT / "posenc").rglob("*.py"):
        dotted = ".".join(path.relative_to(ROOT / "posenc").with_suffix("").parts)
        if path.name == "__main__.py":
            found.add(dotted.removesuffix(".__main__"))
        elif path.name != "__init__.py" and 'if __name__ == "__main__":' in path.read_text():
            found.add(dotted)
    return sorted(found)


def _typed(name: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", f"posenc.{name}", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return done.returncode, done.stdout + done.stderr


def _in_process(name: str) -> tuple[int, str]:
    out = io.StringIO()
    argv = sys.argv
    sys.argv = [f"posenc.{name}", "--help"]
    code: int | str | None = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_module(f"posenc.{name}", run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = stop.code
    finally:
        sys.argv = argv
    return int(code or 0), out.getvalue()


@pytest.fixture(scope="module")
def helps() -> dict[str, tuple[int, str]]:
    names = entry_points()
    as_typed = [name for name in names if name in AS_TYPED]
    with ThreadPoolExecutor(max_workers=2) as pool:
        typed = dict(zip(as_typed, pool.map(_typed, as_typed), strict=True))
    return {name: typed[name] if name in typed else _in_process(name) for name in names}


def test_every_entry_point_is_found() -> None:
    assert {"train", "evaluate", "bench", "report", "gpucheck", "gpusession", "lane"} <= set(entry_points())


@pytest.mark.parametrize("name", entry_points())
def test_help_exits_0_and_says_what_the_command_runs(name: str, helps: dict[str, tuple[int, str]]) -> None:
    code, text = helps[name]
    assert code == 0, text[-2000:]
    lines = [line for line in text.splitlines() if line.strip()]
    assert "powered by Hydra" not in text
    assert lines[0].startswith(("python -m posenc.", "usage: python -m posenc.")), lines[0]
    # what it runs: a sentence within the first lines, after the usage and before any option
    prose = [line for line in lines[1:12] if not line.startswith(("usage:", " ", "options", "positional"))]
    assert any(len(line.split()) >= 6 for line in prose), text[:1500]


def test_train_help_says_encoding_is_required(helps: dict[str, tuple[int, str]]) -> None:
    text = helps["train"][1]
    assert text.splitlines()[0] == "python -m posenc.train +encoding=<scheme> [group=option ...] [key=value ...]"
    assert "+encoding=<scheme> is required" in text and "encoding: alibi, alibi_dd" in text


def test_evaluate_help_lists_every_eval_setting(helps: dict[str, tuple[int, str]]) -> None:
    text = helps["evaluate"][1]
    assert text.startswith("python -m posenc.evaluate <run dir or checkpoint.ckpt>")
    for setting in ("eval.multiples=[1,2,4,8,16,32]", "eval.mode=nonoverlap", "eval.rope_scaling=null", "device=auto"):
        assert f"\n  {setting} " in text
    # what each accepts, from the schema
    assert "  eval.mode=nonoverlap" + " " * 22 + "  one of nonoverlap, sliding: disjoint windows" in text


def test_bench_help_lists_its_settings(helps: dict[str, tuple[int, str]]) -> None:
    assert "  attention.lengths=[2048,8192,16384]\n" in helps["bench"][1]


def test_a_sweep_command_line_is_checked_as_its_jobs_compose() -> None:
    sweep = ["-m", "-cd", str(SWEEPS), "-cn", "smoke"]
    with pytest.raises(
        SystemExit, match=r"unknown positional scheme 'ropee' \(\+encoding=alibi,ropee\): did you mean rope\?"
    ):
        check_command_line([*sweep, "+encoding=alibi,ropee"], "train", "posenc.train")
    with pytest.raises(
        SystemExit, match=r"unknown key trainer.max_step \(in trainer.max_step=3\): did you mean trainer.max_steps\?"
    ):
        check_command_line([*sweep, "trainer.max_step=3"], "train", "posenc.train")
    # accepted: a sweep's own keys, a Trainer keyword added with +, a scheme's option under the sweep's first scheme
    check_command_line([*sweep, "trainer.max_steps=3", "+trainer.max_time=00:00:10:00"], "train", "posenc.train")
    check_command_line(["-m", "+encoding=rope", "encoding.base=500", "seed=0,1"], "train", "posenc.train")
