"""Corpora: where the text comes from, split into train / validation / test documents.

- ``stdlib``: the running interpreter's standard-library sources. Always present, no download, ~30 MB, and
  deterministic for a given Python: files are read in sorted order and split by a hash of their path, so the
  held-out documents never change between runs. Long files dominate the held-out streams, so evaluation at 32×
  the training length has real long-range context.
- ``text``: local text files (globs).
- ``hf``: a Hugging Face dataset by name (needs network, or a local HF cache, and ``pip install datasets``).
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPLITS = ("train", "validation", "test")


@dataclass
class Corpus:
    """Documents per split plus a fingerprint of their exact content (recorded in every run)."""

    name: str
    documents: dict[str, list[bytes]]
    fingerprint: str = field(default="")

    def __post_init__(self) -> None:
        if not self.fingerprint:
            digest = hashlib.sha256()
            for split in SPLITS:
                for doc in self.documents.get(split, []):
                    digest.update(split.encode() + len(doc).to_bytes(8, "little") + doc)
            self.fingerprint = digest.hexdigest()


def _held_out(key: str, val_percent: float, test_percent: float) -> str:
    """Stable split of one document by a hash of its key: the same key always lands in the same split."""
    bucket = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 10000 / 100.0
    if bucket < val_percent:
        return "validation"
    if bucket < val_percent + test_percent:
        return "test"
    return "train"


def _split_files(files: Sequence[Path], val_percent: float, test_percent: float) -> dict[str, list[bytes]]:
    """Split files by a hash of their *content*.

    Empty files are dropped and exact duplicates kept once, so no held-out document also appears in training.
    """
    documents: dict[str, list[bytes]] = {split: [] for split in SPLITS}
    seen: set[str] = set()
    for path in files:
        content = path.read_bytes()
        digest = hashlib.sha256(content).hexdigest()
        if content.strip() and digest not in seen:
            seen.add(digest)
            documents[_held_out(digest, val_percent, test_percent)].append(content)
    return documents


def stdlib_corpus(val_percent: float = 2.0, test_percent: float = 2.0, min_bytes: int = 0) -> Corpus:
    """The standard library's ``.py`` files (third-party site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        path
        for path in root.rglob("*.py")
        if "site-packages" not in path.parts
        and "dist-packages" not in path.parts
        and path.is_file()
        and path.stat().st_size >= min_bytes
    )
    if not files:
        raise RuntimeError(f"no standard-library sources under {root}; use data=text with your own files")
    return Corpus(name="stdlib", documents=_split_files(files, val_percent, test_percent))


def text_corpus(paths: Sequence[str], val_percent: float = 5.0, test_percent: float = 5.0) -> Corpus:
    """Local text files. Several files split by file; a single file split into its last percentages."""
    files = sorted(
        {Path(p).resolve() for pattern in paths for p in glob.glob(os.path.expanduser(pattern), recursive=True)}
    )
    folders = [pattern for pattern in paths if Path(os.path.expanduser(pattern)).is_dir()]
    files = [f for f in files if f.is_file()]
    if not files and folders:
        raise FileNotFoundError(
            f"data=text: {folders[0]} is a folder: give its files as a glob, e.g. "
            f"data.corpus_options.paths=['{folders[0].rstrip('/')}/**/*.txt']"
        )
    if not files:
        raise FileNotFoundError(
            f"data=text found no files for {list(paths)}: set data.corpus_options.paths to existing files or globs"
        )
    for file in files:
        with file.open("rb") as handle:
            if b"\0" in handle.read(65536):
                raise ValueError(f"data=text: {file} looks binary (it holds NUL bytes): give text files")
    if not any(file.stat().st_size for file in files):
        raise ValueError(f"data=text: every file of {list(paths)} is empty: give files with text in them")
    if len(files) >= 20:
        return Corpus(name="text", documents=_split_files(files, val_percent, test_percent))
    data = b"\n".join(f.read_bytes() for f in files)
    n = len(data)
    val_start = int(n * (1 - (val_percent + test_percent) / 100))
    test_start = int(n * (1 - test_percent / 100))
    return Corpus(
        name="text",
        documents={
            "train": [data[:val_start]],
            "validation": [data[val_start:test_start]],
            "test": [data[test_start:]],
        },
    )


def hf_corpus(path: str, name: str | None = None, text_column: str = "text") -> Corpus:
    """A Hugging Face dataset with train/validation/test splits (e.g. ``wikitext``, ``wikitext-103-raw-v1``)."""
    try:
        import datasets
    except ImportError as err:
        raise ImportError('data=hf needs the datasets package: pip install -e ".[hf]"') from err
    try:
        dataset = datasets.load_dataset(path, name)
    except Exception as err:  # datasets raises many types when offline or when the name is wrong
        offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"
        hint = " (HF_HUB_OFFLINE=1 is set: only datasets already in the local HF cache load)" if offline else ""
        raise RuntimeError(
            f"could not load Hugging Face dataset {path!r} config {name!r}{hint}: {err}. "
            "Check the name and your network, or use the embedded default (data=stdlib) or data=text."
        ) from err
    missing = [split for split in SPLITS if split not in dataset]
    if missing:
        raise ValueError(f"dataset {path!r} has no split(s) {missing}; it has {list(dataset)}")
    # WikiText stores one line per row; joining rows restores the running text the papers evaluate on.
    documents = {split: ["".join(dataset[split][text_column]).encode("utf-8")] for split in SPLITS}
    return Corpus(name=f"hf:{path}/{name}" if name else f"hf:{path}", documents=documents)


def load_corpus(kind: str, **options: Any) -> Corpus:
    """Build a corpus from its config: ``stdlib``, ``text`` (``paths``) or ``hf`` (``path``, ``name``)."""
    builders = {"stdlib": stdlib_corpus, "text": text_corpus, "hf": hf_corpus}
    if kind not in builders:
        raise ValueError(f"unknown corpus {kind!r}; available: {', '.join(builders)}")
    return builders[kind](**options)
