"""Comparisons fixed in advance: every column against each reference scheme, corrected as one family.

The perplexity tables mark each column against the best one of its row, a reference picked after the fact. Here
the comparisons are named before any result is read: every column against each reference (``--references``, by
default ALiBi and NoPE: the best-known fixed prior and no prior at all), at every evaluated length, for perplexity
under each protocol and for MQAR recall. Every test of the report goes into one family, whose p-values are
adjusted together by Holm's method, so the chance of any false "separated" claim in the whole section stays at 5%.

- Perplexity: the log ratio log(ppl_column / ppl_reference), paired by seed, with the crossed bootstrap (seeds and
  the scored documents, one draw of documents shared by every seed: ``posenc/evaluate/bootstrap.py``) where every run
  recorded its loss per document over the same documents; otherwise the paired t-test over the seeds alone, marked ᵗ.
- Recall (MQAR, the rate-selected columns of the retrieval section): the difference of exact-match accuracy, paired
  by seed, with the crossed bootstrap over seeds and evaluation windows (a window's answers share their context).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from posenc.evaluate.bootstrap import BootstrapResult, crossed_difference, crossed_log_ratio
from posenc.evaluate.effective import learned
from posenc.evaluate.stats import ALPHA, holm, paired_comparison
from posenc.report.common import UNSETTLED, Columns, order, unsettled_line, unsettled_seeds
from posenc.report.perplexity import group_runs, protocol, value
from posenc.report.retrieval import selected
from posenc.report.tasks import task_columns

DEFAULT_REFERENCES = ("alibi", "nope")
SEPARATED, NOT_SEPARATED = "✓", "≈"


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


def pairs(by_label: Columns, references: Sequence[str]) -> list[tuple[str, str]]:
    """(column, reference) for every column against every reference, each unordered pair once."""
    refs = reference_columns(by_label, references)
    out = []
    for index, reference in enumerate(refs):
        for label in order(by_label):
            if label != reference and label not in refs[:index]:
                out.append((label, reference))
    return out


MIN_LEARNED = 2  # seeds a recall comparison needs: one seed has no seed-to-seed variance to report


def _shared(by_label: Columns, a: str, b: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    seeds_a = {run.get("seed"): run for run in by_label[a]}
    seeds_b = {run.get("seed"): run for run in by_label[b]}
    return [(seeds_a[s], seeds_b[s]) for s in sorted(set(seeds_a) & set(seeds_b), key=str)]


def perplexity_test(pairs_: list[tuple[dict[str, Any], dict[str, Any]]], length: int) -> dict[str, Any] | None:
    """The log ratio's estimate, interval and p-value at one length over the shared seeds (module docstring)."""
    kept = [(x, y) for x, y in pairs_ if _finite(value(x, length, "ppl")) and _finite(value(y, length, "ppl"))]
    if len(kept) < 2:
        return None
    losses = [(_document_loss(x, length), _document_loss(y, length)) for x, y in kept]
    records = [run.get("documents") or {} for pair in kept for run in pair]
    scored = {repr(_document_tokens(run, length)) for pair in kept for run in pair}
    same_documents = len({repr(r.get("documents")) for r in records}) == 1 and len(scored) == 1
    tokens = _document_tokens(kept[0][0], length)
    if same_documents and tokens and all(a is not None and b is not None for a, b in losses):
        result = crossed_log_ratio([a for a, _ in losses], [b for _, b in losses], np.asarray(tokens), seed=length)
        return _record(result)
    logs = [(math.log(value(x, length, "ppl")), math.log(value(y, length, "ppl"))) for x, y in kept]
    c = paired_comparison([x for x, _ in logs], [y for _, y in logs])
    low, high = c.mean_difference - c.half_width, c.mean_difference + c.half_width
    return {"estimate": c.mean_difference, "low": low, "high": high, "p": c.p_value, "n": len(kept), "t": True}


def recall_test(pairs_: list[tuple[dict[str, Any], dict[str, Any]]], length: int) -> dict[str, Any] | None:
    """The accuracy difference's estimate, interval and p-value at one length (crossed bootstrap)."""
    grids = [(_window_accuracy(x, length), _window_accuracy(y, length)) for x, y in pairs_]
    grids = [(a, b) for a, b in grids if a is not None and b is not None and len(a) == len(b)]
    if len(grids) < MIN_LEARNED or len({len(a) for a, _ in grids}) != 1:  # one seed: no seed variance to give
        return None
    return _record(crossed_difference([a for a, _ in grids], [b for _, b in grids], seed=length))


def preset_section(results: list[dict[str, Any]], references: Sequence[str] = DEFAULT_REFERENCES) -> list[str]:
    """Markdown lines of the section; empty when no table holds a reference and another column."""
    tests: list[tuple[str, str, str, int, dict[str, Any]]] = []  # (table, column, reference, length, result)
    tables: dict[str, tuple[int, str]] = {}  # table title -> (train_len, what the cells are)
    unsettled: dict[str, str] = {}  # column -> its seeds whose positional parameters had not settled

    def compare(title: str, train_len: int, by_label: Columns, rows: str, test: Callable, kind: str) -> None:
        """Every column against each reference at every length of ``rows`` (``perplexity`` or ``mqar``)."""
        unsettled.update({label: note for label, runs in by_label.items() if (note := unsettled_seeds(runs))})
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
    adjusted = holm({str(index): test[4]["p"] for index, test in enumerate(tests)})
    out = [
        "",
        "## Comparisons fixed in advance",
        "",
        f"Every column against {', '.join(references)} at every length, named before the results were read; the "
        f"{len(tests)} tests of this section are one family, their p-values adjusted together by Holm's method. "
        "Perplexity: the ratio to the reference, paired by seed, with its 95% interval from the crossed "
        "bootstrap (seeds and documents, one draw of documents shared by every seed and column; ᵗ: the paired t "
        "interval over seeds, where per-document losses were not recorded); recall: the difference of exact-match "
        "accuracy with its 95% interval from the bootstrap over seeds × evaluation windows. Intervals: bootstrap "
        "standard error with Student's t at seeds − 1 "
        f"degrees of freedom. p: Holm-adjusted; {SEPARATED}: p < {ALPHA:g}, {NOT_SEPARATED}: not separated.",
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
                    found = [(i, t) for i, t in mine if t[1] == column and t[2] == reference and t[3] == length]
                    cells.append(_cell(found[0][1][4], adjusted[str(found[0][0])], kind) if found else "—")
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


def _cell(result: dict[str, Any], p: float, kind: str) -> str:
    mark = SEPARATED if p < ALPHA else NOT_SEPARATED
    if kind == "ppl":
        shown = f"{math.exp(result['estimate']):.3f} [{math.exp(result['low']):.3f}, {math.exp(result['high']):.3f}]"
        shown += "ᵗ" if result.get("t") else ""
    else:
        shown = f"{result['estimate']:+.3f} [{result['low']:+.3f}, {result['high']:+.3f}]"
    return f"{shown} p={p:.2g} {mark} (n={result['n']})"


def _record(result: BootstrapResult) -> dict[str, Any]:
    return {"estimate": result.estimate, "low": result.low, "high": result.high, "p": result.p_value, "n": result.seeds}


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x > 0


def _document_loss(run: dict[str, Any], length: int) -> list[float] | None:
    row = next((r for r in run.get("perplexity") or [] if r["length"] == length and r["error"] is None), None)
    return None if row is None else row.get("document_loss")


def _document_tokens(run: dict[str, Any], length: int) -> list[float] | None:
    """The targets scored in each document at ``length``.

    The row's own count (a sliding protocol keeps a stream's first targets as context), else the documents record's
    (every target scored).
    """
    row = next((r for r in run.get("perplexity") or [] if r["length"] == length and r["error"] is None), None)
    if row is not None and row.get("document_tokens") is not None:
        return [float(n) for n in row["document_tokens"]]
    tokens = (run.get("documents") or {}).get("tokens")
    return [float(n) for n in tokens] if tokens else None


def _window_accuracy(run: dict[str, Any], length: int) -> list[float] | None:
    record = next((r for r in run.get("mqar_windows") or [] if r["length"] == length), None)
    if record is None:
        return None
    return [right / record["answers_per_window"] for right in record["right"]]
