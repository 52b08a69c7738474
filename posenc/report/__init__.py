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
``build.FIGURES``, and ``__main__`` is the command line.
"""

from posenc.report.build import FIGURES, SECTIONS, ReportOnSweepEnd, build_report
from posenc.report.collect import find_results, results_from_wandb
from posenc.report.perplexity import group_runs, perplexity_tables
from posenc.report.tasks import task_tables

__all__ = [
    "FIGURES",
    "SECTIONS",
    "ReportOnSweepEnd",
    "build_report",
    "find_results",
    "group_runs",
    "perplexity_tables",
    "results_from_wandb",
    "task_tables",
]
