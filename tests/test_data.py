"""Corpora, tokenizer, atomic memmap cache and windows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from posenc.data.cache import tokenized_splits
from posenc.data.corpora import Corpus, hf_corpus, stdlib_corpus, text_corpus
from posenc.data.datamodule import ConsecutiveWindows, RandomWindows, TextDataModule
from posenc.data.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def stdlib() -> Corpus:
    return stdlib_corpus()


def test_stdlib_corpus_is_large_deterministic_and_held_out(stdlib: Corpus) -> None:
    sizes = {split: sum(map(len, docs)) for split, docs in stdlib.documents.items()}
    assert sum(sizes.values()) > 10_000_000
    # held-out streams long enough to evaluate at 32× the default training length (64) many times over
    assert min(sizes["validation"], sizes["test"]) > 100 * 32 * 64
    assert stdlib_corpus().fingerprint == stdlib.fingerprint
    train = set(stdlib.documents["train"])
    assert not train & set(stdlib.documents["validation"])


def test_byte_tokenizer_roundtrip() -> None:
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'ü'\n"
    assert tok.decode(tok.encode(text)) == text
    stream = tok.concat([b"ab", b"c"])
    assert stream.tolist() == [97, 98, tok.eod, 99, tok.eod]


def test_cache_is_written_once_and_atomically(tmp_path: Path) -> None:
    corpus = Corpus("toy", {"train": [b"hello world"] * 3, "validation": [b"abc"], "test": [b"xyz"]})
    splits = tokenized_splits(corpus, ByteTokenizer(), tmp_path)
    assert ByteTokenizer().decode(splits["validation"]) == "abc"
    folder = next(tmp_path.iterdir())
    assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "test.bin", "train.bin", "validation.bin"]
    assert json.loads((folder / "meta.json").read_text())["fingerprint"] == corpus.fingerprint
    mtime = (folder / "train.bin").stat().st_mtime_ns
    tokenized_splits(corpus, ByteTokenizer(), tmp_path)
    assert (folder / "train.bin").stat().st_mtime_ns == mtime  # reused, not rewritten


def test_cache_leaves_nothing_half_written_on_failure(tmp_path: Path) -> None:
    corpus = Corpus("toy", {"train": [b"hello"], "validation": [], "test": [b"x"]})
    with pytest.raises(ValueError, match="empty validation split"):
        tokenized_splits(corpus, ByteTokenizer(), tmp_path)
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != "train.bin"]
    assert leftovers == []  # no meta.json, no temp files: the next run starts over


def test_text_corpus(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("x" * 1000)
    corpus = text_corpus([str(tmp_path / "*.txt")])
    sizes = {split: sum(map(len, docs)) for split, docs in corpus.documents.items()}
    assert sizes == {"train": 900, "validation": 50, "test": 50}
    with pytest.raises(FileNotFoundError, match="data=text found no files"):
        text_corpus([str(tmp_path / "*.md")])


def test_hf_corpus_fails_clearly_offline() -> None:
    with pytest.raises((ImportError, RuntimeError), match=r"datasets package|could not load Hugging Face dataset"):
        hf_corpus("wikitext", "wikitext-103-raw-v1")


def test_random_windows_are_reproducible_and_shifted() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    data = RandomWindows(tokens, seq_len=16, num_samples=10, seed=3)
    x, y = data[4]
    assert torch.equal(y[:-1], x[1:]) and torch.equal(x, RandomWindows(tokens, 16, 10, 3)[4][0])
    assert not torch.equal(x, RandomWindows(tokens, 16, 10, 4)[4][0])


def test_consecutive_windows_cover_the_stream() -> None:
    data = ConsecutiveWindows(np.arange(100, dtype=np.uint16), seq_len=10)
    assert len(data) == 9
    x, y = data[2]
    assert x.tolist() == list(range(20, 30)) and y.tolist() == list(range(21, 31))


def test_datamodule_describes_its_corpus(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("some text " * 500)
    dm = TextDataModule(
        corpus="text",
        corpus_options={"paths": [str(tmp_path / "a.txt")]},
        seq_len=8,
        batch_size=4,
        num_samples=8,
        cache_dir=str(tmp_path / "cache"),
    )
    info = dm.describe()
    assert info["corpus"] == "text" and len(info["fingerprint"]) == 64 and info["tokens"]["train"] > 0
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 8) and y.shape == (4, 8)


def test_near_duplicate_leakage_is_found_by_shingles() -> None:
    from posenc.data.leakage import overlaps, summary

    lines = [f"line {i} = compute({i}, {i * i})" for i in range(60)]
    original = "\n".join(lines).encode()
    edited = "\n".join(
        ["    " + line for line in lines[:40]] + ["changed"] + lines[41:]
    ).encode()  # reindented, one edit
    unrelated = "\n".join(f"other {i}" for i in range(60)).encode()
    corpus = Corpus(
        "toy", {"train": [unrelated, original], "validation": [edited, unrelated + b"\nmore"], "test": [b"x = 1"]}
    )
    copy, fresh, short = overlaps(corpus)
    assert copy.best_match == 1 and copy.best_jaccard > 0.8 and copy.containment > 0.9  # the copy, found
    assert fresh.best_match == 0 and fresh.containment > 0.9  # a training file with a line added is leaked too
    assert short.containment == 0.0 and short.best_match is None
    printed = "\n".join(summary([copy, fresh, short]))
    assert "validation: 2 documents" in printed and "2 near-duplicate(s) of a training document" in printed


def test_byte_windows_find_a_copy_that_line_shingles_miss() -> None:
    from posenc.data.leakage import NGRAM_BYTES, NGRAM_SAMPLE, byte_ngrams, overlaps

    # The vectorised rolling hash is the plain one: every window hashed on its own, then mixed and sampled.
    document = bytes(range(256)) * 2 + b"tail"
    mask = (1 << 64) - 1
    expected = set()
    for start in range(len(document) - NGRAM_BYTES + 1):
        value = 0
        for byte in document[start : start + NGRAM_BYTES]:
            value = (value * 0x100000001B3 + byte + 1) & mask
        value ^= value >> 29
        value = (value * 0xBF58476D1CE4E5B9) & mask
        value ^= value >> 32
        if value % NGRAM_SAMPLE == 0:
            expected.add(value)
    assert byte_ngrams(document) == expected and expected
    assert byte_ngrams(b"short") == set()
    # A copy edited on every second line: each 5-line shingle holds an edit, while most 64-byte windows do not.
    lines = [f"value_{i} = compute_something_long({i}, {i * i}, 'a fairly long constant string')" for i in range(80)]
    original = "\n".join(lines).encode()
    edited = "\n".join(line + ("  # edited" if i % 2 else "") for i, line in enumerate(lines)).encode()
    corpus = Corpus("toy", {"train": [original], "validation": [edited], "test": [b"x = 1"]})
    (by_lines,) = overlaps(corpus, held_out=("validation",))
    (by_bytes,) = overlaps(corpus, held_out=("validation",), unit="bytes")
    assert by_lines.containment == 0.0 and by_bytes.containment > 0.5


def test_near_copies_of_training_text_are_left_out_of_the_scored_split_and_counted(tmp_path) -> None:
    import hashlib

    from posenc.data.corpora import _held_out
    from posenc.data.datamodule import TextDataModule

    def lands_in(split: str, text: str) -> str:  # the first variant of ``text`` the content hash puts in ``split``
        for variant in range(10_000):
            candidate = f"{text}\nvariant = {variant}\n"
            if _held_out(hashlib.sha256(candidate.encode()).hexdigest(), 5.0, 5.0) == split:
                return candidate
        raise AssertionError("no variant landed there")

    trained = "\n".join(f"row_{i} = table[{i}] * {i}" for i in range(80))
    files = {"trained": lands_in("train", trained), "copy": lands_in("validation", trained)}
    files["fresh"] = lands_in("validation", "\n".join(f"other_{i} = {i} ** 2" for i in range(80)))
    files |= {f"filler{i}": lands_in("train", f"filler {i}\n" * 30) for i in range(20)}
    files["tested"] = lands_in("test", "tested = True")
    for name, text in files.items():
        (tmp_path / f"{name}.txt").write_text(text)
    data = TextDataModule("text", {"paths": [str(tmp_path / "*.txt")]}, seq_len=8, cache_dir=str(tmp_path / "cache"))
    whole = data.stream("validation")
    kept, record = data.heldout_stream("validation", 0.5)
    assert record["split_documents"] == 2 and len(record["dropped"]) == 1
    assert record["dropped"][0]["containment"] > 0.9
    assert len(kept) == len(whole) - record["dropped"][0]["tokens"]
    assert bytes(kept[:7].astype("uint8")) == b"other_0"  # files in name order: the copy went, the fresh one stays
    stream, nothing = data.heldout_stream("validation", None)
    assert nothing is None and stream is whole
    _, by_bytes = data.heldout_stream("validation", 0.5, "bytes")  # the copy again, in 64-byte windows
    assert by_bytes["unit"] == "bytes" and [d["document"] for d in by_bytes["dropped"]] == [0]
    assert any((tmp_path / "cache").rglob("containment-validation-bytes.json"))  # kept apart from the lines cache
