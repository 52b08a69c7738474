"""The perplexity section: one table per (training length, protocol), rows are lengths, columns schemes.

A protocol is how the held-out text is cut into windows: nonoverlapping windows, or sliding windows with a stride
in tokens or a fraction of each evaluation length (``f0.5``: N/2). Each table names its protocol. Cells, intervals and
the words beside them come from one crossed estimator over seeds and documents (``claims``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from posenc.report import claims
from posenc.report.common import Appendix, Columns, Key, order, table_head
from posenc.training.identity import columns


def stride_of(row: dict[str, Any]) -> int | str | None:
    """A row's stride as a group key: tokens, ``f0.5`` for a fraction of each length, ``None`` when nonoverlapping."""
    if row.get("stride_fraction") is not None:
        return f"f{float(row['stride_fraction']):g}"
    return row.get("stride")


def protocol(mode: str, stride: int | str | None, short: bool = False) -> str:
    """The protocol in words, as every table names it (``short``: for a column header)."""
    if mode != "sliding":
        return "nonoverlapping" if short else "nonoverlapping windows"
    if isinstance(stride, str) and stride.startswith("f"):
        fraction = float(stride[1:])
        shown = f"N/{1 / fraction:g}" if (1 / fraction).is_integer() else f"{fraction:g}·N"
        return f"sliding {shown}" if short else f"sliding windows, stride {shown} (N the evaluation length)"
    return f"sliding {stride}" if short else f"sliding windows, stride {stride} tokens"


def group_order(key: Key) -> tuple[int, bool, float]:
    """Groups by training length, then nonoverlapping first, then sliding from the longest stride to the shortest."""
    train_len, mode, stride = key
    if mode != "sliding":
        return train_len, False, 0.0
    if isinstance(stride, str) and stride.startswith("f"):
        return train_len, True, -float(stride[1:]) * 1e9
    return train_len, True, -float(stride or 0)


def suffix(key: Key) -> str:
    """A group's name in file names: ``L64_nonoverlap``, ``L64_sliding_s32``, ``L64_sliding_sf0.5``."""
    train_len, mode, stride = key
    return f"L{train_len}_{mode}" + (f"_s{stride}" if stride else "")


def group_runs(results: list[dict[str, Any]]) -> dict[Key, Columns]:
    """{(train_len, mode, stride): {column: [run results…]}} for language-modelling results.

    A column pools runs of one identity (``posenc.training.identity``): same settings but the seed.
    """
    by_key: dict[Key, list[dict[str, Any]]] = defaultdict(list)
    for result in results:
        rows = result.get("perplexity") or []
        if not rows or result.get("failed"):
            continue
        by_key[(int(result["train_len"]), rows[0]["mode"], stride_of(rows[0]))].append(result)
    return {key: columns(runs) for key, runs in by_key.items()}


def value(run: dict[str, Any], length: int, field: str) -> float | None:
    """One run's ``field`` (ppl, ratio, loss) at ``length``, ``None`` where that length failed or is missing."""
    for row in run["perplexity"]:
        if row["length"] == length and row["error"] is None:
            return row[field]
    return None


def perplexity_tables(key: Key, by_label: Columns, appendix: Appendix | None = None) -> str:
    """Perplexity and its ratio to in-length perplexity by length, one column per pooled identity, with words.

    Every cell and every word comes from the crossed estimator (``claims``): perplexity rows compare each column with
    the best of the row (one Holm family a row); ratio rows test each column's ratio against 1 (one family a table).
    """
    train_len, mode, stride = key
    labels = order(by_label)
    lengths = sorted({row["length"] for runs in by_label.values() for run in runs for row in run["perplexity"]})
    tokens = sorted({row["tokens"] for runs in by_label.values() for run in runs for row in run["perplexity"]})
    title = f"Trained at L={train_len} — {protocol(mode, stride)}"
    head = table_head(by_label, labels, title=title, appendix=appendix)
    equivalence, recorded = claims.margin([run for runs in by_label.values() for run in runs])
    log_margin = math.log1p(equivalence)
    out = [
        f"## {title}",
        "",
        f"Perplexity on held-out text, {protocol(mode, stride)}; {', '.join(map(str, tokens))} tokens scored at every "
        f"length (the same tokens: {_sample(by_label)}), so lengths are comparable. Each column pools runs whose "
        "settings differ only in their seed (n runs, each seed once); runs that differ in anything else are separate "
        "columns named by the difference. " + legend(equivalence, recorded),
        "",
        *head,
    ]
    ratio_estimates, flat = ratio_words(key, by_label)
    ratio_rows, detectable = [], []
    for length in lengths:
        cells = _perplexity_cells(by_label, labels, length, log_margin, detectable)
        out.append(f"| {length} | {length / train_len:g} | " + " | ".join(cells) + " |")
        ratios = [_ratio_cell(ratio_estimates, flat, label, length, train_len) for label in labels]
        ratio_rows.append(f"| {length} | {length / train_len:g} | " + " | ".join(ratios) + " |")
    out += ["", f"{PERPLEXITY_WORDS} Smallest difference from the best these comparisons detect (80% power, 5% level, "
            f"before Holm's adjustment): {claims.detectable_percent(detectable)}."]  # fmt: skip
    out += [
        "",
        "Ratio to the in-length (1×) perplexity of the same run (1.0 = no degradation), seed by seed and document by "
        f"document. {RATIO_WORDS} Smallest departure from 1 these tests detect: "
        f"{claims.detectable_percent(list(ratio_estimates.values()))}.",
        "",
    ]
    out += [*head, *ratio_rows]
    return "\n".join(out)


def ratio_words(key: Key, by_label: Columns) -> tuple[dict[tuple[str, int], Any], dict[str, Any]]:
    """Each column's ratio to its in-length perplexity at every length, and its words against 1 (``label@length``).

    One Holm family a table: every other table that shows one of these ratios (the protocols side by side) takes its
    word from here, so a number never earns two words in one report.
    """
    train_len = key[0]
    lengths = sorted({row["length"] for runs in by_label.values() for run in runs for row in run["perplexity"]})
    estimates = {
        (label, length): claims.log_ratio(by_label[label], length, train_len)
        for length in lengths
        if length != train_len
        for label in order(by_label)
    }
    log_margin = math.log1p(claims.margin([run for runs in by_label.values() for run in runs])[0])
    return estimates, claims.words({f"{label}@{length}": e for (label, length), e in estimates.items()}, log_margin)


def _ratio_cell(estimates: dict[Any, Any], flat: dict[str, Any], label: str, length: int, train_len: int) -> str:
    if length == train_len:
        return "1"
    return f"{claims.shown(estimates[label, length], 3)} {claims.mark(flat.get(f'{label}@{length}'))}".rstrip()


def _perplexity_cells(
    by_label: Columns, labels: list[str], length: int, log_margin: float, detectable: list[Any]
) -> list[str]:
    """One row's cells: each column's perplexity, ◆ on the best, the others' words against it."""
    estimates = {label: claims.log_perplexity(by_label[label], length) for label in labels}
    known = {label: e for label, e in estimates.items() if e is not None and math.isfinite(e.estimate)}
    if not known:
        return ["—" for _ in labels]
    best = min(known, key=lambda label: known[label].estimate)
    versus = {
        label: claims.log_ratio_between(by_label[label], by_label[best], length) for label in known if label != best
    }
    detectable += versus.values()
    found = claims.words(versus, log_margin)
    marks = {label: claims.BEST if label == best else claims.mark(found.get(label)) for label in labels}
    return [f"{claims.shown(estimates[label])} {marks.get(label, '')}".rstrip() for label in labels]


PERPLEXITY_WORDS = (
    f"Marks, from tests: {claims.BEST} the best perplexity of the row; every other column is compared with it, paired "
    f"by seed and document, Holm-adjusted over the row: {claims.MARKS['separated']} separated (p < 0.05), "
    f"{claims.MARKS['equivalent']} equivalent (two one-sided tests within the margin), both when a difference is "
    f"smaller than the margin, {claims.MARKS['inconclusive']} inconclusive (neither: not separated is not equal); no "
    "mark: not tested (fewer than two seeds shared with the best, and no documents to cross)."
)
RATIO_WORDS = (
    f"Marks: each ratio tested against 1, Holm-adjusted over the table: {claims.MARKS['separated']} separated from 1, "
    f"{claims.MARKS['equivalent']} equivalent to 1 within the margin (flat), {claims.MARKS['inconclusive']} "
    "inconclusive."
)


def legend(equivalence: float, recorded: bool) -> str:
    """What a cell is, and the margin the words are tested against."""
    whose = "the runs' own (eval.equivalence_margin)" if recorded else "the default: these runs predate the setting"
    return (
        "Cells: the perplexity over every seed and scored document, with its 95% interval from the seed, document and "
        "seed × document variance components (seeds and documents crossed); "
        f"{claims.SEEDS_ONLY_MARK}: over seeds only, where runs did not record their loss per document; a column of "
        f"one seed varies by document only. Equivalence margin: ±{equivalence:.0%} of the perplexity, {whose}."
    )


def _sample(by_label: Columns) -> str:
    """How the scored tokens were chosen, as the runs recorded it."""
    records = [run.get("documents") or {} for runs in by_label.values() for run in runs]
    samples = sorted({record.get("sample", "head") for record in records})
    counts = sorted({len(record.get("documents", [])) for record in records if record.get("documents")})
    words = {
        "documents": "a contiguous piece of every document of the split",
        "split": "the whole split",
        "head": "the split's first tokens",
    }
    shown = "; ".join(words.get(sample, sample) for sample in samples)
    return shown + (f", {', '.join(map(str, counts))} documents" if counts else "")
