"""How Lightning writes a run's checkpoints: whole or not at all, the one before kept, off the training loop.

Lightning's own ``TorchCheckpointIO`` writes to a file in the system's temp folder and moves it into place; where
that folder is another file system, the move is a copy, and a full disk leaves a truncated ``last.ckpt`` in place
of the good one. Here a checkpoint is serialised in the training loop, as Lightning does, and its space claimed
there beside ``last.ckpt`` (``posenc.jsonio.PendingWrite``): a full disk stops the run at that step, with the
checkpoint on disk untouched. Writing, fsync and rename, the disk's time, then run in a thread while training goes
on; the next save, and the end of training, wait for them (and raise what they raised). Before the rename the good
checkpoint on disk becomes ``last-previous.ckpt`` (a hard link: no copy, and no extra space once the next one is
written), which a resume falls back on if ``last.ckpt`` turns out unreadable.

Imported by the training loop only: it needs Lightning, which ``posenc.runs`` does not import.
"""

from __future__ import annotations

import io
import os
import secrets
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from posenc.jsonio import PendingWrite


def previous_of(path: Path) -> Path:
    """Where the checkpoint before ``path`` is kept: ``last.ckpt`` → ``last-previous.ckpt``."""
    return path.with_name(f"{path.stem}-previous{path.suffix}")


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose saves are atomic in the checkpoint's own directory (the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        self.wait()  # one checkpoint on its way at a time: this one may replace the file that one renames
        path = Path(path)
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        for orphan in path.parent.glob(f".{path.name}.*.partial"):  # left by a process killed mid-write
            orphan.unlink(missing_ok=True)
        pending = PendingWrite(path, buffer.getbuffer())  # a full disk raises here, in the training loop
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._pending = self._executor.submit(_finish, pending)

    def wait(self) -> None:
        """Until the last checkpoint saved is on disk under its name; raises what its write raised."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def teardown(self) -> None:
        """Lightning's end of training (before the end-of-training evaluation reads the checkpoint)."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None


def _finish(pending: PendingWrite) -> None:
    keep_previous(pending.path)
    pending.commit()


def keep_previous(path: Path) -> None:
    """Make the checkpoint at ``path`` also ``previous_of(path)``, if it is whole (a damaged one never replaces it).

    A hard link costs no space and no time; on a file system without them no previous checkpoint is kept, and the
    atomic rename alone protects ``path``.
    """
    previous = previous_of(path)
    if not _complete(path) or (previous.exists() and os.path.samefile(path, previous)):
        return  # (a rename onto another link of the same file does nothing, and would leave the staged link behind)
    staged = previous.with_name(f".{previous.name}.{secrets.token_hex(4)}.partial")
    try:
        os.link(path, staged)
        os.replace(staged, previous)
    except OSError:
        staged.unlink(missing_ok=True)


def _complete(path: Path) -> bool:
    """Whether ``path`` is a whole ``torch.save`` archive: its zip directory, at the end of the file, reads."""
    try:
        with zipfile.ZipFile(path) as archive:
            return bool(archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False
