"""Stability per scheme over a grid of learning rates: sensitivity, the highest stable rate, spikes, a figure.

The measure is Wortsman et al. (2023, "Small-scale proxies for large-scale Transformer training instabilities",
§2.2): a scheme's **learning-rate sensitivity** is the expected excess final loss over a log-spaced range of rates,

    sensitivity = mean over rates η of ( min(ℓ(η), ℓ₀) − min over η' of ℓ(η') ),

each point capped at the loss at initialisation ℓ₀ (a run that learned nothing, or diverged, costs at most that).
ℓ(η) is the in-length validation loss the tuning selects on (``posenc/report/tuning.py``), the mean over the seeds run
at η; a run that diverged (``failed.json``) counts as ℓ₀, never dropped. ℓ₀ is the loss of the first training step,
before any update, as each run records it (``run.json``'s ``stability``), the mean over the scheme's runs.

A rate is **stable** for a scheme when every run at it finished, with a finite loss, below ℓ₀; the **highest stable
rate** is the largest such rate of the grid. A scheme whose every rate of the grid is stable has not been taken to
the edge: the section says so, and that its highest stable rate is only a lower bound. **Spike rates** are the spikes
per thousand steps of the loss and of the gradient norm (``posenc/training/stability.py``: more than 6 standard
deviations above the mean of the 128 steps before), pooled over the scheme's runs at its stable rates.

Sensitivities are compared over one range: the rates every scheme of the report ran (``shared_rates``); a rate
only some ran (a step past the grid for the schemes stable throughout it) counts towards their highest stable rate
and shows in their table, not in their sensitivity.

**Which scheme is more stable** is a test on the difference of two sensitivities, in the report's three words:
separated (Holm-adjusted two-sided t), equivalent (two one-sided tests against ``MARGIN``, Holm-adjusted), or
inconclusive. A sensitivity's only noise is each point's seed noise, and that noise grows along the grid (runs near
collapse differ by seed far more than runs at a good rate), so one σ for every point would let the loud edges set
the error of the quiet best point, which dominates it. It is therefore estimated per rate (``SeedNoise``): pooled
over the schemes that ran more than one seed at that rate, and at a rate where none did, the larger of the σs
measured on either side of it. The standard error is the sum over rates of each point's weight in the sensitivity
(1/k, and 1/k − 1 at the best rate) squared, times its variance over its runs; its degrees of freedom are
Satterthwaite's over the estimates it uses. Pooling over schemes at a rate assumes one scheme's seed noise there is
another's: near one scheme's edge and far from another's it is not, and the pooled σ is then too large for the
scheme far from its edge (the test errs towards inconclusive) and too small for the other. A grid without a point of
more than one seed earns no word. The best point is taken as fixed, so the minimum's downward bias is not corrected.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib.ticker

from posenc.evaluate.crossed import SEEDS_ONLY, Estimate
from posenc.evaluate.plots import line_figure, save_figure
from posenc.layout import encoding_label
from posenc.report.claims import words
from posenc.report.tuning import in_length_loss

MEASURE = (
    "learning-rate sensitivity (Wortsman et al., 2023): the mean over the grid's rates of the final in-length "
    "validation loss, capped at the loss at initialisation, minus the best of them; a diverged run counts as the loss "
    "at initialisation"
)


# Two sensitivities within this many nats are equivalent: a fiftieth of a nat of excess loss averaged over the grid,
# 2% in perplexity. Fixed with the test, before any of the study's results was read.
MARGIN = 0.02


@dataclass
class RatePoint:
    """The runs of one scheme at one learning rate."""

    losses: list[float | None] = field(default_factory=list)  # final in-length loss per run; None: diverged
    records: list[dict[str, Any]] = field(default_factory=list)  # each run's stability record


def _config(run: dict[str, Any]) -> dict[str, Any]:
    return run.get("config") or {}


def _label(run: dict[str, Any]) -> str:
    encoding = run.get("encoding") or _config(run).get("encoding")
    return encoding_label(encoding) if encoding is not None else str(run["label"])


def _rate(run: dict[str, Any]) -> float | None:
    lr = (_config(run).get("optim") or {}).get("lr")
    return None if lr is None else float(lr)


def grid(results: Sequence[dict[str, Any]]) -> dict[str, dict[float, RatePoint]]:
    """{scheme label: {learning rate: its runs}}, diverged runs (``failed``) included as losses of ``None``."""
    points: dict[str, dict[float, RatePoint]] = defaultdict(lambda: defaultdict(RatePoint))
    for run in results:
        rate = _rate(run)
        if rate is None:
            continue
        loss = None if run.get("failed") else in_length_loss(run)
        if not run.get("failed") and loss is None:
            continue  # evaluated on another split or length: not a point of this grid
        point = points[_label(run)][rate]
        point.losses.append(loss if loss is None or math.isfinite(loss) else None)
        point.records.append(run.get("stability") or {})
    return {label: dict(by_rate) for label, by_rate in points.items()}


def initial_loss(by_rate: dict[float, RatePoint]) -> float | None:
    """ℓ₀: the mean over the scheme's runs of their first step's loss."""
    losses = [r["initial_loss"] for p in by_rate.values() for r in p.records if r.get("initial_loss") is not None]
    return statistics.fmean(losses) if losses else None


def capped_losses(point: RatePoint, start: float) -> list[float]:
    """Each run's min(ℓ, ℓ₀), a diverged run counting ℓ₀."""
    return [start if loss is None else min(loss, start) for loss in point.losses]


def capped(point: RatePoint, start: float) -> float:
    """The mean over a rate's runs of their capped losses."""
    return statistics.fmean(capped_losses(point, start))


def stable(point: RatePoint, start: float) -> bool:
    return all(loss is not None and loss < start for loss in point.losses)


def summary(by_rate: dict[float, RatePoint], shared: set[float] | None = None) -> dict[str, Any] | None:
    """A scheme's sensitivity, highest stable rate, whether the grid reached an unstable rate, and spike rates.

    ``shared``: the rates the sensitivity and the best rate are taken over (those every compared scheme ran, so that
    two sensitivities average over one range); the highest stable rate and the spikes read every rate the scheme ran.
    """
    start = initial_loss(by_rate)
    if start is None or not by_rate:
        return None
    rates = sorted(rate for rate in by_rate if shared is None or rate in shared)
    if not rates:
        return None
    points = [capped(by_rate[rate], start) for rate in rates]
    best = min(points)
    steady = [rate for rate in sorted(by_rate) if stable(by_rate[rate], start)]
    records = [r for rate in steady for r in by_rate[rate].records if r.get("steps")]
    steps = sum(r["steps"] for r in records)
    per_thousand = {
        kind: 1000 * sum(r.get(f"{kind}_spikes", 0) for r in records) / steps if steps else None
        for kind in ("loss", "grad_norm")
    }
    return {
        "initial_loss": start,
        "sensitivity": statistics.fmean(point - best for point in points) if len(rates) > 1 else None,
        "best_rate": rates[points.index(best)],
        "highest_stable": max(steady) if steady else None,
        "reached_unstable": len(steady) < len(by_rate),
        "top_rate": max(by_rate),
        "rates": len(rates),
        **{f"{kind}_spikes_per_1k": value for kind, value in per_thousand.items()},
    }


@dataclass
class SeedNoise:
    """The seed spread of a capped final loss: squares and degrees of freedom per rate where seeds were replicated.

    Each point's runs differ only in their seed, so the spread within a point is seed noise; the points of every scheme
    at one rate are pooled (one σ a rate for all schemes, the assumption the tuning's tie width makes for one σ).
    """

    by_rate: dict[float, tuple[float, int]]  # rate: (sum of squared deviations from each point's mean, df)

    def variance(self, rate: float) -> tuple[float, int, float]:
        """σ² at ``rate``, its degrees of freedom, and the rate it was measured at.

        A rate without replicates borrows the larger σ of the measured rates on either side of it (the nearest one
        past the ends): noise grows towards an edge, so the neighbour nearer the edge bounds it from above.
        """
        if rate not in self.by_rate:
            below = [r for r in self.by_rate if r < rate]
            above = [r for r in self.by_rate if r > rate]
            sides = ([max(below)] if below else []) + ([min(above)] if above else [])
            rate = max(sides, key=lambda r: self.by_rate[r][0] / self.by_rate[r][1])
        squares, df = self.by_rate[rate]
        return squares / df, df, rate


def seed_noise(by_scheme: dict[str, dict[float, RatePoint]]) -> SeedNoise | None:
    """The seed noise of every rate where some scheme ran more than one seed; None where no point did."""
    by_rate: dict[float, tuple[float, int]] = {}
    for by_rate_runs in by_scheme.values():
        start = initial_loss(by_rate_runs)
        for rate, point in by_rate_runs.items():
            if start is None or len(point.losses) < 2:
                continue
            values = capped_losses(point, start)
            mean = statistics.fmean(values)
            squares, df = by_rate.get(rate, (0.0, 0))
            by_rate[rate] = (squares + sum((value - mean) ** 2 for value in values), df + len(values) - 1)
    return SeedNoise(by_rate) if by_rate else None


def shared_rates(by_scheme: dict[str, dict[float, RatePoint]]) -> set[float]:
    """The rates every scheme ran: the one range their sensitivities average over."""
    return set.intersection(*(set(by_rate) for by_rate in by_scheme.values())) if by_scheme else set()


def _weights(by_rate: dict[float, RatePoint], best: float) -> dict[float, float]:
    """Var(sensitivity) = Σ weight_η · σ²_η: each point's coefficient (1/k, or 1/k − 1 at the best) squared over n_η.

    With one σ for all, Σ weight_η = (1/k²) Σ 1/n_η + 1/n_best − 2/(k · n_best): the best point is one of the k.
    """
    k = len(by_rate)
    return {rate: (1 / k - (rate == best)) ** 2 / len(point.losses) for rate, point in by_rate.items()}


def difference_error(weights: Sequence[dict[float, float]], noise: SeedNoise) -> tuple[float, float]:
    """The standard error of a difference of sensitivities and its Satterthwaite degrees of freedom.

    Its variance is Σ over both schemes' points of weight × σ² at the point's rate; the terms that share an estimate
    (one measured rate's, whether the points' own or borrowed) are one component, with that estimate's degrees of
    freedom.
    """
    components: dict[float, list[float]] = {}
    for scheme in weights:
        for rate, weight in scheme.items():
            variance, df, source = noise.variance(rate)
            component = components.setdefault(source, [0.0, variance, df])
            component[0] += weight
    total = sum(weight * variance for weight, variance, _ in components.values())
    if not total > 0:
        return 0.0, 1.0
    spread = sum((weight * variance) ** 2 / df for weight, variance, df in components.values() if variance > 0)
    return math.sqrt(total), total**2 / spread


def comparisons(
    by_scheme: dict[str, dict[float, RatePoint]], summaries: dict[str, dict[str, Any] | None] | None = None
) -> tuple[list[dict[str, Any]], SeedNoise | None]:
    """Every pair of schemes: the difference of their sensitivities, its 95% interval and the words it earns.

    One Holm family for "no difference" and one for the equivalence tests, over all pairs, as the comparison does.
    """
    noise, shared = seed_noise(by_scheme), shared_rates(by_scheme)
    if summaries is None:
        summaries = {label: summary(by_rate, shared) for label, by_rate in by_scheme.items()}
    usable = sorted(label for label, s in summaries.items() if s is not None and s["sensitivity"] is not None)
    if noise is None or len(usable) < 2:
        return [], noise
    rows: list[dict[str, Any]] = []
    estimates: dict[str, Estimate] = {}
    for index, a in enumerate(usable):
        for b in usable[index + 1 :]:
            diff = summaries[a]["sensitivity"] - summaries[b]["sensitivity"]
            weights = [
                _weights({r: p for r, p in by_scheme[x].items() if r in shared}, summaries[x]["best_rate"])
                for x in (a, b)
            ]
            se, df = difference_error(weights, noise)
            if not se > 0:
                continue
            seeds = max(len(point.losses) for x in (a, b) for point in by_scheme[x].values())
            estimates[f"{a} vs {b}"] = Estimate(diff, se, df, seeds, 1, SEEDS_ONLY)
            rows.append({"name": f"{a} vs {b}", "a": a, "b": b, "difference": diff})
    found = words(estimates, MARGIN)
    for row in rows:
        row["interval"], row["words"] = estimates[row["name"]].interval(), found[row["name"]]
    return rows, noise


def _comparison_lines(rows: list[dict[str, Any]], noise: SeedNoise | None) -> list[str]:
    if noise is None:
        return ["", "No point ran more than one seed, so the seed noise is unmeasured and no pair earns a word."]
    measured = ", ".join(
        f"{math.sqrt(variance):.4f} at {rate:g} ({df} df)"
        for rate in sorted(noise.by_rate)
        for variance, df, _ in [noise.variance(rate)]
    )
    lines = [
        "",
        f"Pairs (first minus second; negative: the first is less sensitive). Seed noise σ, per rate over the schemes "
        f"with more than one seed there: {measured}; a rate without replicates takes the larger σ of the measured "
        f"rates on either side. Degrees of freedom per pair by Satterthwaite; equivalence margin ±{MARGIN} nats; Holm "
        f"over the {len(rows)} pairs for the words; the intervals are each pair's own, unadjusted, so one can miss 0 "
        "where the Holm-adjusted test does not separate.",
        "",
        "| pair | difference (nats) | 95% interval | words |",
        "|---|---:|---|---|",
    ]
    for row in sorted(rows, key=lambda r: r["difference"]):
        low, high = row["interval"]
        lines.append(
            f"| {row['name']} | {row['difference']:+.3f} | [{low:+.3f}, {high:+.3f}] | {', '.join(row['words'])} |"
        )
    return lines


def _cell(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def stability_section(results: Sequence[dict[str, Any]]) -> list[str]:
    """The summary per scheme, ranked by sensitivity, then each scheme's rates, diverged runs included."""
    by_scheme = {label: by_rate for label, by_rate in grid(results).items() if summary(by_rate) is not None}
    shared = shared_rates(by_scheme)
    if not by_scheme:
        return ["", "## Stability", "", "No run records its stability at an in-length validation loss."]
    summaries = {label: summary(by_rate, shared) or summary(by_rate) for label, by_rate in by_scheme.items()}
    ranked = sorted(
        summaries, key=lambda label: (summaries[label]["sensitivity"] is None, summaries[label]["sensitivity"] or 0)
    )
    lines = [
        "",
        "## Stability: learning-rate sensitivity, highest stable rate, spikes",
        "",
        f"Measure: {MEASURE}; over the {len(shared)} rates every scheme ran "
        f"({', '.join(f'{rate:g}' for rate in sorted(shared))}), so that every sensitivity averages over one range. "
        "A rate is stable when every run at it finished below the loss at initialisation. "
        "Spikes per 1,000 steps at the stable rates; a spike is more than 6 standard deviations above the mean of the "
        "128 steps before it (OLMo-core's rule).",
        "",
        "| scheme | LR sensitivity (nats) | best rate | highest stable rate | grid reached an unstable rate | "
        "loss spikes / 1k steps | grad-norm spikes / 1k steps | loss at init. |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for label in ranked:
        s = summaries[label]
        reached = "yes" if s["reached_unstable"] else f"no, up to {s['top_rate']:g}: a lower bound"
        lines.append(
            f"| {label} | {_cell(s['sensitivity'], '.3f')} | {s['best_rate']:g} | {_cell(s['highest_stable'], 'g')} "
            f"| {reached} | {_cell(s['loss_spikes_per_1k'], '.2f')} | {_cell(s['grad_norm_spikes_per_1k'], '.2f')} "
            f"| {s['initial_loss']:.3f} |"
        )
    lines += _comparison_lines(*comparisons(by_scheme, summaries))
    for label in ranked:
        lines += ["", f"### {label}", "", _rate_table(by_scheme[label], summaries[label]["initial_loss"])]
    return lines


def _rate_table(by_rate: dict[float, RatePoint], start: float) -> str:
    rows = [
        "| rate | runs | diverged | final loss, capped (mean) | stable | loss spikes | grad-norm spikes "
        "| grad-norm p99 (median) | largest attention logit |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for rate in sorted(by_rate):
        point = by_rate[rate]
        records = point.records
        p99 = [r["grad_norm"]["p99"] for r in records if (r.get("grad_norm") or {}).get("p99") is not None]
        logits = [r["max_attention_logit"]["max"] for r in records if r.get("max_attention_logit")]
        spikes = [sum(r.get(f"{kind}_spikes", 0) for r in records) for kind in ("loss", "grad_norm")]
        rows.append(
            f"| {rate:g} | {len(point.losses)} | {sum(loss is None for loss in point.losses)} "
            f"| {capped(point, start):.4f} | {'yes' if stable(point, start) else 'no'} | {spikes[0]} | {spikes[1]} "
            f"| {_cell(statistics.median(p99) if p99 else None, '.3g')} "
            f"| {_cell(max(logits) if logits else None, '.3g')} |"
        )
    return "\n".join(rows)


def stability_plots(results: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Final in-length loss (capped at the loss at initialisation) against the learning rate, one line a scheme."""
    series = {}
    for label, by_rate in sorted(grid(results).items()):
        start = initial_loss(by_rate)
        if start is None:
            continue
        rates = sorted(by_rate)
        series[label] = (rates, [capped(by_rate[rate], start) for rate in rates], None)
    if not series:
        return []
    path = out_dir / "stability_loss_vs_lr.png"
    title = "final in-length validation loss vs learning rate (capped at the loss at initialisation)"
    fig, ax = line_figure(series, title, "peak learning rate", "final loss (nats)", logx=True)
    rates = sorted({rate for rates, _, _ in series.values() for rate in rates})
    ax.set_xticks(rates, [f"{rate:g}" for rate in rates], rotation=45, fontsize=7)  # the grid's rates, not 2^k
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    return [path]
