"""The same tuning for every scheme: a grid, a selection rule fixed in advance, the chosen setting per scheme.

Why: a comparison where one scheme's learning rates were searched and another's were not measures the search, not
the schemes; a setting chosen on the figures a study then reports measures the choice. ``sweeps/tune.yaml`` trains
every scheme of a comparison over one grid (the learning rate; and the scheme parameters' multiplier of it wherever a
scheme has parameters), evaluated on the **validation** split at the training length only. This module selects one
setting per scheme by the rule below and writes it (``selection.json``); a study's runs then take their scheme's
setting from that file (``optim.tuned``, ``posenc.runs.apply_tuning``) and report on the **test** split.

The rule: the grid point with the lowest in-length validation loss (mean over its seeds); a point whose mean is within
the tie band of the lowest counts as tied, and a tie goes to the smaller scheme multiplier, then the smaller learning
rate (the cheaper, more conservative setting). Selecting on in-length loss keeps the question a study asks, how the
scheme extrapolates, out of the choice. The tie band is what the seeds cannot tell apart: t σ √(1/n_a + 1/n_b) for
two points of n_a and n_b seeds, σ the seed-to-seed standard deviation of in-length loss and t Student's 97.5%
quantile at σ's degrees of freedom (a fixed width measured nothing). σ is each scheme's own: its points that have
several seeds pooled with a reference study's seeds (``SEED_SPREAD``: the comparison's for text, the tuned recall
study's for a task). Why the reference: a grid's replicates are few, and a task's sit where its loss is at the floor
(a lookup learned, 1e-4 nats apart from seed to seed), so 1 df of the grid's alone would make a tie a choice between
0.0002-nat differences. Why each scheme's: on a task a scheme may learn at one seed and not at another (FoPE: 0.4
and 3.1 nats at one point), and that spread is its own; pooled across schemes it would widen every other scheme's
band about forty-fold (σ 0.40 nats against 0.0102). The table gives each scheme's σ and its df. A choice resolves
when every tied point has ``TIED_SEEDS`` seeds; until then the section lists the runs that would resolve it, and it
shows each tied point's longest-length ratio wherever its runs were evaluated there, so that a reader sees whether
the choice decides a verdict.

A text run's in-length validation loss is its evaluation at 1× on the validation split. A task run (recall, trained
on one generator) has no split of documents: its validation set is the held-out windows of the training format that
training scores (another seed stream than the evaluation windows a study reports), so its figure is the loss on those
windows at the end of training, read from its ``run.json``. Loss, not accuracy, for the same reason as for text: it
is continuous, so a rate that learned the task well is told from one that barely did, and one rule serves both.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scipy import stats

from posenc.jsonio import write_text
from posenc.layout import encoding_label
from posenc.report.retrieval import validation_curve
from posenc.schema.types import as_override

SELECTION_FILE = "selection.json"
TASK_NOTE = (
    " For a task the loss is its answers' on the held-out windows of the training format at the end of training "
    "(the validation set training scores, another seed stream than the evaluation windows): a perplexity near 1 is "
    "a lookup learned."
)
# (nats, df): the seed-to-seed standard deviation of the selection's loss in a reference study, pooled with a grid's
# replicates: for text, in-length loss over the comparison's eight schemes × 5 seeds (docs/results/comparison.md, test
# split at 1×; 8 × 4 df); for a task, the final validation loss over the tuned recall study's schemes that learned it,
# 5 seeds each (docs/results/recall-offset-tuned.md: ALiBi, FIRE, KERPLE-log, T5; 4 × 4 df).
SEED_SPREAD = {"text": (0.0049, 32), "task": (0.0102, 16)}
REFERENCE = {"text": "the comparison's five seeds", "task": "the tuned recall study's five seeds"}
TIED_SEEDS = 3  # seeds every tied point needs before a choice among them counts as resolved
TIES = "tune_ties"  # the sweep (-cn, and its overrides) that runs a tied point at more seeds; a study may name its own
RULE = (
    "lowest in-length (1×) validation loss, mean over the tuning seeds; points within the tie band of it are tied "
    "(t σ √(1/n_a + 1/n_b), σ the scheme's seed-to-seed spread of in-length loss, its replicated points pooled with "
    "a reference study's seeds, t Student's 97.5% quantile at its df), and a tie goes to the smaller scheme "
    "multiplier, then the smaller learning rate"
)


def _setting(run: dict[str, Any]) -> tuple[float, float]:
    optim = (run.get("config") or {}).get("optim") or {}
    return float(optim.get("lr", math.nan)), float(optim.get("scheme_lr_multiplier", 1.0))


def _final_validation_loss(run: dict[str, Any]) -> float | None:
    """A task run's loss on the held-out windows of its training format at its last validation (``run.json``)."""
    curve = [point for point in validation_curve(run) if point.get("loss") is not None]
    return float(curve[-1]["loss"]) if curve else None


def in_length_loss(run: dict[str, Any]) -> float | None:
    """The in-length validation loss a tuning selects on (the module's docstring); ``None`` for another split."""
    if run.get("trained_task"):
        return _final_validation_loss(run)
    if ((run.get("eval") or {}).get("split") or "validation") != "validation":
        return None
    row = next((r for r in run.get("perplexity") or [] if r.get("multiple") == 1 and not r.get("error")), None)
    return None if row is None else row.get("loss")


def _label(run: dict[str, Any]) -> str:
    """The scheme's label as a run that takes the selection names it (``apply_tuning``).

    Read from the encoding the run recorded, so that a form of a scheme (its options) is selected for under the name
    its runs carry.
    """
    encoding = run.get("encoding")
    return encoding_label(encoding) if encoding is not None else str(run["label"])


def grid(results: Sequence[dict[str, Any]]) -> dict[str, dict[tuple[float, float], list[float]]]:
    """{scheme label: {(lr, multiplier): in-length validation losses, one a seed}} of the runs that have one."""
    points: dict[str, dict[tuple[float, float], list[float]]] = defaultdict(lambda: defaultdict(list))
    for run in results:
        loss = in_length_loss(run)
        if loss is not None and math.isfinite(loss) and not run.get("failed"):
            points[_label(run)][_setting(run)].append(float(loss))
    return {label: dict(by_setting) for label, by_setting in points.items()}


def reference(results: Sequence[dict[str, Any]]) -> str:
    """Whose seeds a grid's σ is pooled with: the tuned recall study's for a task grid, else the comparison's."""
    return "task" if any(run.get("trained_task") for run in results) else "text"


def seed_spread(by_setting: dict[tuple[float, float], list[float]], kind: str) -> tuple[float, int]:
    """(σ, its degrees of freedom): one scheme's replicated points pooled with the reference study's seeds."""
    spread, free = SEED_SPREAD[kind]
    squares = spread**2 * free
    for losses in by_setting.values():
        if len(losses) > 1:
            squares += statistics.variance(losses) * (len(losses) - 1)
            free += len(losses) - 1
    return math.sqrt(squares / free), free


def band(spread: float, free: int, seeds_a: int, seeds_b: int) -> float:
    """The tie band of two points: what their seeds cannot tell apart at 95%, σ estimated on ``free`` df."""
    return float(stats.t.ppf(0.975, free)) * spread * math.sqrt(1 / seeds_a + 1 / seeds_b)


def select(results: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{scheme label: the chosen setting, its loss, the runner-up's margin, the tied points, the grid} by ``RULE``."""
    kind, chosen = reference(results), {}
    for label, by_setting in sorted(grid(results).items()):
        spread, free = seed_spread(by_setting, kind)
        means = {setting: statistics.fmean(losses) for setting, losses in by_setting.items()}
        lowest = min(means, key=means.__getitem__)
        tied = [
            setting for setting, loss in means.items()
            if loss <= means[lowest] + band(spread, free, len(by_setting[setting]), len(by_setting[lowest]))
        ]  # fmt: skip
        lr, multiplier = min(tied, key=lambda setting: (setting[1], setting[0]))
        others = sorted(loss for setting, loss in means.items() if setting != (lr, multiplier))
        chosen[label] = {
            "lr": lr,
            "scheme_lr_multiplier": multiplier,
            "loss": means[(lr, multiplier)],
            "margin_to_next": (others[0] - means[(lr, multiplier)]) if others else None,
            "seeds": len(by_setting[(lr, multiplier)]),
            "spread": spread,
            "df": free,
            "tied": [{"lr": t[0], "scheme_lr_multiplier": t[1], "seeds": len(by_setting[t])} for t in sorted(tied)],
            "resolved": all(len(by_setting[t]) >= TIED_SEEDS for t in tied) or len(tied) == 1,
            "grid": [
                {"lr": s[0], "scheme_lr_multiplier": s[1], "loss": means[s], "seeds": len(by_setting[s])}
                for s in sorted(means)
            ],
        }
    return chosen


def write_selection(path: Path, selection: dict[str, dict[str, Any]]) -> None:
    """``selection.json``: what a study's runs read through ``optim.tuned`` (written whole or not at all)."""
    import json

    write_text(path, json.dumps({"rule": RULE, "split": "validation", "schemes": selection}, indent=1) + "\n")


def tuning_section(results: Sequence[dict[str, Any]], ties: str = TIES) -> list[str]:
    """The grid per scheme as in-length validation perplexity, the chosen point marked, and the rule.

    ``ties``: the sweep a tied point short of seeds runs under (``-cn`` and its overrides), so that the lines that
    would resolve a choice train what the grid trained: a recall grid's ties are recall runs, not the text tuning's.
    """
    selection = select(results)
    if not selection:
        return ["", "## Tuning", "", "No run was evaluated at its training length on the validation split."]
    kind = reference(results)
    spread, free = SEED_SPREAD[kind]
    lines = [
        "",
        "## Tuning: one grid for every scheme, selected on validation",
        "",
        f"Selection rule: {RULE}. σ: the reference is {REFERENCE[kind]} (σ = {spread:.4f} nats, {free} df), "
        "pooled with each scheme's points of several seeds; the table gives each scheme's σ, its df and the width "
        "within which two of "
        f"its points of one seed each tie (of {TIED_SEEDS} seeds each: {math.sqrt(1 / TIED_SEEDS):.2f} of it). "
        f"A choice is resolved when every tied point has {TIED_SEEDS} seeds. Cells: in-length validation perplexity "
        "(mean over seeds, n beside a cell of more than one); ◆ the selected point. A scheme without parameters has "
        "one multiplier." + (TASK_NOTE if kind == "task" else ""),
        "",
        "| scheme | selected lr | selected multiplier | in-length val. ppl | margin to the next point (nats) "
        "| σ (df) | tie width, one seed each | tied points (seeds) | resolved |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for label, chosen in selection.items():
        margin = "—" if chosen["margin_to_next"] is None else f"{chosen['margin_to_next']:.4f}"
        tied = ", ".join(f"{t['lr']:g} ×{t['scheme_lr_multiplier']:g} ({t['seeds']})" for t in chosen["tied"])
        lines.append(
            f"| {label} | {chosen['lr']:g} | {chosen['scheme_lr_multiplier']:g} | {math.exp(chosen['loss']):.3f} "
            f"| {margin} | {chosen['spread']:.4f} ({chosen['df']}) | {band(chosen['spread'], chosen['df'], 1, 1):.4f} "
            f"| {tied} | {'yes' if chosen['resolved'] else 'no'} |"
        )
    lines += _tied_points(results, selection, ties)
    for label, chosen in selection.items():
        rates = sorted({point["lr"] for point in chosen["grid"]})
        multipliers = sorted({point["scheme_lr_multiplier"] for point in chosen["grid"]})
        cells = {(p["lr"], p["scheme_lr_multiplier"]): p for p in chosen["grid"]}
        lines += ["", f"**{label}**", "", "| lr | " + " | ".join(f"×{m:g}" for m in multipliers) + " |"]
        lines.append("|---:|" + "---:|" * len(multipliers))
        for lr in rates:
            row = []
            for multiplier in multipliers:
                point = cells.get((lr, multiplier))
                if point is None:
                    row.append("")
                    continue
                mark = " ◆" if (lr, multiplier) == (chosen["lr"], chosen["scheme_lr_multiplier"]) else ""
                n = f" (n={point['seeds']})" if point["seeds"] > 1 else ""
                row.append(f"{math.exp(point['loss']):.3f}{n}{mark}")
            lines.append(f"| {lr:g} | " + " | ".join(row) + " |")
    return lines


def _longest_ratios(results: Sequence[dict[str, Any]]) -> dict[tuple[str, float, float], tuple[int, list[float]]]:
    """{(scheme, lr, multiplier): (the longest multiple evaluated, each run's ratio there)}, where a run has one."""
    found: dict[tuple[str, float, float], tuple[int, list[float]]] = {}
    for run in results:
        rows = [r for r in run.get("perplexity") or [] if not r.get("error") and r.get("ratio") is not None]
        if len(rows) < 2 or run.get("failed") or in_length_loss(run) is None:  # the validation split's runs only
            continue
        longest = max(rows, key=lambda r: r["multiple"])
        key = (_label(run), *_setting(run))
        multiple, ratios = found.get(key, (longest["multiple"], []))
        if longest["multiple"] == multiple:
            found[key] = (multiple, [*ratios, float(longest["ratio"])])
    return found


def _model_overrides(results: Sequence[dict[str, Any]], label: str, setting: tuple[float, float]) -> str:
    """`` model.<key>=<value>`` for each model setting the grid's runs do not share, as this point's runs had it.

    Why: a grid may train an entry at another depth (a layout that cycles six layer kinds at depth 6); its tie line
    must say so, or the runs that resolve it would train another model under the same name.
    """
    models = [run.get("model") or {} for run in results]
    # A key some records lack (one added to the model since) is no difference of setting: only recorded values count.
    varying = sorted({key for model in models for key in model if len({repr(m[key]) for m in models if key in m}) > 1})
    point = (label, *setting)
    mine = next((m for run, m in zip(results, models, strict=True) if (_label(run), *_setting(run)) == point), {})
    return "".join(f" model.{key}={as_override(mine[key])}" for key in varying if key in mine)


def _tied_points(results: Sequence[dict[str, Any]], selection: dict[str, dict[str, Any]], ties: str) -> list[str]:
    """Each point's longest-length ratio where it was evaluated there, tied or not, and the runs a choice still needs.

    Every point evaluated past the training length is shown, not only those tied now: a tie resolved by more seeds (or
    by a longer budget) still says whether the point it lost to would have extrapolated otherwise.
    """
    ratios = _longest_ratios(results)
    lines, missing = [], []
    for label, chosen in selection.items():
        tied = {(t["lr"], t["scheme_lr_multiplier"]): t["seeds"] for t in chosen["tied"]}
        for setting, seeds in tied.items():
            if len(tied) > 1 and seeds < TIED_SEEDS:
                missing.append(
                    f"+encoding={label} optim.lr={setting[0]:g} optim.scheme_lr_multiplier={setting[1]:g}"
                    f"{_model_overrides(results, label, setting)}  # {seeds} seed(s)"
                )
        for (scheme, *setting), (multiple, found) in sorted(ratios.items()):
            if scheme != label:
                continue
            mark = " ◆" if tuple(setting) == (chosen["lr"], chosen["scheme_lr_multiplier"]) else ""
            word = "tied" if len(tied) > 1 and tuple(setting) in tied else "—"
            lines.append(f"| {label} | {setting[0]:g} ×{setting[1]:g}{mark} | {word} | {multiple:g}× "
                         f"| {statistics.fmean(found):.3f} | {len(found)} |")  # fmt: skip
    out = []
    if lines:
        out += [
            "",
            "Each point's longest-length ratio on the validation split, wherever its runs were evaluated past the "
            "training length (nonoverlapping; mean over those seeds), tied or not: whether the choice decides how the "
            "scheme extrapolates.",
            "",
            "| scheme | point | tied now | at | ratio to 1× | seeds |",
            "|---|---|---|---:|---:|---:|",
            *lines,
        ]
    if missing:
        out += [
            "",
            f"Unresolved: tied points with fewer than {TIED_SEEDS} seeds. To resolve them, each with "
            f"`python -m posenc.train -m -cd sweeps -cn {ties}` and:",
            "",
            "```bash",
            *missing,
            "```",
        ]
    return out
