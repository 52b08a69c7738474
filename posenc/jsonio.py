"""Every file posenc writes: strict JSON, and written whole or not at all.

``json.dumps`` writes non-finite floats as the bare tokens ``NaN``/``Infinity``, which are not JSON (a browser, jq
or W&B's importer rejects them), and its ``default`` hook is never called for floats, so they cannot be fixed
there. Values are cleaned before dumping instead: non-finite floats become ``null`` (a refused length has no
perplexity), numpy scalars become Python numbers, anything else unknown becomes its string.

``write_bytes`` (``PendingWrite``) is the one way a record, a report, a plot or a checkpoint reaches the disk: a
reader (a resumed run, a relaunched sweep, the report) sees the old file or the whole new one, never a part of one,
whether the disk fills or the process is killed mid-write. A full disk raises ``DiskFullError``, which says which
file, how much it needed and how much was free, for the one line an entry point prints.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import json
import math
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

# Test hook: ``<file name>:<marker path>`` makes the write of that name over an existing file stop halfway, touch
# the marker and wait, so that a test can kill the process in the middle of the write.
PAUSE_ENV = "POSENC_PAUSE_WRITE"
_FULL = (errno.ENOSPC, errno.EDQUOT)


def clean(value: Any) -> Any:
    """``value`` with non-finite floats as ``None`` and numpy scalars as Python numbers, recursively."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {key: clean(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [clean(item) for item in value]
    return value


def dumps(data: Any, indent: int = 2) -> str:
    """Strict JSON text of ``data`` (see the module docstring); raises rather than write NaN."""
    return json.dumps(clean(data), indent=indent, default=str, allow_nan=False)


class DiskFullError(OSError):
    """No room on its file system for a file posenc writes; the file on disk, if any, is still the previous one."""

    def __init__(self, path: Path, needed: int, free: int) -> None:
        super().__init__(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        self.path, self.needed, self.free = Path(path), needed, free

    def __str__(self) -> str:
        return f"the disk is full: could not write {self.path} (it needs {size(self.needed)}, {size(self.free)} free)"


def size(count: int) -> str:
    """A byte count as a person reads it: ``9.6 MB``, ``312 kB``, ``17 B``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count} B"


def free_bytes(folder: Path) -> int:
    """Bytes an unprivileged writer can still use on ``folder``'s file system."""
    return shutil.disk_usage(folder).free


class PendingWrite:
    """A file about to be replaced atomically: its space claimed now, its bytes written and renamed by ``commit``.

    The bytes go to a hidden file in the same directory, never the system's temp folder: a rename within one file
    system is atomic, a move onto another is a copy that a full disk cuts short. Their space is reserved when the
    write is created, so a full disk fails at once and before a byte is written (``DiskFullError``); ``commit``
    writes them, fsyncs the file, renames it over ``path`` and fsyncs the directory, so that even a power cut
    leaves one of the two files whole. Split in two so that a checkpoint's disk time can leave the training loop
    (``posenc/runs/checkpoint_io.py``) once its space is certain. On any failure the hidden file is removed.
    """

    def __init__(self, path: Path, data: bytes | memoryview) -> None:
        self.path, self.data = Path(path), memoryview(data).cast("B")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.partial = self.path.with_name(f".{self.path.name}.{secrets.token_hex(4)}.partial")
        self.descriptor: int | None = None
        with self._cleaning_up():
            self.descriptor = os.open(self.partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            _reserve(self.descriptor, len(self.data))

    def commit(self) -> None:
        """Write, fsync, rename over ``path``: from here on a reader sees the new file."""
        with self._cleaning_up():
            assert self.descriptor is not None, "committed twice"
            _pause_if_asked(self.path, self.descriptor, self.data)
            written = 0
            while written < len(self.data):
                written += os.write(self.descriptor, self.data[written:])
            os.fsync(self.descriptor)
            os.close(self.descriptor)
            self.descriptor = None
            os.replace(self.partial, self.path)
        _sync_directory(self.path.parent)

    @contextlib.contextmanager
    def _cleaning_up(self) -> Iterator[None]:
        try:
            yield
        except BaseException as err:
            if self.descriptor is not None:
                os.close(self.descriptor)
                self.descriptor = None
            self.partial.unlink(missing_ok=True)
            if isinstance(err, OSError) and err.errno in _FULL:
                raise DiskFullError(self.path, len(self.data), free_bytes(self.path.parent)) from None
            raise


def write_bytes(path: Path, data: bytes | memoryview) -> None:
    """Replace ``path`` by ``data`` atomically (``PendingWrite``): a reader sees the old file or the whole new one."""
    PendingWrite(path, data).commit()


def write_text(path: Path, text: str) -> None:
    """``write_bytes`` of ``text`` in UTF-8."""
    write_bytes(path, text.encode())


def write_json(path: Path, data: Any, indent: int = 2) -> None:
    """``write_bytes`` of strict JSON (``dumps``)."""
    write_text(path, dumps(data, indent=indent))


KEPT = ".gz"  # a record kept beside a study: compressed, so that the repository stays small


def write_kept(path: Path, data: Any) -> Path:
    """``path`` + ``.gz``: strict, compact JSON compressed (``gzip``, a fixed time stamp: the same bytes each time)."""
    target = path.with_name(path.name + KEPT)
    compact = json.dumps(clean(data), separators=(",", ":"), default=str, allow_nan=False)
    write_bytes(target, gzip.compress(compact.encode(), mtime=0))
    return target


def record_path(path: Path) -> Path | None:
    """Where a record named ``path`` lies: the file itself, else its kept (compressed) copy; ``None`` if neither."""
    if path.is_file():
        return path
    kept = path.with_name(path.name + KEPT)
    return kept if kept.is_file() else None


def read_record(path: Path) -> Any:
    """The JSON a record holds, whether plain or kept compressed (``write_kept``); raises ``OSError`` if neither."""
    found = record_path(path) if not path.name.endswith(KEPT) else path
    if found is None:
        raise FileNotFoundError(f"no {path.name} in {path.parent}")
    raw = found.read_bytes()
    return json.loads(gzip.decompress(raw) if found.name.endswith(KEPT) else raw)


def staging_folder(beside: Path) -> Path:
    """A fresh hidden folder beside ``beside``, to be renamed over it whole, with the permissions ``mkdir`` gives.

    ``tempfile.mkdtemp`` makes its folder 0700 whatever the umask: renamed into place, it would keep collaborators on
    shared storage out of results they could read before.
    """
    staging = Path(tempfile.mkdtemp(prefix=f".{beside.name}.", dir=beside.parent))
    mask = os.umask(0)
    os.umask(mask)
    staging.chmod(0o777 & ~mask)
    return staging


def cannot_create(folder: Path, write: bool = True) -> str | None:
    """Why ``folder`` cannot be made (and, with ``write``, written in), or ``None`` when it can; leaves nothing.

    The nearest existing parent is asked by making and removing a folder in it: permissions, a read-only or a
    pseudo file system, a file in the way all answer as they would for the real one.
    """
    folder = folder.expanduser().absolute()
    existing = next(path for path in (folder, *folder.parents) if path.exists())
    if not existing.is_dir():
        return f"{existing} is a file"
    if existing == folder and not write:
        return None
    try:
        probe = tempfile.mkdtemp(prefix=".posenc-probe-", dir=existing)
    except OSError as err:
        return f"cannot make a folder in {existing} ({err.strerror or err})"
    os.rmdir(probe)
    return None


def _reserve(descriptor: int, length: int) -> None:
    """Claim the file's blocks up front; file systems that cannot (some network ones) find out at the write."""
    if length == 0:
        return
    try:
        os.posix_fallocate(descriptor, 0, length)
    except OSError as err:
        if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise


def _sync_directory(folder: Path) -> None:
    """Make a rename in ``folder`` durable (a no-op where directories cannot be opened)."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def _pause_if_asked(path: Path, descriptor: int, view: memoryview) -> None:
    """The test hook of ``PAUSE_ENV``: half the bytes written, the marker touched, then wait to be killed."""
    name, _, marker = os.environ.get(PAUSE_ENV, "").partition(":")
    if not marker or name != path.name or not path.exists():
        return
    os.write(descriptor, view[: len(view) // 2])
    os.fsync(descriptor)
    Path(marker).touch()
    while True:
        time.sleep(60)
