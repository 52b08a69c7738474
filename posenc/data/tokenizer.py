"""Byte-level tokenizer: 256 byte values plus one end-of-document token. Lossless, needs no training."""

from __future__ import annotations

import numpy as np


class ByteTokenizer:
    """Bytes are their own ids; ``eod`` (256) separates documents in a concatenated stream."""

    vocab_size = 257
    eod = 256
    dtype = np.uint16

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(data, dtype=np.uint8).astype(self.dtype)

    def decode(self, ids: np.ndarray | list[int]) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    def concat(self, documents: list[bytes]) -> np.ndarray:
        """One stream of all documents, each followed by ``eod``."""
        total = sum(len(doc) + 1 for doc in documents)
        out = np.empty(total, dtype=self.dtype)
        cursor = 0
        for doc in documents:
            out[cursor : cursor + len(doc)] = np.frombuffer(doc, dtype=np.uint8)
            out[cursor + len(doc)] = self.eod
            cursor += len(doc) + 1
        return out
