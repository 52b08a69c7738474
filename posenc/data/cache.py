"""Tokenised splits cached as flat uint16 memmaps, keyed by the corpus fingerprint.

Files are written to a temporary name in the same directory and renamed into place, and the metadata file is
renamed last: a crash or a concurrent run never leaves a half-written split that a later run would trust.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

from posenc.data.corpora import SPLITS, Corpus
from posenc.data.tokenizer import ByteTokenizer


def _atomic_write(path: Path, write) -> None:  # noqa: ANN001 - write(file object)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; caches are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def tokenized_splits(corpus: Corpus, tokenizer: ByteTokenizer, cache_dir: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read-only token streams per split, tokenising and caching them on first use."""
    folder = (
        Path(cache_dir).expanduser() / f"{corpus.name.replace('/', '_').replace(':', '_')}-{corpus.fingerprint[:16]}"
    )
    meta_path = folder / "meta.json"
    if not meta_path.exists():
        sizes = {}
        for split in SPLITS:
            tokens = tokenizer.concat(corpus.documents[split])
            if tokens.size == 0:
                raise ValueError(f"corpus {corpus.name} has an empty {split} split")
            sizes[split] = int(tokens.size)
            _atomic_write(folder / f"{split}.bin", lambda handle, t=tokens: handle.write(t.tobytes()))
        meta = {"corpus": corpus.name, "fingerprint": corpus.fingerprint, "dtype": "uint16", "tokens": sizes}
        _atomic_write(meta_path, lambda handle: handle.write(json.dumps(meta, indent=2).encode()))
    meta = json.loads(meta_path.read_text())
    return {
        split: np.memmap(folder / f"{split}.bin", dtype=np.uint16, mode="r", shape=(meta["tokens"][split],))
        for split in SPLITS
    }
