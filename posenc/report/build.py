"""Assemble ``report.md``: failed and unfinished runs apart, every section in ``SECTIONS``, every figure in ``FIGURES``.

A new section is a function ``(results, appendix) -> list[str]`` of markdown lines (empty when it has nothing to
say), appended to ``SECTIONS``; its tables take their header from ``common.table_head`` with the ``appendix``, so
each column shows its runs, steps and tokens and the appendix names its run directories. A new figure is
``(results, out_dir) -> list[Path]``, appended to ``FIGURES``. Both receive only the runs that count: failed runs
are removed first, and unfinished ones unless the report was asked to include them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from posenc.data.retrieval import RETRIEVAL_TASKS
from posenc.jsonio import write_text
from posenc.report.attention import attention_tables
from posenc.report.budgets import budget_tables
from posenc.report.collect import distinct_seeds, finished
from posenc.report.common import Appendix, run_dir
from posenc.report.cost import cost_plots_of, cost_section
from posenc.report.drift import drift_curve_plots, drift_tables, learned_bias_plots
from posenc.report.effective import effective_tables
from posenc.report.finetuned import finetuned_tables
from posenc.report.paired import paired_section
from posenc.report.perplexity import group_order, group_runs, perplexity_tables
from posenc.report.plots import attention_plots, curve_plots, perplexity_plots, task_plots
from posenc.report.preset import DEFAULT_REFERENCES, preset_section
from posenc.report.protocols import protocol_tables
from posenc.report.retrieval import retrieval_tables
from posenc.report.sensitivity import sensitivity_tables
from posenc.report.stability import stability_plots, stability_section
from posenc.report.tasks import task_tables
from posenc.report.tuning import TIES, tuning_section

Results = list[dict[str, Any]]


def perplexity_section(results: Results, appendix: Appendix) -> list[str]:
    sections = []
    for key, by_label in sorted(group_runs(results).items(), key=lambda item: group_order(item[0])):
        sections += ["", perplexity_tables(key, by_label, appendix)]
    return sections


def _text(make: Callable[[Results, Appendix], str]) -> Callable[[Results, Appendix], list[str]]:
    def section(results: Results, appendix: Appendix) -> list[str]:
        text = make(results, appendix)
        return ["", text] if text else []

    return section


SECTIONS: list[Callable[[Results, Appendix], list[str]]] = [
    perplexity_section,
    _text(protocol_tables),
    _text(sensitivity_tables),
    _text(lambda results, appendix: task_tables(results, appendix=appendix)),
    _text(retrieval_tables),
    _text(attention_tables),
    _text(finetuned_tables),
    _text(drift_tables),
]
FIGURES: list[Callable[[Results, Path], list[Path]]] = [
    lambda results, out_dir: perplexity_plots(group_runs(results), out_dir),
    task_plots,
    lambda results, out_dir: task_plots(results, out_dir, tuple(RETRIEVAL_TASKS)),
    curve_plots,
    attention_plots,
    cost_plots_of,
    learned_bias_plots,
    drift_curve_plots,
]


def build_report(
    results: Results,
    out_dir: Path,
    make_plots: bool = True,
    include_unfinished: bool = False,
    paired: tuple[str, str] | None = None,
    thresholds: dict[str, float | None] | None = None,
    write: bool = True,
    left_out: list[str] | None = None,
    references: Sequence[str] = DEFAULT_REFERENCES,
    bench: list[dict[str, Any]] | None = None,
    cost_only: bool = False,
    tuning_only: bool = False,
    ties: str = TIES,
    budgets_only: bool = False,
    stability_only: bool = False,
) -> str:
    """Write report.md (and plots) to ``out_dir``; return the markdown (``write=False``: the plots only).

    ``left_out`` names the records that could not be read (``find_results``' ``unreadable``: ``file: why``); the
    report lists them first, so that a column with fewer runs than launched says why on the page itself.

    Failed runs are listed apart and never counted. Unfinished runs (their weights stopped before
    ``trainer.max_steps``) are listed apart too, unless ``include_unfinished``: then they are columns of their
    own, since their steps trained are part of their identity. ``paired`` (two column labels) adds their paired
    comparison, and refuses with one line when their seeds do not match. ``thresholds`` (``ppl_threshold``,
    ``acc_threshold``, ``ppl_ratio``, ``acc_fraction``) override the runs' settings of the effective-length rules.
    ``references`` are the schemes every column is compared with in the section of comparisons fixed in advance.
    ``bench`` (``benchcost.find_bench``) adds the training cost measured side by side and gives the cost chart its
    x; ``cost_only`` keeps only what prices the columns: that table, the protocols side by side and the chart.
    ``tuning_only``: the tuning grid and the setting selected for each scheme (``posenc/report/tuning.py``), alone,
    its unresolved ties as runs of the sweep ``ties``;
    ``budgets_only``: each scheme's rank at every training budget and whether the ranking holds (``budgets.py``);
    ``stability_only``: each scheme's learning-rate sensitivity, highest stable rate and spikes over a grid of rates,
    its diverged runs counted as diverged (``stability.py``), and the figure of loss against rate.
    """
    if not results:
        raise SystemExit("no results.json found: train with eval.at_end=true or run `python -m posenc.evaluate <run>`")
    results, failed, unfinished, repeated = _screened(results, include_unfinished)
    out_dir.mkdir(parents=True, exist_ok=True)
    counted = f"{len(results)} evaluated run(s)" + (" (unfinished ones included)" if include_unfinished else "")
    sections = ["# posenc extrapolation report", "", counted + "."]
    sections += _set_apart(left_out or [], failed, repeated, unfinished, include_unfinished, stability_only)
    appendix = Appendix()
    sections += cost_section(results, bench) if bench else []
    if tuning_only:
        sections += tuning_section(results, ties)
    elif stability_only:
        sections += stability_section([*results, *failed])
    elif budgets_only:
        sections += budget_tables(results)
    elif cost_only:
        sections += _text(protocol_tables)(results, appendix)
    else:
        for section in SECTIONS:
            sections += section(results, appendix)
        effective = effective_tables(results, appendix, thresholds)
        sections += ["", effective] if effective else []
        sections += preset_section(results, references)
        if paired is not None:
            sections += paired_section(results, *paired)
    # The cost chart takes the benchmark's side-by-side throughput when there is one.
    cost_chart = functools.partial(cost_plots_of, bench=bench)
    figures = [cost_chart] if cost_only else [cost_chart if f is cost_plots_of else f for f in FIGURES]
    figures = [] if tuning_only or budgets_only else figures
    if stability_only:
        figures = [lambda counted, folder: stability_plots([*counted, *failed], folder)]
    images = [image for figure in figures for image in figure(results, out_dir)] if make_plots else []
    if images:
        sections += ["", "## Plots", ""] + [f"![{image.stem}]({image.name})" for image in images]
    sections += appendix.lines()
    markdown = "\n".join(sections).rstrip() + "\n"
    if write:
        write_text(out_dir / "report.md", markdown)
    return markdown


def _screened(results: Results, include_unfinished: bool) -> tuple[Results, Results, Results, list[str]]:
    """(the runs counted, the failed, the unfinished, a note per seed run more than once): what is set apart, and why.

    An older run that diverged without stopping (no finite perplexity at any length) counts as failed.
    """
    for run in results:
        rows = run.get("perplexity") or []
        if rows and not run.get("failed") and all(r["ppl"] is None and r["error"] is None for r in rows):
            run["failed"] = "no finite perplexity at any length (the run diverged)"
            run.setdefault("run_name", run["label"])
    failed = [r for r in results if r.get("failed")]
    results = [r for r in results if not r.get("failed")]
    unfinished = [r for r in results if not finished(r)]
    if not include_unfinished:
        results = [r for r in results if finished(r)]
    results, repeated = distinct_seeds(results)
    return results, failed, unfinished, repeated


def _set_apart(
    left_out: list[str],
    failed: Results,
    repeated: list[str],
    unfinished: Results,
    include_unfinished: bool,
    stability_only: bool,
) -> list[str]:
    """The report's first sections: what it could not read and what it did not count, before any table."""
    failed_lines = [f"{run['run_name']}: {run['failed']} ({Path(run.get('_source', 'W&B')).parent})" for run in failed]
    unfinished_lines = []
    for run in unfinished:
        training = run.get("training") or {}
        steps = f"step {training.get('steps', '?')} of {training.get('max_steps', '?')}"
        unfinished_lines.append(f"{run.get('run_name') or run['label']}: trained to {steps} ({run_dir(run)})")
    counts = "counted as diverged in the stability tables" if stability_only else "not counted in any column"
    where = "in columns of their own" if include_unfinished else "not counted; --include-unfinished counts them"
    return [
        *_listed(f"Left out: {len(left_out)} record(s) that could not be read", left_out),
        *_listed(f"Failed runs ({len(failed)}, {counts})", failed_lines),
        *_listed(f"Seeds counted once ({len(repeated)} seed(s) run more than once)", repeated),
        *_listed(f"Unfinished runs ({len(unfinished)}, {where})", unfinished_lines),
    ]


def _listed(title: str, items: list[str]) -> list[str]:
    """A section of the report's opening: its heading and one bullet an item, nothing when there are none."""
    return ["", f"## {title}", "", *(f"- {item}" for item in items)] if items else []
