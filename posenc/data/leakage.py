"""Near-duplicate leakage between a corpus's splits: held-out documents whose text also sits in training documents.

The corpora drop exact duplicates only (``corpora._split_files``); a file copied with small edits (a vendored module,
a test beside its fixture) would still let a model be scored on text it was trained on. Every document is cut into
shingles: each run of ``size`` consecutive non-blank lines, stripped (indentation and trailing spaces do not hide a
copy). For every held-out document this reports its **containment**, the share of its shingles found anywhere in the
training split, and the training document most like it by Jaccard similarity of their shingle sets (Broder, 1997;
near-duplicate at ≥ 0.8, as in Lee et al., 2022). Shingles of boilerplate (a license header, ``if __name__ ==
"__main__":`` blocks) are shared by many files, so a small containment is expected; a large one is a copy.

``python -m posenc.data.leakage`` prints the table for the embedded corpus (``--corpus text --paths ...`` for
local files).
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from posenc.data.corpora import Corpus, load_corpus

SHINGLE_LINES = 5
NEAR_DUPLICATE = 0.8


def shingles(document: bytes, size: int = SHINGLE_LINES) -> set[int]:
    """Hashes of every run of ``size`` consecutive non-blank, stripped lines (one run for a shorter document)."""
    lines = [line.strip() for line in document.splitlines() if line.strip()]
    if not lines:
        return set()
    return {hash(tuple(lines[i : i + size])) for i in range(max(1, len(lines) - size + 1))}


@dataclass
class Overlap:
    """One held-out document against the training split."""

    split: str
    index: int
    size: int  # bytes
    containment: float  # share of its shingles found in any training document
    best_jaccard: float  # Jaccard similarity with the training document most like it
    best_match: int | None  # that training document's index in the split


def overlaps(
    corpus: Corpus, held_out: Sequence[str] = ("validation", "test"), size: int = SHINGLE_LINES
) -> list[Overlap]:
    """Every held-out document's overlap with the training split (see the module docstring)."""
    train = [shingles(document, size) for document in corpus.documents["train"]]
    owners: dict[int, list[int]] = {}
    for index, shingle_set in enumerate(train):
        for shingle in shingle_set:
            owners.setdefault(shingle, []).append(index)
    out = []
    for split in held_out:
        for index, document in enumerate(corpus.documents[split]):
            mine = shingles(document, size)
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
    parser.add_argument("--lines", type=int, default=SHINGLE_LINES, help="lines per shingle")
    args = parser.parse_args(argv)
    options = {"paths": args.paths} if args.corpus == "text" else {}
    try:
        corpus = load_corpus(args.corpus, **options)
    except (FileNotFoundError, ValueError, TypeError) as err:
        raise SystemExit(f"posenc.data.leakage: {err}") from None
    print("\n".join(summary(overlaps(corpus, size=args.lines))))


if __name__ == "__main__":
    main()
