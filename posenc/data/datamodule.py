"""Lightning data module over a token stream: random training windows, fixed held-out windows.

Training samples are windows at random offsets of the training stream, drawn from a generator seeded by
(seed, sample index): any sample can be regenerated from its index, which makes runs reproducible and lets a
resumed run continue with fresh samples instead of replaying the ones it already saw.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from posenc.data.cache import cache_folder, tokenized_splits
from posenc.data.corpora import load_corpus
from posenc.data.heldout import document_bounds
from posenc.data.leakage import overlaps
from posenc.data.retrieval import evaluation_options, task_dataset
from posenc.data.tokenizer import ByteTokenizer
from posenc.jsonio import write_text


class RandomWindows(Dataset):
    """``num_samples`` (input, target) pairs of ``seq_len`` tokens from random offsets of ``tokens``."""

    def __init__(self, tokens: np.ndarray, seq_len: int, num_samples: int, seed: int, start: int = 0) -> None:
        if tokens.size < seq_len + 2:
            raise ValueError(f"training stream has {tokens.size} tokens, fewer than seq_len={seq_len} + 1")
        self.tokens, self.seq_len, self.num_samples, self.seed, self.start = tokens, seq_len, num_samples, seed, start

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, self.start + index])
        offset = int(rng.integers(0, self.tokens.size - self.seq_len - 1))
        window = torch.from_numpy(self.tokens[offset : offset + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]


class ConsecutiveWindows(Dataset):
    """Disjoint consecutive windows of ``seq_len`` from the start of a held-out stream (at most ``max_windows``)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, max_windows: int | None = None) -> None:
        count = (tokens.size - 1) // seq_len
        if count < 1:
            raise ValueError(f"held-out stream of {tokens.size} tokens is shorter than one window of {seq_len}")
        self.tokens, self.seq_len = tokens, seq_len
        self.count = count if max_windows is None else min(count, max_windows)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq_len
        window = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]


class _WindowDataModule(L.LightningDataModule):
    """What every posenc data module shares: byte tokens, windows of ``seq_len``, numbered training samples.

    ``num_samples`` and ``start_sample`` are set again by the trainer once the world size and the resumed step are
    known (``posenc.training.callbacks.TokenAccounting``), so both modules keep them as plain attributes.
    """

    def __init__(self, seq_len: int, batch_size: int, num_samples: int, num_workers: int, seed: int) -> None:
        super().__init__()
        self.tokenizer = ByteTokenizer()
        self.seq_len, self.batch_size, self.num_samples = seq_len, batch_size, num_samples
        self.num_workers, self.seed = num_workers, seed
        self.start_sample = 0

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def _loader(self, dataset: Dataset) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )


class TextDataModule(_WindowDataModule):
    """Byte-level language modelling on a corpus, tokenised once and memory-mapped."""

    def __init__(
        self,
        corpus: str = "stdlib",
        corpus_options: dict[str, Any] | None = None,
        seq_len: int = 64,
        batch_size: int = 32,
        num_samples: int = 19200,
        val_windows: int | None = 256,
        cache_dir: str = "~/.cache/posenc",
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(seq_len, batch_size, num_samples, num_workers, seed)
        self.corpus_kind, self.corpus_options = corpus, dict(corpus_options or {})
        self.val_windows, self.cache_dir = val_windows, cache_dir
        self.splits: dict[str, np.ndarray] | None = None
        self.fingerprint: str | None = None
        self.cache_folder: Path | None = None

    def prepare_data(self) -> None:
        self.setup()

    def setup(self, stage: str | None = None) -> None:
        if self.splits is None:
            corpus = load_corpus(self.corpus_kind, **self.corpus_options)
            self.fingerprint = corpus.fingerprint
            self.splits = tokenized_splits(corpus, self.tokenizer, self.cache_dir)
            self.cache_folder = cache_folder(corpus, self.cache_dir)

    def stream(self, split: str) -> np.ndarray:
        """The whole token stream of one split (``train``, ``validation`` or ``test``)."""
        self.setup()
        return self.splits[split]

    def heldout_stream(
        self, split: str, max_containment: float | None, unit: str = "lines"
    ) -> tuple[np.ndarray, dict[str, Any] | None]:
        """A held-out split's stream without its near-copies of training text, and the record of what was dropped.

        A document whose containment (``posenc.data.leakage``: the share of its shingles in ``unit``, 5-line or sampled
        64-byte, found in the training split) reaches ``max_containment`` is a near-copy: scoring it measures memory,
        not modelling. ``None`` keeps every document (and records nothing).
        """
        stream = self.stream(split)
        if max_containment is None or split == "train":
            return stream, None
        containment = self._containment(split, unit)
        bounds = document_bounds(stream)
        dropped = [index for index, share in enumerate(containment) if share >= max_containment and index < len(bounds)]
        record = {
            "max_containment": max_containment,
            "unit": unit,
            "split_documents": len(bounds),
            "dropped": [
                {"document": i, "containment": containment[i], "tokens": bounds[i][1] - bounds[i][0]} for i in dropped
            ],
        }
        if len(dropped) == len(bounds):
            raise ValueError(
                f"every document of the {split} split is a near-copy of training text (containment ≥ "
                f"{max_containment:g}): set eval.max_containment=null to score them anyway, or use another corpus"
            )
        if not dropped:
            return stream, record
        keep = [stream[start:end] for index, (start, end) in enumerate(bounds) if index not in set(dropped)]
        return np.concatenate(keep), record

    def _containment(self, split: str, unit: str = "lines") -> list[float]:
        """Every document's containment in the training split, computed once a corpus and unit, kept by its tokens."""
        self.setup()
        suffix = "" if unit == "lines" else f"-{unit}"  # the line shingles' cache keeps the name it always had
        path = self.cache_folder / f"containment-{split}{suffix}.json"
        if path.is_file():
            return json.loads(path.read_text())
        corpus = load_corpus(self.corpus_kind, **self.corpus_options)
        shares = [found.containment for found in overlaps(corpus, held_out=(split,), unit=unit)]
        write_text(path, json.dumps(shares))
        return shares

    def describe(self) -> dict[str, Any]:
        """What to record in a run: corpus, fingerprint and split sizes."""
        self.setup()
        return {
            "corpus": self.corpus_kind,
            "fingerprint": self.fingerprint,
            "tokens": {split: int(tokens.size) for split, tokens in self.splits.items()},
        }

    def train_dataloader(self) -> DataLoader:
        dataset = RandomWindows(self.stream("train"), self.seq_len, self.num_samples, self.seed, self.start_sample)
        return self._loader(dataset)

    def val_dataloader(self) -> DataLoader:
        return self._loader(ConsecutiveWindows(self.stream("validation"), self.seq_len, self.val_windows))

    def test_dataloader(self) -> DataLoader:
        return self._loader(ConsecutiveWindows(self.stream("test"), self.seq_len, self.val_windows))


class TaskDataModule(_WindowDataModule):
    """A synthetic task (passkey, copy, or a retrieval task of ``retrieval.py``) generated at the training length."""

    def __init__(
        self,
        task: str,
        seq_len: int = 64,
        batch_size: int = 32,
        num_samples: int = 19200,
        val_windows: int | None = 256,
        num_workers: int = 0,
        seed: int = 0,
        task_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(seq_len, batch_size, num_samples, num_workers, seed)
        self.task, self.val_samples = task, val_windows or 256
        self.task_options = dict(task_options or {})

    def describe(self) -> dict[str, Any]:
        return {"task": self.task, "seed": self.seed} | (
            {"task_options": self.task_options} if self.task_options else {}
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(
            task_dataset(self.task, self.seq_len, self.num_samples, self.seed, self.start_sample, self.task_options)
        )

    def val_dataloader(self) -> DataLoader:
        # A different seed stream from training: validation keys are never training keys. Validation windows are
        # generated as an evaluation generates them (no training-only options).
        options = evaluation_options(self.task_options)
        return self._loader(
            task_dataset(self.task, self.seq_len, self.val_samples, self.seed + 1_000_003, options=options)
        )
