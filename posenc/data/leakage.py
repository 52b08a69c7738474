"""Near-duplicate leakage between a corpus's splits: held-out documents whose text also sits in training documents.

The corpora drop exact duplicates only (``corpora._split_files``); a file copied with small edits (a vendored module,
a test beside its fixture) would still let a model be scored on text it was trained on. Every document is cut into
shingles: each run of ``size`` consecutive non-blank lines, stripped (indentation and trailing spaces do not hide a
copy). For every held-out document this reports its **containment**, the share of its shingles found anywhere in the
training split, and the training document most like it by Jaccard similarity of their shingle sets (Broder, 1997;
near-duplicate at ≥ 0.8, as in Lee et al., 2022). Shingles of boilerplate (a license header, ``if __name__ ==
"__main__":`` blocks) are shared by many files, so a small containment is expected; a large one is a copy.

Line shingles miss a copy whose lines were edited every few lines, or that is one long line: a line that differs
anywhere changes every shingle holding it. The other unit, ``bytes``, fingerprints every 64-byte window instead (the
n-grams of Lee et al., 2022's exact-substring deduplication, at their 50-token scale in bytes), keeping the windows
whose hash is 0 modulo 8: a content-defined sample, so a window two documents share is kept in both, and containment
is estimated from an eighth of the windows. On the embedded corpus's test split, ``bz2.py`` holds 44% of its sampled
64-byte windows in training text.

``python -m posenc.data.leakage`` prints the table for the embedded corpus (``--corpus text --paths ...`` for
local files).
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from posenc.data.corpora import Corpus, load_corpus

SHINGLE_LINES = 5
NEAR_DUPLICATE = 0.8
UNITS = ("lines", "bytes")  # what a shingle is: 5 non-blank lines, or a 64-byte window
NGRAM_BYTES = 64
NGRAM_SAMPLE = 8  # keep the windows whose hash is 0 modulo this
_PRIME = 0x100000001B3  # FNV-1a's 64-bit prime; odd, so it has an inverse modulo 2^64
_INVERSE = pow(_PRIME, -1, 1 << 64)


def shingles(document: bytes, size: int = SHINGLE_LINES) -> set[int]:
    """Hashes of every run of ``size`` consecutive non-blank, stripped lines (one run for a shorter document)."""
    lines = [line.strip() for line in document.splitlines() if line.strip()]
    if not lines:
        return set()
    return {hash(tuple(lines[i : i + size])) for i in range(max(1, len(lines) - size + 1))}


def byte_ngrams(document: bytes, size: int = NGRAM_BYTES, sample: int = NGRAM_SAMPLE) -> set[int]:
    """Hashes of the ``size``-byte windows of ``document`` whose (mixed) hash is 0 modulo ``sample``.

    A polynomial hash of each window, h_i = Σ_j b_{i+j} P^{size−1−j} modulo 2^64, computed for every window at once:
    with S_i = Σ_{k<i} b_k P^{−k}, h_i = P^{i+size−1} (S_{i+size} − S_i), P^{−1} being P's inverse modulo 2^64 (uint64
    arithmetic wraps there). Then mixed (splitmix64's finaliser), so that the sample is not set by the last byte.
    """
    if len(document) < size:
        return set()
    values = np.frombuffer(document, dtype=np.uint8).astype(np.uint64) + np.uint64(1)  # no byte hashes as nothing
    count = len(values)
    with np.errstate(over="ignore"):
        powers = np.cumprod(np.full(count, _PRIME, dtype=np.uint64)) * np.uint64(_INVERSE)  # P^0 … P^(n−1)
        inverses = np.cumprod(np.full(count, _INVERSE, dtype=np.uint64)) * np.uint64(_PRIME)
        sums = np.concatenate(([np.uint64(0)], np.cumsum(values * inverses, dtype=np.uint64)))
        hashes = powers[size - 1 :] * (sums[size:] - sums[:-size])
        hashes ^= hashes >> np.uint64(29)
        hashes *= np.uint64(0xBF58476D1CE4E5B9)
        hashes ^= hashes >> np.uint64(32)
    return set(hashes[hashes % np.uint64(sample) == 0].tolist())


def fingerprints(document: bytes, unit: str = "lines") -> set[int]:
    """A document's shingles in ``unit``: 5-line shingles (``lines``) or sampled 64-byte windows (``bytes``)."""
    if unit not in UNITS:
        raise ValueError(f"a near-copy's unit must be one of {', '.join(UNITS)}, got {unit!r}")
    return shingles(document) if unit == "lines" else byte_ngrams(document)


@dataclass
class Overlap:
    """One held-out document against the training split."""

    split: str
    index: int
    size: int  # bytes
    containment: float  # share of its shingles found in any training document
    best_jaccard: float  # Jaccard similarity with the training document most like it
    best_match: int | None  # that training document's index in the split


def overlaps(corpus: Corpus, held_out: Sequence[str] = ("validation", "test"), unit: str = "lines") -> list[Overlap]:
    """Every held-out document's overlap with the training split, in shingles of ``unit`` (the module docstring)."""
    train = [fingerprints(document, unit) for document in corpus.documents["train"]]
    owners: dict[int, list[int]] = {}
    for index, shingle_set in enumerate(train):
        for shingle in shingle_set:
            owners.setdefault(shingle, []).append(index)
    out = []
    for split in held_out:
        for index, document in enumerate(corpus.documents[split]):
            mine = fingerprints(document, unit)
            shared = Counter(owner for shingle in mine for owner in owners.get(shingle, ()))
            found = sum(1 for shingle in mine if shingle in owners)
            best, best_jaccard = None, 0.0
            for owner, count in shared.items():
                jaccard = count / (len(mine) + len(train[owner]) - count)
                if jaccard > best_jaccard:
                    best, best_jaccard = owner, jaccard
            out.append(Overlap(split, index, len(document), found / len(mine) if mine else 0.0, best_jaccard, best))
    return out


def summary(found: list[Overlap]) -> list[str]:
    """The printout: the held-out documents by containment, then the near-duplicates and the bytes they hold."""
    lines = [f"{'split':>10} {'doc':>4} {'bytes':>8} {'containment':>11} {'best Jaccard':>12} {'train doc':>9}"]
    for one in sorted(found, key=lambda o: -o.containment):
        match = "" if one.best_match is None else str(one.best_match)
        lines.append(
            f"{one.split:>10} {one.index:>4} {one.size:>8} {one.containment:>11.3f} {one.best_jaccard:>12.3f} "
            f"{match:>9}"
        )
    for split in sorted({one.split for one in found}):
        mine = [one for one in found if one.split == split]
        near = [one for one in mine if one.best_jaccard >= NEAR_DUPLICATE]
        total = sum(one.size for one in mine)
        weighted = sum(one.containment * one.size for one in mine) / total if total else 0.0
        lines.append(
            f"{split}: {len(mine)} documents, {total} bytes; {len(near)} near-duplicate(s) of a training document "
            f"(Jaccard ≥ {NEAR_DUPLICATE}, {sum(one.size for one in near)} bytes); containment weighted by size "
            f"{weighted:.3f}"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m posenc.data.leakage", description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default="stdlib", choices=("stdlib", "text"))
    parser.add_argument("--paths", nargs="*", help="files or globs for --corpus text")
    parser.add_argument("--unit", default="lines", choices=UNITS, help="5-line shingles, or sampled 64-byte windows")
    args = parser.parse_args(argv)
    options = {"paths": args.paths} if args.corpus == "text" else {}
    try:
        corpus = load_corpus(args.corpus, **options)
    except (FileNotFoundError, ValueError, TypeError) as err:
        raise SystemExit(f"posenc.data.leakage: {err}") from None
    print("\n".join(summary(overlaps(corpus, unit=args.unit))))


if __name__ == "__main__":
    main()
