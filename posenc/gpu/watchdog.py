"""``python -m posenc.gpu.watchdog``: stops a session's steps once the session is gone, however it went.

Why a process of its own: a step runs in a process group of its own so that the session can stop it (and its
compile workers, its training subprocesses) at the deadline without stopping itself. The price is that a step
outlives a session killed from outside (SIGKILL, a machine's command limit): it would keep the GPU busy and spoil
the next command's timings. The watchdog, in a group of its own too, reads the process group of every step the
session starts on a pipe; the pipe ends when the session ends, by exit or by SIGKILL alike, and the watchdog then
stops every group it was told of (SIGTERM, a grace period, SIGKILL) and exits.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

GRACE_S = 3.0


def stop_groups(groups: set[int], grace_s: float = GRACE_S) -> None:
    """SIGTERM every process group, then SIGKILL those still there after ``grace_s``."""
    for group in groups:
        try:
            os.killpg(group, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            continue
    deadline = time.monotonic() + grace_s
    alive = set(groups)
    while alive and time.monotonic() < deadline:
        alive = {group for group in alive if group_alive(group)}
        time.sleep(0.05)
    for group in alive:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue


def group_alive(group: int) -> bool:
    """Whether any process of ``group`` is still running (signal 0 asks without sending)."""
    try:
        os.killpg(group, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def main() -> int:
    # Started by the GPU session with the step groups on stdin; --help says so rather than wait on a terminal.
    argparse.ArgumentParser(prog="python -m posenc.gpu.watchdog", description=__doc__.split("\n\n")[0]).parse_args()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C at the terminal is the session's to handle
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # so is a SIGTERM sent to the session's group
    groups: set[int] = set()
    for line in sys.stdin:
        word = line.strip()
        if word.isdigit():
            groups.add(int(word))
    stop_groups(groups)
    return 0


if __name__ == "__main__":
    sys.exit(main())
