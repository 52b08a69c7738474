"""Run a session's steps against one deadline, each in a process group of its own, none left behind.

Why one deadline and not a limit per step: a lent GPU comes for a fixed time and one command may run a fixed time.
A step starts while there is time left and gets all of it; at the deadline whatever still runs is stopped with its
whole process group (compile workers, training subprocesses, pytest's children), and the session still has the
seconds it keeps back (``RESERVE_S``) to write what comes back. A SIGTERM or SIGINT to the session stops every
running step the same way before the session writes its summary and exits; a SIGKILL, which the session cannot
see, is the watchdog's to clean up (``posenc.gpu.watchdog``).

A step may also have a budget of its own (``Step.budget_s``): when a command runs several parts (a lease), each part
is stopped at its budget, so that one part that overruns cannot take the time planned for the next.

Steps may overlap where the plan says so (``Step.overlap``): the next step starts while it runs. A step marked
``exclusive`` (a timing) starts only when nothing else runs and lets nothing start beside it.
"""

from __future__ import annotations

import codecs
import os
import selectors
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO

from posenc.gpu.watchdog import stop_groups

RESERVE_S = 10.0  # kept back from the deadline: stopping the steps and writing the summary and the tarball
MIN_START_S = 5.0  # a step is not started with less time than this left
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Step:
    """One command of a session, what the plan expects of it, and what came of it."""

    stage: str
    name: str
    argv: list[str]
    planned_s: float  # what the plan expects it to take on the GPU machine (see plan.py for how it is counted)
    graphs: int = 0  # distinct compiled graphs it is planned to compile
    overlap: bool = False  # the next step may start while this one runs
    exclusive: bool = False  # runs alone: nothing beside it (timings)
    budget_s: float | None = None  # its own deadline within the command's, so that the steps after it still run
    env: dict[str, str] = field(default_factory=dict)
    status: str = "never started"  # never started | running | passed | failed | timed out | stopped
    returncode: int | None = None
    seconds: float | None = None
    note: str = ""

    @property
    def ended_badly(self) -> bool:
        """A step whose log should come back on its own: it failed, ran out of time or was stopped."""
        return self.status in ("failed", "timed out", "stopped")


@dataclass
class _Running:
    step: Step
    process: subprocess.Popen
    log: IO[str]
    started: float
    decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )
    at_line_start: bool = True


def _read_ready(descriptor: int) -> bytes:
    """What can be read from ``descriptor`` without waiting (b"" when nothing is there or it has ended)."""
    with selectors.DefaultSelector() as selector:
        selector.register(descriptor, selectors.EVENT_READ)
        return os.read(descriptor, 65536) if selector.select(timeout=0) else b""


class SessionStoppedError(Exception):
    """The session received SIGTERM or SIGINT; its running steps have been stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Runner:
    """Runs ``steps`` until ``deadline`` (a ``time.monotonic()`` value), logging each into ``logs/<name>.log``.

    ``on_change`` is called after every step that ends (and once more at the end): the session writes what comes
    back there, so a session cut short still returns its summary.
    """

    def __init__(
        self,
        steps: list[Step],
        logs: Path,
        deadline: float,
        env: dict[str, str],
        on_change: Callable[[], None] = lambda: None,
        echo: IO[str] | None = None,
    ) -> None:
        self.steps, self.logs, self.deadline, self.env = steps, logs, deadline, env
        self.on_change = on_change
        self.echo = echo if echo is not None else sys.stdout
        self.running: dict[int, _Running] = {}
        self.watchdog: subprocess.Popen | None = None

    # -- the loop ---------------------------------------------------------------------------------------------------

    def run(self) -> None:
        """Run every step that fits before the deadline; SIGTERM/SIGINT stop them all (``SessionStoppedError``)."""
        self.logs.mkdir(parents=True, exist_ok=True)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        self.watchdog = subprocess.Popen(
            [sys.executable, "-m", "posenc.gpu.watchdog"],
            stdin=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=self.env,
            start_new_session=True,
        )
        try:
            pending = list(self.steps)
            while pending or self.running:
                while pending and self._may_start(pending[0]):
                    self._start(pending.pop(0))
                if pending and self.deadline - time.monotonic() < MIN_START_S and not self.running:
                    break  # no time for the rest: they stay "never started"
                if self.running:
                    self._pump(min(1.0, max(0.0, self.deadline - time.monotonic())))
                    self._stop_over_budget()
                    if time.monotonic() >= self.deadline:
                        self._stop_all("timed out", "stopped at the session's deadline")
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._close_watchdog()
        self.on_change()

    def _may_start(self, step: Step) -> bool:
        if self.deadline - time.monotonic() < MIN_START_S:
            return False
        if any(not r.step.overlap or r.step.exclusive for r in self.running.values()):
            return False  # a step that is not marked overlap runs before anything after it
        return not (step.exclusive and self.running)

    def _start(self, step: Step) -> None:
        log = (self.logs / f"{step.name}.log").open("w")
        self._say(
            f"== {step.name} ({step.stage}, planned {step.planned_s:.0f} s, {step.graphs} graphs): "
            f"{shlex.join(step.argv)}\n"
        )
        process = subprocess.Popen(
            step.argv,
            cwd=ROOT,
            env={**self.env, **step.env},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group, so that the deadline stops it and all it started
        )
        if self.watchdog is not None and self.watchdog.stdin is not None:
            self.watchdog.stdin.write(f"{process.pid}\n")
            self.watchdog.stdin.flush()
        step.status = "running"
        self.running[process.pid] = _Running(step, process, log, time.monotonic())

    def _pump(self, timeout: float) -> None:
        """Copy what the running steps print into their logs and the console; reap those that ended."""
        with selectors.DefaultSelector() as selector:
            for pid, running in self.running.items():
                assert running.process.stdout is not None
                selector.register(running.process.stdout.fileno(), selectors.EVENT_READ, pid)
            for key, _ in selector.select(timeout=timeout):
                running = self.running[key.data]
                chunk = os.read(key.fd, 65536)
                if chunk:
                    self._write(running, running.decoder.decode(chunk))
                else:
                    self._finish(running)
        # A step whose process has exited but whose output a leftover child still holds open (a compile worker)
        # would never read as ended: what it printed is taken as far as it goes, and it ends now.
        for running in [r for r in self.running.values() if r.process.poll() is not None]:
            assert running.process.stdout is not None
            while chunk := _read_ready(running.process.stdout.fileno()):
                self._write(running, running.decoder.decode(chunk))
            self._finish(running)

    def _write(self, running: _Running, text: str) -> None:
        running.log.write(text)
        running.log.flush()
        # On the console every line says which step printed it: overlapping steps interleave.
        prefix = f"[{running.step.name}] "
        lines = text.split("\n")
        shown = []
        for index, line in enumerate(lines):
            last = index == len(lines) - 1
            if last and not line:
                break
            shown.append((prefix if running.at_line_start else "") + line)
            running.at_line_start = not last
        self._say("\n".join(shown) + ("\n" if text.endswith("\n") else ""))

    def _finish(self, running: _Running, status: str | None = None, note: str = "") -> None:
        step = running.step
        try:
            step.returncode = running.process.wait(timeout=5)
        except subprocess.TimeoutExpired:  # closed its output but still running: stop it
            stop_groups({running.process.pid})
            step.returncode = running.process.wait()
        stop_groups({running.process.pid}, grace_s=0.5)  # what it left behind in its group (compile workers)
        step.seconds = round(time.monotonic() - running.started, 1)
        step.status = status or ("passed" if step.returncode == 0 else "failed")
        if note:
            step.note = note
            running.log.write(f"\n[posenc.gpusession] {step.name}: {note}\n")
        running.log.close()
        assert running.process.stdout is not None
        running.process.stdout.close()
        del self.running[running.process.pid]
        self._say(f"== {step.name}: {step.status} in {step.seconds:.0f} s\n")
        self.on_change()

    def _stop_over_budget(self) -> None:
        """Stop, with its group, every step that has run past its own budget; what it wrote stays."""
        now = time.monotonic()
        over = [r for r in self.running.values() if r.step.budget_s is not None and now - r.started >= r.step.budget_s]
        if over:
            stop_groups({r.process.pid for r in over})
        for running in over:
            self._finish(running, "timed out", f"stopped at its budget of {running.step.budget_s:.0f} s")

    def _stop_all(self, status: str, note: str) -> None:
        """Stop every running step with its whole process group and record why."""
        stop_groups({pid for pid in self.running})
        for running in list(self.running.values()):
            self._finish(running, status, note)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        self._stop_all("stopped", f"stopped: the session received {name}")
        raise SessionStoppedError(signum)

    def _close_watchdog(self) -> None:
        if self.watchdog is None:
            return
        if self.watchdog.stdin is not None:
            self.watchdog.stdin.close()  # the watchdog stops what is left of every group, then exits
        try:
            self.watchdog.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.watchdog.kill()

    def _say(self, text: str) -> None:
        self.echo.write(text)
        self.echo.flush()
