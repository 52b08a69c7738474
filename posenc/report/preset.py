"""Comparisons fixed in advance: every column against each reference scheme, corrected as one family.

The perplexity tables mark each column against the best one of its row, a reference picked after the fact. Here
the comparisons are named before any result is read: every column against each reference (``--references``, by
default ALiBi and NoPE: the best-known fixed prior and no prior at all), at every evaluated length, for perplexity
under each protocol and for MQAR recall. Every test of the report goes into one family, whose p-values are
adjusted together by Holm's method, so the chance of any false "separated" claim in the whole section stays at 5%.

- Perplexity: the log ratio log(ppl_column / ppl_reference), paired by seed and document, with the crossed
  estimator (``posenc/evaluate/crossed.py`` through ``claims``) where every run recorded its loss per document over
  the same documents; otherwise over the seeds alone, marked ᵗ.
- Recall (MQAR, the rate-selected columns of the retrieval section): the difference of exact-match accuracy, paired
  by seed and evaluation window (a window's answers share their context), with the same estimator.

Each test earns its words from two Holm families over the section (``claims.words``): separated, equivalent (within
the runs' margin: ±1% of perplexity, ±2 points of accuracy by default), or inconclusive; each cell also states the
smallest difference it detects (80% power, 5% level, before adjustment).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from posenc.evaluate.crossed import Estimate, crossed, verdict
from posenc.evaluate.effective import learned
from posenc.evaluate.stats import holm
from posenc.report import claims
from posenc.report.common import UNSETTLED, Columns, order, unsettled_line, unsettled_seeds
from posenc.report.perplexity import group_runs, protocol
from posenc.report.retrieval import selected
from posenc.report.tasks import task_columns

DEFAULT_REFERENCES = ("alibi", "nope")


def reference_columns(by_label: Columns, references: Sequence[str]) -> list[str]:
    """The column of each reference present: its exact label, else the one column of that scheme."""
    found = []
    for reference in references:
        if reference in by_label:
            found.append(reference)
            continue
        same = [label for label in by_label if label.split(" · ")[0] == reference]
        if len(same) == 1:
            found.append(same[0])
    return found


OWN = "* · "  # a reference of this form names, for each column, a column of its own scheme: "* · sink=none"


def pairs(by_label: Columns, references: Sequence[str]) -> list[tuple[str, str]]:
    """(column, reference) for every column against every reference, each unordered pair once.

    A reference ``* · <setting>`` compares each column with its own scheme's column of that setting only
    (``alibi · sink=learned`` with ``alibi · sink=none``): a study of a setting across schemes tests the setting
    within each scheme, not every column against every scheme's baseline.
    """
    refs = reference_columns(by_label, [r for r in references if not r.startswith(OWN)])
    out = []
    for index, reference in enumerate(refs):
        for label in order(by_label):
            if label != reference and label not in refs[:index]:
                out.append((label, reference))
    for pattern in (r for r in references if r.startswith(OWN)):
        for label in order(by_label):
            own = f"{label.split(' · ')[0]} · {pattern[len(OWN) :]}"
            if own in by_label and own != label and (label, own) not in out and (own, label) not in out:
                out.append((label, own))
    return out


def described(references: Sequence[str]) -> str:
    """The references in words: ``alibi, nope``; ``its own scheme's sink=none column``."""
    words = [r if not r.startswith(OWN) else f"its own scheme's {r[len(OWN) :]} column" for r in references]
    return ", ".join(words)


MIN_LEARNED = 2  # seeds a recall comparison needs: one seed has no seed-to-seed variance to report


def _shared(by_label: Columns, a: str, b: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    seeds_a = {run.get("seed"): run for run in by_label[a]}
    seeds_b = {run.get("seed"): run for run in by_label[b]}
    return [(seeds_a[s], seeds_b[s]) for s in sorted(set(seeds_a) & set(seeds_b), key=str)]


def perplexity_test(pairs_: list[tuple[dict[str, Any], dict[str, Any]]], length: int) -> Estimate | None:
    """The log ratio column / reference at one length over the shared seeds (module docstring)."""
    if len(pairs_) < 2:
        return None
    return claims.log_ratio_between([x for x, _ in pairs_], [y for _, y in pairs_], length)


def recall_test(pairs_: list[tuple[dict[str, Any], dict[str, Any]]], length: int) -> Estimate | None:
    """The accuracy difference column − reference at one length, seeds × evaluation windows crossed."""
    grids = [(_window_accuracy(x, length), _window_accuracy(y, length)) for x, y in pairs_]
    grids = [(a, b) for a, b in grids if a is not None and b is not None and len(a) == len(b)]
    if len(grids) < MIN_LEARNED or len({len(a) for a, _ in grids}) != 1:  # one seed: no seed variance to give
        return None
    return crossed(np.asarray([a for a, _ in grids]) - np.asarray([b for _, b in grids]))


def preset_section(results: list[dict[str, Any]], references: Sequence[str] = DEFAULT_REFERENCES) -> list[str]:
    """Markdown lines of the section; empty when no table holds a reference and another column."""
    tests: list[tuple[str, str, str, int, Estimate]] = []  # (table, column, reference, length, estimate)
    runs_of: dict[str, list[dict[str, Any]]] = {}  # kind -> every run compared: their margins
    tables: dict[str, tuple[int, str]] = {}  # table title -> (train_len, what the cells are)
    unsettled: dict[str, str] = {}  # column -> its seeds whose positional parameters had not settled

    def compare(title: str, train_len: int, by_label: Columns, rows: str, test: Callable, kind: str) -> None:
        """Every column against each reference at every length of ``rows`` (``perplexity`` or ``mqar``)."""
        unsettled.update({label: note for label in order(by_label) if (note := unsettled_seeds(by_label[label]))})
        runs_of.setdefault(kind, []).extend(run for runs in by_label.values() for run in runs)
        lengths = sorted({row["length"] for runs in by_label.values() for run in runs for row in run[rows]})
        for column, reference in pairs(by_label, references):
            for length in lengths:
                result = test(_shared(by_label, column, reference), length)
                if result is not None:
                    tests.append((title, column, reference, length, result))
                    tables[title] = (train_len, kind)

    for (train_len, mode, stride), by_label in sorted(group_runs(results).items(), key=lambda item: str(item[0])):
        title = f"Perplexity, trained at L={train_len} — {protocol(mode, stride)}"
        compare(title, train_len, by_label, "perplexity", perplexity_test, "ppl")
    unlearned: list[str] = []
    for train_len, all_columns in sorted(task_columns(results, "mqar").items()):
        title = f"MQAR recall, trained at L={train_len}"
        columns, left_out = learned_seeds(selected(all_columns)[0], train_len)
        unlearned += [f"{title}: {note}" for note in left_out]
        compare(title, train_len, columns, "mqar", recall_test, "recall")
    if not tests:
        return []
    margins = {
        kind: claims.margin(runs_of[kind], key)[0]
        for kind, key in (("ppl", "equivalence_margin"), ("recall", "equivalence_accuracy"))
        if runs_of.get(kind)
    }
    on_scale = {"ppl": math.log1p(margins.get("ppl", 0.0)), "recall": margins.get("recall", 0.0)}
    differs = holm({str(i): test[4].p_value for i, test in enumerate(tests)})
    same = holm({str(i): test[4].equivalence_p(on_scale[tables[test[0]][1]]) for i, test in enumerate(tests)})
    found = {str(i): verdict(differs[str(i)], same[str(i)]) for i in range(len(tests))}
    shown_margins = [f"±{margins['ppl']:.0%} of perplexity"] if "ppl" in margins else []
    shown_margins += [f"±{margins['recall']:.2f} of accuracy"] if "recall" in margins else []
    out = [
        "",
        "## Comparisons fixed in advance",
        "",
        f"Every column against {described(references)} at every length, named before the results were read. "
        "Perplexity: the ratio to the reference, paired by seed and scored document, with its 95% interval from the "
        "crossed estimator (seed, document and seed × document variance; ᵗ: over seeds only, where per-document "
        "losses were not recorded); recall: the difference of exact-match accuracy, paired by seed and evaluation "
        f"window, from the same estimator. The {len(tests)} tests are two families, each adjusted by Holm's method: "
        "no difference (p below, Holm-adjusted) and equivalence within the margin (two one-sided tests, "
        f"{' and '.join(shown_margins)}). Words: {claims.MARKS['separated']} separated, {claims.MARKS['equivalent']} "
        f"equivalent, {claims.MARKS['inconclusive']} inconclusive (not separated is not equal). Each cell: the "
        "estimate [95% interval], the Holm-adjusted p of no difference, its words, n seeds, and the smallest "
        "difference it detects (80% power, 5% level, before adjustment).",
    ]
    if unlearned:
        out += [
            "",
            "Recall is compared only where it was learned: each column by its seeds that learned MQAR at the training "
            "length (k of n), since past it a seed that never learned measures its failure at 1×, not extrapolation. "
            "Left out: " + "; ".join(unlearned) + ".",
        ]
    if unsettled:
        out += ["", unsettled_line(unsettled)]
    for title, (train_len, kind) in tables.items():
        mine = [(index, test) for index, test in enumerate(tests) if test[0] == title]
        out += _table(title, train_len, kind, mine, {str(i): (differs[str(i)], found[str(i)]) for i, _ in mine},
                      unsettled)  # fmt: skip
    return out


def _table(
    title: str, train_len: int, kind: str, mine: list[tuple[int, tuple]], words: dict[str, tuple], unsettled: dict
) -> list[str]:
    """One table's tests, a block per reference: rows lengths, columns the compared columns."""
    out: list[str] = []
    for reference in dict.fromkeys(test[2] for _, test in mine):
        columns = list(dict.fromkeys(test[1] for _, test in mine if test[2] == reference))
        lengths = sorted({test[3] for _, test in mine if test[2] == reference})
        what = "perplexity ratio to" if kind == "ppl" else "accuracy minus that of"
        named = [f"{column}{UNSETTLED if column in unsettled else ''}" for column in columns]
        out += ["", f"{title}: {what} {reference}", "", "| length | ×L | " + " | ".join(named) + " |"]
        out.append("|---:|---:|" + "---:|" * len(columns))
        for length in lengths:
            cells = []
            for column in columns:
                here = [(i, t) for i, t in mine if t[1] == column and t[2] == reference and t[3] == length]
                cells.append(_cell(here[0][1][4], *words[str(here[0][0])], kind) if here else "—")
            out.append(f"| {length} | {length / train_len:g} | " + " | ".join(cells) + " |")
    return out


def learned_seeds(by_label: Columns, train_len: int) -> tuple[Columns, list[str]]:
    """Each MQAR column with only its seeds that learned at ``train_len``, and a note for each seed or column left out.

    A column none of whose seeds learned "did not learn" and leaves the comparisons; one with fewer than
    ``MIN_LEARNED`` learned seeds is noted as too few, since ``recall_test`` compares no fewer (an interval over one
    seed could not carry the seeds' variance).
    """
    kept: Columns = {}
    notes = []
    for label, runs in by_label.items():
        mine = [run for run in runs if learned(run.get("mqar") or [], train_len) is not False]  # None: unknown
        if len(mine) < len(runs):
            verdict = "did not learn" if not mine else "learned"
            few = ", too few to compare" if 0 < len(mine) < MIN_LEARNED else ""
            notes.append(f"{label} {verdict} ({len(mine)} of {len(runs)} seeds{few})")
        if mine:
            kept[label] = mine  # a comparison still needs MIN_LEARNED of them (recall_test)
    return kept, notes


def _cell(estimate: Estimate, p: float, found: tuple[str, ...], kind: str) -> str:
    low, high = estimate.interval()
    detects = estimate.detectable()
    if kind == "ppl":
        shown = claims.shown(estimate, 3)
        detects_shown = f"±{math.expm1(detects):.1%}"
    else:
        shown = f"{estimate.estimate:+.3f} [{low:+.3f}, {high:+.3f}]"
        detects_shown = f"±{detects:.3f}"
    return f"{shown} p={p:.2g} {claims.mark(found)} (n={estimate.seeds}; detects {detects_shown})"


def _window_accuracy(run: dict[str, Any], length: int) -> list[float] | None:
    record = next((r for r in run.get("mqar_windows") or [] if r["length"] == length), None)
    if record is None:
        return None
    return [right / record["answers_per_window"] for right in record["right"]]
