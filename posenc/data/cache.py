"""Tokenised splits cached as flat uint16 memmaps, keyed by the corpus fingerprint.

Files are written to a temporary name in the same directory and renamed into place, and the metadata file is
renamed last: a crash or a concurrent run never leaves a half-written split that a later run would trust. The
metadata records each split's size and SHA-256; a cache that no longer matches it (a truncated or edited file) is
rebuilt, and temporary files a killed build left behind are removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

from posenc.data.corpora import SPLITS, Corpus
from posenc.data.tokenizer import ByteTokenizer
from posenc.jsonio import write_bytes, write_text


def cache_folder(corpus: Corpus, cache_dir: str | os.PathLike) -> Path:
    """The folder of one corpus's cache: its name and fingerprint, so that another text never reads it."""
    return Path(cache_dir).expanduser() / f"{corpus.name.replace('/', '_').replace(':', '_')}-{corpus.fingerprint[:16]}"


def tokenized_splits(corpus: Corpus, tokenizer: ByteTokenizer, cache_dir: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read-only token streams per split, tokenising and caching them on first use."""
    folder = cache_folder(corpus, cache_dir)
    meta_path = folder / "meta.json"
    _remove_orphans(folder)
    meta = _verified_meta(folder)
    if meta is None:
        sizes, digests = {}, {}
        for split in SPLITS:
            tokens = tokenizer.concat(corpus.documents[split])
            if tokens.size == 0:
                raise ValueError(
                    f"corpus {corpus.name} has an empty {split} split: give it more documents (or more text)"
                )
            sizes[split], digests[split] = int(tokens.size), hashlib.sha256(tokens.tobytes()).hexdigest()
            write_bytes(folder / f"{split}.bin", np.ascontiguousarray(tokens))
        meta = {
            "corpus": corpus.name,
            "fingerprint": corpus.fingerprint,
            "dtype": "uint16",
            "tokens": sizes,
            "sha256": digests,
        }
        write_text(meta_path, json.dumps(meta, indent=2))
    return {
        split: np.memmap(folder / f"{split}.bin", dtype=np.uint16, mode="r", shape=(meta["tokens"][split],))
        for split in SPLITS
    }


ORPHAN_AGE_SECONDS = 3600  # a temporary file this old belongs to no build still running


def _remove_orphans(folder: Path) -> None:
    """Delete temporary files of a build that was killed (a live build's are younger than an hour)."""
    if folder.is_dir():
        for tmp in [*folder.glob(".*.tmp"), *folder.glob(".*.partial")]:
            if time.time() - tmp.stat().st_mtime > ORPHAN_AGE_SECONDS:
                tmp.unlink(missing_ok=True)


def _verified_meta(folder: Path) -> dict | None:
    """The cache's metadata when every split file matches its recorded size and checksum, else ``None``."""
    meta_path = folder / "meta.json"
    if not meta_path.exists():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        for split in SPLITS:
            data = (folder / f"{split}.bin").read_bytes()
            expected = meta.get("sha256", {}).get(split)
            if len(data) != 2 * meta["tokens"][split] or (expected and hashlib.sha256(data).hexdigest() != expected):
                raise ValueError(f"{folder / f'{split}.bin'} does not match {meta_path}")
    except (OSError, ValueError, KeyError) as err:
        print(f"token cache {folder} is damaged ({err}); rebuilding it")
        meta_path.unlink(missing_ok=True)
        return None
    return meta
