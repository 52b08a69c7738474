"""``python -m posenc.train +encoding=<scheme>``: train the shared decoder with one positional scheme.

Hydra composes the config (``conf/train.yaml``), Lightning trains, and the run ends with the extrapolation
evaluation (perplexity at 1×…32× the training length, printed and written to ``<run>/eval``). Everything a
run writes lands in its directory under ``outputs/``: the resolved config, checkpoints, logs, ``run.json``, and
last ``done.json``, the mark of a complete run. ``-m`` runs a sweep (``sweeps/``, ``posenc/training/sweep.py``).

Every value is checked before any work (``posenc.runs.validate``, and ``posenc.runs.inherit`` for a run that starts
from another's weights with ``init_from``): a bad input ends with one line saying what to do, and leaves no run
directory behind. The training loop itself is ``posenc/training/loop.py``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import shlex
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from posenc.config import (
    CONF_DIR,
    check_command_line,
    remove_if_only_bookkeeping,
    require_encoding,
    to_container,
)
from posenc.runs import (
    CHECKPOINT,
    DONE_FILE,
    FAILED_FILE,
    RunError,
    check_device,
    check_wandb,
    inherit,
    read_parent,
    resolve,
    validate,
)
from posenc.schema import TrainConfig, refusal
from posenc.training.sweep import job_state, join_submitit_tasks, wandb_group, wandb_run_id


def train(cfg: DictConfig, run_dir: Path, resume_command: str | None = None) -> dict[str, Any]:
    """Check ``cfg``, then train one run into ``run_dir``; return its summary (also ``run_dir/run.json``)."""
    config = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    if (line := refusal(config, TrainConfig)) is not None:  # the values first: resolving a config reads them
        raise RunError(line)
    # init_from: the parent's checkpoint first, whose resolved length settings an unset one keeps
    parent_run = read_parent(str(config["init_from"])) if config.get("init_from") is not None else None
    unresolved = config
    config = resolve(config, parent_run.config.get("encoding") if parent_run else None)  # with optim.tuned's rates
    try:
        validate(config)
    except RunError as err:
        if parent_run is not None:  # scaled to this run's length instead: what the parent cannot give it
            _refuse_from_parent(resolve(unresolved), parent_run)
        raise err from None
    parent = inherit(config, parent_run)  # what carries over is decided (or refused) before any work
    from posenc.training.loop import fit  # Lightning is imported only for a config that can run

    return fit(config, run_dir, resume_command, parent)


def _refuse_from_parent(config: dict[str, Any], parent_run: Any) -> None:
    """Raise the parent's refusal where it has one.

    A run that inherits a setting it cannot train with (a learned table of the parent's size, say) is better told
    what cannot carry over than how to change the setting alone: ``config`` has its settings scaled to its own
    length, and the lineage says why the parent's cannot follow.
    """
    try:
        inherit(config, parent_run)
    except RunError:
        raise
    except Exception:  # an invalid config the lineage cannot even read: the config's own refusal stands
        return


# A terminal's control sequences (colours, cursor moves such as a progress bar's "line up").
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class PlainLines:
    """A console stream as plain lines for ``train.log``: what was printed, without the progress bars.

    A progress bar redraws its line after a carriage return many times a second, and a nested bar moves the cursor
    with ANSI sequences: a file would keep every redraw, and a log record printed while a bar was drawn would share
    its line. Here a line drawn after a carriage return is a bar's and is left out; text that follows a bar without
    a carriage return of its own (a record printed under a bar) starts a line of its own; ANSI sequences go.
    """

    def __init__(self) -> None:
        self.line, self.bar = "", False

    def feed(self, text: str) -> str:
        """The complete lines ``text`` finishes, as plain text."""
        done = []
        for token in re.split(r"(\r|\n)", ANSI.sub("", text)):
            if token == "\n":
                if not self.bar:
                    done.append(self.line.rstrip() + "\n")
                self.line, self.bar = "", False
            elif token == "\r":
                self.line, self.bar = "", True
            elif token:
                if self.bar and self.line:  # text after a bar's redraw, not a redraw itself: a line of its own
                    self.line, self.bar = "", False
                self.line += token
        return "".join(done)

    def flush(self) -> str:
        """The unfinished line, unless it is a bar's (the run is over)."""
        line, bar, self.line, self.bar = self.line, self.bar, "", False
        return line.rstrip() + "\n" if line.strip() and not bar else ""


class _Tee(io.TextIOBase):
    """A console stream that also writes into the run's ``train.log`` as plain lines; on a full disk, the console alone.

    The log is a copy: losing its tail to a full disk must not turn the run's own one-line message into a
    traceback from whatever was printing at the time.
    """

    def __init__(self, stream: TextIO, log: TextIO) -> None:
        self.stream, self.log, self.plain = stream, log, PlainLines()

    def write(self, text: str) -> int:
        self._to_log(self.log.write, self.plain.feed(text))
        return self.stream.write(text)

    def flush(self) -> None:
        self._to_log(self.log.flush)
        self.stream.flush()

    def finish(self) -> None:
        """Write the unfinished line into the log (the run is over)."""
        self._to_log(self.log.write, self.plain.flush())

    def _to_log(self, method: Callable[..., Any], *args: Any) -> None:
        if self.log.closed:  # a handler may keep this stream after the run (the next job of a multirun)
            return
        try:
            method(*args)
        except OSError:
            with contextlib.suppress(OSError):
                self.log.close()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()


@contextlib.contextmanager
def console_into(path: Path) -> Iterator[None]:
    """Copy everything the console shows (stdout and stderr) into ``path``: ``train.log`` holds the whole run.

    Log handlers that write to the console (Hydra's, which carries Lightning's records) write through the copy too.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    log = path.open("a", encoding="utf-8")
    try:
        stdout, stderr = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(stdout, log), _Tee(stderr, log)
        consoles = {id(stdout): sys.stdout, id(stderr): sys.stderr}
        handlers = [
            (handler, handler.stream)
            for handler in logging.getLogger().handlers
            if isinstance(handler, logging.StreamHandler) and id(handler.stream) in consoles
        ]
        for handler, stream in handlers:
            handler.setStream(consoles[id(stream)])
        try:
            yield
        finally:
            for handler, stream in handlers:
                handler.setStream(stream)
            for tee in (sys.stdout, sys.stderr):
                if isinstance(tee, _Tee):
                    tee.finish()
            sys.stdout, sys.stderr = stdout, stderr
    finally:
        with contextlib.suppress(OSError):  # what a full disk kept out of the log is on the console
            log.close()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def _main(cfg: DictConfig) -> None:
    hydra_config = HydraConfig.get()
    run_dir = Path(hydra_config.runtime.output_dir)
    require_encoding(cfg, "posenc.train", run_dir)
    multirun = hydra_config.mode == RunMode.MULTIRUN
    if multirun:
        join_submitit_tasks()
        state = job_state(run_dir, to_container(cfg))
        if state.finished:
            print(f"{cfg.run_name}: finished earlier ({run_dir / DONE_FILE}); skipping")
            return
        with open_dict(cfg):
            if cfg.resume is None and state.checkpoint is not None:
                cfg.resume = str(state.checkpoint)
            if cfg.logger.kind == "wandb":
                cfg.logger.group = cfg.logger.group or wandb_group(Path(hydra_config.sweep.dir), cfg.sweep_name)
                cfg.logger.id = wandb_run_id(cfg.logger.group, cfg.run_name)
    overrides = [o for o in hydra_config.overrides.task if not o.startswith(("resume=", "hydra.run.dir="))]
    resume_command = (
        shlex.join(["python", "-m", "posenc.train", *overrides, "resume=last", f"hydra.run.dir={run_dir}"])
        if not multirun
        else f"the same sweep command again (it resumes {run_dir.name})"
    )
    try:
        with console_into(run_dir / f"{hydra_config.job.name}.log"):
            train(cfg, run_dir, resume_command)
    except KeyboardInterrupt:  # outside Lightning's loop, which saves and exits itself: before training, or after
        if (run_dir / CHECKPOINT).exists():
            raise SystemExit(f"interrupted: kept {run_dir / CHECKPOINT}; resume with {resume_command}") from None
        remove_if_only_bookkeeping(run_dir)
        raise SystemExit("interrupted before training started: nothing was kept") from None
    except RunError as err:
        if not (run_dir / CHECKPOINT).exists():
            remove_if_only_bookkeeping(run_dir)
        if not multirun or not (run_dir / FAILED_FILE).exists():
            raise
        # A diverged job of a sweep: recorded in failed.json; the sweep goes on and its report lists it apart.
        print(f"error: {err}", file=sys.stderr)


def main() -> None:
    """Run from any directory: a relative ``-cd``/``--config-dir`` that is not here names the repository's."""
    args = sys.argv[1:]
    for index, arg in enumerate(args):
        if arg in ("-cd", "--config-dir") and index + 1 < len(args):
            args[index + 1] = _config_dir(args[index + 1])
        elif arg.startswith(("-cd=", "--config-dir=")):
            flag, _, value = arg.partition("=")
            args[index] = f"{flag}={_config_dir(value)}"
    sys.argv = [sys.argv[0], *args]
    try:
        # a typo, a value of the wrong kind, a GPU or a W&B key the machine lacks: one line before any run directory
        config = check_command_line(args, "train", "posenc.train", schema=TrainConfig)
        if config is not None:
            check_device(config)
            check_wandb(config["logger"])
        _main()
    except KeyboardInterrupt:  # while Hydra starts, before any run directory; or between a sweep's jobs
        sweep = any(arg in ("-m", "--multirun") for arg in args)
        kept = "the sweep's finished jobs are kept (the same command resumes it)" if sweep else "nothing was kept"
        raise SystemExit(f"interrupted: {kept}") from None


def _config_dir(value: str) -> str:
    path = Path(value).expanduser()
    bundled = CONF_DIR.parent / value
    return str(bundled) if not path.is_absolute() and not path.is_dir() and bundled.is_dir() else value


if __name__ == "__main__":
    main()
