"""``python -m posenc.report <sweep or run dirs…>``: every scheme side by side, as the ALiBi paper's Table 2.

Reads every ``results.json`` under the given directories (written by training's end-of-run evaluation or by
``posenc.evaluate``), groups runs by training length and evaluation mode, and writes ``report.md`` plus
combined plots (one line per scheme): rows are evaluation lengths, columns are schemes, perplexity cells are the
mean and 95% Student-t interval over seeds with the cells the seeds cannot separate from the best marked, followed
by the ratio to in-length perplexity, task accuracies, effective lengths and the cost-vs-extrapolation figure;
``--paired A B`` adds a seed-matched comparison of two columns. ``--wandb entity/project``
builds the same tables from W&B run summaries instead (needs network).

One module per section: ``perplexity``, ``tasks``, ``retrieval``, ``attention``, ``effective``, ``drift`` (how far
learnable positional parameters moved, and each scheme's bias by distance), ``preset`` (every column against fixed
references, Holm over the section), ``finetuned`` (a run fine-tuned from another beside its parent), ``paired``
(tables), ``plots`` and ``cost`` (figures); ``collect``
finds results, ``build`` assembles ``report.md`` from the sections listed in ``build.SECTIONS`` and
``build.FIGURES``, ``on_sweep_end`` the Hydra callback that writes a sweep's report when it ends, and ``__main__`` is
the command line.
"""

from __future__ import annotations

import importlib
from typing import Any

from posenc.report.on_sweep_end import ReportOnSweepEnd

# Everything else is imported when first asked for: Hydra imports this package to build ``ReportOnSweepEnd`` at the
# start of every run, and the report's modules would cost each one seconds of imports it does not use.
_LAZY = {
    "FIGURES": "posenc.report.build",
    "SECTIONS": "posenc.report.build",
    "build_report": "posenc.report.build",
    "find_results": "posenc.report.collect",
    "results_from_wandb": "posenc.report.collect",
    "group_runs": "posenc.report.perplexity",
    "perplexity_tables": "posenc.report.perplexity",
    "task_tables": "posenc.report.tasks",
}

__all__ = ["ReportOnSweepEnd", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'posenc.report' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
