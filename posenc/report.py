"""``python -m posenc.report <sweep or run dirs…>``: every scheme side by side, as the ALiBi paper's Table 2.

Reads every ``results.json`` under the given directories (written by training's end-of-run evaluation or by
``posenc.evaluate``), groups runs by training length and evaluation mode, and writes ``report.md`` plus
combined plots (one line per scheme): rows are evaluation lengths, columns are schemes, cells are mean ± std
over seeds, followed by the ratio to in-length perplexity and task accuracies. ``--wandb entity/project``
builds the same tables from W&B run summaries instead (needs network).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from posenc.data.retrieval import RETRIEVAL_TASKS
from posenc.evaluate import RESULTS_FILE
from posenc.evaluate.attention_stats import mean_by_length
from posenc.identity import columns
from posenc.runs import FAILED_FILE

Key = tuple[int, str, int | None]  # (train_len, mode, stride)


def find_results(paths: Iterable[str | Path], unreadable: list[str] | None = None) -> list[dict[str, Any]]:
    """Load every results.json under ``paths`` (files or directories, searched recursively), and every failed run.

    A failed run (``failed.json``: it stopped on a non-finite loss) comes back as ``{"failed": reason, ...}`` and is
    listed apart, never pooled. A file that cannot be read is skipped and named in ``unreadable``.
    """
    found: list[dict[str, Any]] = []
    for raw in paths:
        path = Path(raw)
        files = [path] if path.is_file() else sorted(path.rglob(RESULTS_FILE))
        for file in files:
            try:
                data = json.loads(file.read_text())
                if not isinstance(data, dict) or "label" not in data or "train_len" not in data:
                    raise ValueError("not a posenc results file")
            except (OSError, UnicodeDecodeError, ValueError) as err:
                if unreadable is not None:
                    unreadable.append(f"{file}: {err}")
                continue
            data["_source"] = str(file)
            found.append(data)
        for file in [] if path.is_file() else sorted(path.rglob(FAILED_FILE)):
            try:
                record = json.loads(file.read_text())
                found.append({"failed": record["reason"], "run_name": record["run_name"], "_source": str(file)})
            except (OSError, UnicodeDecodeError, ValueError, KeyError) as err:
                if unreadable is not None:
                    unreadable.append(f"{file}: {err}")
    return found


def _mean_std(values: Sequence[float]) -> tuple[float, float, int]:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return math.nan, math.nan, 0
    return statistics.fmean(finite), (statistics.stdev(finite) if len(finite) > 1 else 0.0), len(finite)


def _cell(values: Sequence[float], digits: int = 2) -> str:
    mean, std, n = _mean_std(values)
    if n == 0:
        return "—"
    return f"{mean:.{digits}f}" if n == 1 else f"{mean:.{digits}f} ± {std:.{digits}f}"


def _order(labels: Iterable[str]) -> list[str]:
    """Schemes in registry order first, then hybrids, each alphabetically: stable columns across reports."""
    from posenc.encodings import available

    known = available()

    def key(label: str) -> tuple[bool, int, str]:
        scheme = label.split(" · ")[0]
        return scheme not in known, known.index(scheme) if scheme in known else 0, label

    return sorted(set(labels), key=key)


def group_runs(results: list[dict[str, Any]]) -> dict[Key, dict[str, list[dict[str, Any]]]]:
    """{(train_len, mode, stride): {column: [run results…]}} for language-modelling results.

    A column pools runs of one identity (``posenc.identity``): same settings but the seed.
    """
    by_key: dict[Key, list[dict[str, Any]]] = defaultdict(list)
    for result in results:
        rows = result.get("perplexity") or []
        if not rows or result.get("failed"):
            continue
        by_key[(int(result["train_len"]), rows[0]["mode"], rows[0]["stride"])].append(result)
    return {key: columns(runs) for key, runs in by_key.items()}


def perplexity_tables(key: Key, by_label: dict[str, list[dict[str, Any]]]) -> str:
    train_len, mode, stride = key
    labels = _order(by_label)
    lengths = sorted({row["length"] for runs in by_label.values() for run in runs for row in run["perplexity"]})
    tokens = sorted({row["tokens"] for runs in by_label.values() for run in runs for row in run["perplexity"]})
    how = mode + (f", stride {stride}" if stride else "")
    header = "| length | ×L | " + " | ".join(f"{label} (n={len(by_label[label])})" for label in labels) + " |"
    rule = "|---:|---:|" + "---:|" * len(labels)
    out = [
        f"## Trained at L={train_len} — {how}",
        "",
        f"Perplexity on held-out text, mean ± std over seeds; {', '.join(map(str, tokens))} tokens scored at every "
        "length (the same tokens), so lengths are comparable. Each column pools runs whose settings differ only in "
        "their seed (n runs); runs that differ in anything else are separate columns named by the difference.",
        "",
        header,
        rule,
    ]
    ratio_rows = []
    for length in lengths:
        cells, ratios = [], []
        for label in labels:
            values = [_value(run, length, "ppl") for run in by_label[label]]
            cells.append(_cell(values))
            ratios.append(_cell([_value(run, length, "ratio") for run in by_label[label]], digits=3))
        out.append(f"| {length} | {length / train_len:g} | " + " | ".join(cells) + " |")
        ratio_rows.append(f"| {length} | {length / train_len:g} | " + " | ".join(ratios) + " |")
    out += ["", "Ratio to the in-length (1×) perplexity of the same run (1.0 = no degradation):", "", header, rule]
    out += ratio_rows
    return "\n".join(out)


def _value(run: dict[str, Any], length: int, field: str) -> float | None:
    for row in run["perplexity"]:
        if row["length"] == length and row["error"] is None:
            return row[field]
    return None


def task_tables(results: list[dict[str, Any]], tasks: Sequence[str] = ("passkey", "copy")) -> str:
    """Accuracy of each task by length (passkey: mean over depths), per training length."""
    out = []
    for task in tasks:
        by_len = _task_columns(results, task)
        for train_len, by_label in sorted(by_len.items()):
            labels = _order(by_label)
            lengths = sorted({row["length"] for runs_ in by_label.values() for run in runs_ for row in run[task]})
            out += [
                f"## {task} accuracy, trained at L={train_len}",
                "",
                "Exact-match accuracy (passkey: mean over key depths), mean ± std over seeds (runs that differ only "
                "in their seed).",
                "",
                "| length | ×L | " + " | ".join(f"{label} (n={len(by_label[label])})" for label in labels) + " |",
                "|---:|---:|" + "---:|" * len(labels),
            ]
            for length in lengths:
                cells = [_cell(_task_accuracies(by_label[label], task, length)) for label in labels]
                out.append(f"| {length} | {length / train_len:g} | " + " | ".join(cells) + " |")
            out.append("")
            if task == "passkey":
                out += _depth_table(by_label, labels, max(lengths), train_len)
    return "\n".join(out)


def _task_columns(results: list[dict[str, Any]], task: str) -> dict[int, dict[str, list[dict[str, Any]]]]:
    """{train_len: {column: runs}} for the runs scored on ``task``."""
    by_len: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for run in results:
        if run.get(task) and not run.get("failed"):
            by_len[int(run["train_len"])].append(run)
    return {train_len: columns(runs) for train_len, runs in by_len.items()}


def _task_accuracies(runs: list[dict[str, Any]], task: str, length: int, depth: float | None = None) -> list[float]:
    """Per run: mean accuracy over the rows at ``length`` (and ``depth``, for passkey)."""
    accs = []
    for run in runs:
        rows = [r for r in run[task] if r["length"] == length and (depth is None or r["depth"] == depth)]
        if rows:
            accs.append(statistics.fmean(r["accuracy"] for r in rows))
    return accs


def _depth_table(
    by_label: dict[str, list[dict[str, Any]]], labels: list[str], length: int, train_len: int
) -> list[str]:
    """Passkey accuracy by key depth at the longest length: where in the window retrieval fails."""
    depths = sorted({row["depth"] for runs in by_label.values() for run in runs for row in run["passkey"]})
    out = [
        f"Passkey accuracy by key depth at length {length} ({length / train_len:g}×; depth 0 = the key at the start"
        ", farthest from the question):",
        "",
        "| depth | " + " | ".join(labels) + " |",
        "|---:|" + "---:|" * len(labels),
    ]
    for depth in depths:
        cells = [_cell(_task_accuracies(by_label[label], "passkey", length, depth)) for label in labels]
        out.append(f"| {depth:g} | " + " | ".join(cells) + " |")
    out.append("")
    return out


def task_plots(results: list[dict[str, Any]], out_dir: Path, tasks: Sequence[str] = ("passkey", "copy")) -> list[Path]:
    """Accuracy vs length, one line per scheme, per task and training length."""
    from posenc.evaluate.plots import plot_lines  # matplotlib only when plotting

    images = []
    for task in tasks:
        for train_len, by_label in sorted(_task_columns(results, task).items()):
            series = {}
            for label in _order(by_label):
                lengths = sorted({row["length"] for run in by_label[label] for row in run[task]})
                stats = [_mean_std(_task_accuracies(by_label[label], task, length)) for length in lengths]
                series[label] = (lengths, [m for m, _, _ in stats], [s for _, s, _ in stats])
            images.append(
                plot_lines(
                    series,
                    out_dir / f"{task}_accuracy_L{train_len}.png",
                    f"{task} accuracy vs length (trained at L={train_len})",
                    "evaluation length (tokens)",
                    "exact-match accuracy",
                    train_len=train_len,
                )
            )
    return images


def plots(groups: dict[Key, dict[str, list[dict[str, Any]]]], out_dir: Path) -> list[Path]:
    """Per group: perplexity vs length, ratio vs length, loss by position (one line per scheme)."""
    from posenc.evaluate.plots import plot_lines, smooth  # matplotlib only when plotting

    images = []
    for (train_len, mode, stride), by_label in sorted(groups.items(), key=lambda item: str(item[0])):
        suffix = f"L{train_len}_{mode}" + (f"_s{stride}" if stride else "")
        for field, ylabel, logy in (("ppl", "perplexity", True), ("ratio", "perplexity / in-length perplexity", True)):
            series = {}
            for label in _order(by_label):
                lengths = sorted({row["length"] for run in by_label[label] for row in run["perplexity"]})
                stats = [_mean_std([_value(run, length, field) for run in by_label[label]]) for length in lengths]
                kept = [(length, m, s) for length, (m, s, n) in zip(lengths, stats, strict=True) if n]
                if kept:
                    series[label] = ([k[0] for k in kept], [k[1] for k in kept], [k[2] for k in kept])
            images.append(
                plot_lines(
                    series,
                    out_dir / f"{field}_vs_length_{suffix}.png",
                    f"{field} vs evaluation length (trained at L={train_len}, {mode})",
                    "evaluation length (tokens)",
                    ylabel,
                    train_len=train_len,
                    logy=logy,
                )
            )
        curves = {}
        for label in _order(by_label):
            per_run = [run.get("loss_by_position") or {} for run in by_label[label]]
            common = set.intersection(*(set(c) for c in per_run)) if per_run else set()
            if common:
                longest = max(common, key=int)
                length = int(longest)
                mean_curve = [statistics.fmean(c[longest][i] for c in per_run) for i in range(length)]
                x, y = smooth(mean_curve)
                curves[label] = (x, y, None)
        if curves:
            images.append(
                plot_lines(
                    curves,
                    out_dir / f"loss_by_position_{suffix}.png",
                    f"loss by position (trained at {train_len})",
                    "position in window",
                    "loss (nats)",
                    train_len=train_len,
                )
            )
    return images


def build_report(results: list[dict[str, Any]], out_dir: Path, make_plots: bool = True) -> str:
    """Write report.md (and plots) to ``out_dir``; return the markdown."""
    if not results:
        raise SystemExit("no results.json found: train with eval.at_end=true or run `python -m posenc.evaluate <run>`")
    for run in results:  # an older run that diverged without stopping: no finite perplexity at any length
        rows = run.get("perplexity") or []
        if rows and not run.get("failed") and all(r["ppl"] is None and r["error"] is None for r in rows):
            run["failed"] = "no finite perplexity at any length (the run diverged)"
            run.setdefault("run_name", run["label"])
    failed = [r for r in results if r.get("failed")]
    results = [r for r in results if not r.get("failed")]
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = group_runs(results)
    sections = ["# posenc extrapolation report", "", f"{len(results)} evaluated run(s)."]
    if failed:
        sections += ["", f"## Failed runs ({len(failed)}, not counted in any column)", ""]
        sections += [
            f"- {run['run_name']}: {run['failed']} ({Path(run.get('_source', 'W&B')).parent})" for run in failed
        ]
    for key, by_label in sorted(groups.items(), key=lambda item: str(item[0])):
        sections += ["", perplexity_tables(key, by_label)]
    tasks = task_tables(results)
    if tasks:
        sections += ["", tasks]
    sections += retrieval_and_attention_sections(results)
    images = plots(groups, out_dir) + task_plots(results, out_dir) if make_plots else []
    images += retrieval_and_attention_plots(results, out_dir) if make_plots else []
    if images:
        sections += ["", "## Plots", ""] + [f"![{image.stem}]({image.name})" for image in images]
    markdown = "\n".join(sections).rstrip() + "\n"
    (out_dir / "report.md").write_text(markdown)
    return markdown


def results_from_wandb(path: str, group: str | None) -> list[dict[str, Any]]:
    """Rebuild minimal results (perplexity by length from ``ppl@Nx`` summaries) from W&B runs."""
    try:
        import wandb

        api = wandb.Api(timeout=20)
        runs = api.runs(path, filters={"group": group} if group else None)
        runs = list(runs)
    except Exception as err:  # the W&B client raises many types offline or without a key
        raise SystemExit(f"could not read W&B project {path!r}: {err}. Use local run directories instead.") from err
    results = []
    for run in runs:
        summary, config = dict(run.summary), dict(run.config)
        train_len = int(config.get("data", {}).get("seq_len", 0))
        rows = []
        for key, value in summary.items():
            if key.startswith("ppl@") and key.endswith("x"):
                multiple = float(key[4:-1])
                ratio = summary.get(f"ppl_ratio@{key[4:]}")
                length = int(multiple * train_len)
                rows.append(
                    {
                        "length": length,
                        "mode": "nonoverlap",
                        "stride": None,
                        "tokens": None,
                        "ppl": value,
                        "ratio": ratio,
                        "error": None,
                    }
                )
        if rows and train_len:
            label = next((t for t in run.tags if not t.startswith(("L", "seed"))), run.name)
            results.append(
                {
                    "label": label,
                    "train_len": train_len,
                    "seed": config.get("seed"),
                    "perplexity": sorted(rows, key=lambda r: r["length"]),
                }
            )
    return results


# --- retrieval tasks and attention statistics (issue 17) ----------------------------------------------------------


def _attention_groups(results: list[dict[str, Any]]) -> dict[tuple[int, str], dict[str, list[dict[str, Any]]]]:
    """{(train_len, data): {column: runs}} for runs with attention statistics; text and each task apart.

    Columns pool runs by identity (``posenc/identity.py``), as the perplexity tables do.
    """
    by_group: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for run in results:
        if run.get("attention_stats") and not run.get("failed"):
            data = run.get("data") or {}
            by_group[(int(run["train_len"]), str(data.get("task") or data.get("corpus") or "?"))].append(run)
    return {group: columns(runs) for group, runs in by_group.items()}


def _attention_means(run: dict[str, Any], stat: str) -> dict[int, float]:
    """{length: the statistic averaged over layers and heads} of one run."""
    lengths, means = mean_by_length(run["attention_stats"], stat)
    return dict(zip(lengths, means, strict=True))


ATTENTION_STATS = {
    "sink": "Sink mass: attention probability on the window's first token",
    "distance": "Mean attended distance in tokens",
    "entropy": "Attention entropy in nats",
}


def attention_tables(results: list[dict[str, Any]]) -> str:
    """Sink mass, mean attended distance and entropy by length (mean over layers and heads), one column per scheme."""
    out = []
    for (train_len, data), by_label in sorted(_attention_groups(results).items()):
        labels = _order(by_label)
        lengths = sorted({n for runs in by_label.values() for run in runs for n in _attention_means(run, "sink")})
        for stat, what in ATTENTION_STATS.items():
            out += [
                f"## Attention: {stat} by length, trained at L={train_len} on {data}",
                "",
                f"{what}, averaged over every layer, head and query (but each window's first), mean ± std over seeds. "
                "Per layer × head: each run's eval/attention_stats.csv and attention_heatmaps.png.",
                "",
                "| length | ×L | " + " | ".join(f"{label} (n={len(by_label[label])})" for label in labels) + " |",
                "|---:|---:|" + "---:|" * len(labels),
            ]
            for length in lengths:
                cells = [
                    _cell([_attention_means(run, stat).get(length) for run in by_label[label]], digits=3)
                    for label in labels
                ]
                out.append(f"| {length} | {length / train_len:g} | " + " | ".join(cells) + " |")
            out.append("")
    return "\n".join(out)


def attention_plots(results: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Sink mass and mean attended distance vs length, one line per scheme, per training length and data."""
    from posenc.evaluate.plots import plot_lines  # matplotlib only when plotting

    images = []
    for (train_len, data), by_label in sorted(_attention_groups(results).items()):
        for stat, ylabel, logy in (("sink", "sink mass", False), ("distance", "mean attended distance", True)):
            series = {}
            for label in _order(by_label):
                per_run = [_attention_means(run, stat) for run in by_label[label]]
                lengths = sorted({n for means in per_run for n in means})
                stats = [_mean_std([means.get(n) for means in per_run]) for n in lengths]
                series[label] = (lengths, [m for m, _, _ in stats], [sd for _, sd, _ in stats])
            images.append(
                plot_lines(
                    series,
                    out_dir / f"attention_{stat}_L{train_len}_{data}.png",
                    f"{ylabel} vs length, mean over layers and heads (trained at L={train_len} on {data})",
                    "evaluation length (tokens)",
                    ylabel,
                    train_len=train_len,
                    logy=logy,
                )
            )
    return images


def retrieval_and_attention_sections(results: list[dict[str, Any]]) -> list[str]:
    """Report sections for the retrieval tasks (multikey, vartrack, assoc) and the attention statistics."""
    sections = []
    for text in (task_tables(results, tuple(RETRIEVAL_TASKS)), attention_tables(results)):
        if text:
            sections += ["", text]
    return sections


def retrieval_and_attention_plots(results: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    return task_plots(results, out_dir, tuple(RETRIEVAL_TASKS)) + attention_plots(results, out_dir)


class ReportOnSweepEnd(Callback):
    """Hydra callback: when a multirun ends, write report.md and plots into the sweep directory.

    Enable it in a sweep config with ``hydra.callbacks.report._target_: posenc.report.ReportOnSweepEnd``.
    """

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        results = find_results([sweep_dir])
        if not results:
            print(f"posenc.report: no results.json under {sweep_dir}; nothing to report")
            return
        print(build_report(results, sweep_dir))
        print(f"wrote {sweep_dir / 'report.md'}")
        failed = [run["run_name"] for run in results if run.get("failed")]
        if failed:  # the sweep ran every job, but it did not succeed: say so in the exit status
            raise SystemExit(
                f"{len(failed)} job(s) of this sweep failed ({', '.join(failed)}): see failed.json in their "
                "directories; relaunching the sweep retries them"
            )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m posenc.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="sweep or run directories (searched for results.json), or files")
    parser.add_argument("--out", type=Path, help="output directory (default: the first path, or ./report)")
    parser.add_argument("--wandb", metavar="ENTITY/PROJECT", help="read run summaries from W&B instead")
    parser.add_argument("--group", help="with --wandb: only this W&B group (a sweep)")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    if not args.paths and not args.wandb:
        parser.error("give run/sweep directories, or --wandb ENTITY/PROJECT")
    unreadable: list[str] = []
    results = find_results(args.paths, unreadable)
    if not results and unreadable:
        raise SystemExit(f"no readable results: {unreadable[0]}. Re-run `python -m posenc.evaluate <run>` for it")
    for problem in unreadable:
        print(f"skipped unreadable {problem}", file=sys.stderr)
    if args.wandb:
        results += results_from_wandb(args.wandb, args.group)
    first = Path(args.paths[0]) if args.paths else None
    out_dir = args.out or (first if first is not None and first.is_dir() else Path("report"))
    print(build_report(results, out_dir, make_plots=not args.no_plots))
    print(f"wrote {out_dir / 'report.md'}")


if __name__ == "__main__":
    main()
