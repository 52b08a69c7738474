"""Where one evaluation's results go: ``results.json``, CSVs and plots in its folder, and the console lines.

Split from ``runner.py`` (which computes the results) so that each stays short; ``runner`` re-exports these names.
"""

from __future__ import annotations

import csv
import io
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from posenc.data.retrieval import RETRIEVAL_TASKS
from posenc.evaluate import ACCURACY_LIMITS, LOSS_MIN_SPAN, PPL_MIN_SPAN, RESULTS_FILE
from posenc.evaluate.attention_stats import attention_plots
from posenc.evaluate.bins import smooth
from posenc.evaluate.effective import DEFAULT_ACC_FRACTION, DEFAULT_PPL_RATIO
from posenc.evaluate.mqar import console_lines as mqar_lines
from posenc.evaluate.plots import plot_heatmap, plot_lines
from posenc.evaluate.tasks import CHANCE_PER_BYTE
from posenc.jsonio import DiskFullError, staging_folder, write_json, write_text
from posenc.runs import provenance

TASK_NAMES = ("passkey", "copy", *RETRIEVAL_TASKS)


def replace_outputs(results: dict[str, Any], out_dir: Path, plots: bool = True) -> list[Path]:
    """``write_outputs`` into a fresh folder that then replaces ``out_dir`` whole.

    No file of an earlier evaluation (a plot, a CSV of a length no longer asked for) survives next to the new ones.
    A full disk names the file as it would have been in ``out_dir``, and leaves ``out_dir`` as it was.
    """
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_folder(out_dir)
    try:
        try:
            images = write_outputs(results, staging, plots=plots)
        except DiskFullError as full:
            raise DiskFullError(out_dir / full.path.relative_to(staging), full.needed, full.free) from None
        previous = out_dir.with_name(f".{out_dir.name}.previous")
        shutil.rmtree(previous, ignore_errors=True)
        if out_dir.exists():
            out_dir.rename(previous)
        staging.rename(out_dir)
        shutil.rmtree(previous, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [out_dir / image.name for image in images]


def _perplexity_outputs(results: dict[str, Any], out_dir: Path, plots: bool) -> list[Path]:
    """perplexity.csv and loss_by_position.csv, and their two plots; returns the PNGs written."""
    label, train_len = results["label"], results["train_len"]
    images: list[Path] = []
    _write_csv(out_dir / "perplexity.csv", results["perplexity"], exclude={"loss_by_position", "document_loss"})
    by_length = sorted(results["loss_by_position"].items(), key=lambda item: int(item[0]))
    rows = [{"length": int(n), "position": i, "loss": v} for n, curve in by_length for i, v in enumerate(curve)]
    _write_csv(out_dir / "loss_by_position.csv", rows)
    if plots:
        ok = [r for r in results["perplexity"] if r["error"] is None]
        images.append(
            plot_lines(
                {label: ([r["length"] for r in ok], [r["ppl"] for r in ok], None)},
                out_dir / "ppl_vs_length.png",
                f"{label}: perplexity vs evaluation length",
                "evaluation length (tokens)",
                "perplexity",
                train_len=train_len,
                logy=True,
                min_span=PPL_MIN_SPAN,
            )
        )
        if by_length:
            images.append(
                plot_lines(
                    {f"windows of {n}": (*smooth(curve), None) for n, curve in by_length},
                    out_dir / "loss_by_position.png",
                    f"{label}: loss by position, per evaluation length",
                    "position in window",
                    "loss (nats)",
                    train_len=train_len,
                    min_span=LOSS_MIN_SPAN,
                )
            )
    return images


def write_outputs(results: dict[str, Any], out_dir: Path, plots: bool = True) -> list[Path]:
    """results.json, CSVs and PNGs under ``out_dir``; returns the PNGs written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / RESULTS_FILE, results, indent=1)
    label, train_len = results["label"], results["train_len"]
    images: list[Path] = []
    if "perplexity" in results:
        images += _perplexity_outputs(results, out_dir, plots)
    if "passkey" in results:
        _write_csv(out_dir / "passkey.csv", results["passkey"])
        if plots:
            depths = sorted({r["depth"] for r in results["passkey"]})
            lengths = sorted({r["length"] for r in results["passkey"]})
            grid = np.zeros((len(depths), len(lengths)))
            for r in results["passkey"]:
                grid[depths.index(r["depth"]), lengths.index(r["length"])] = r["accuracy"]
            images.append(
                plot_heatmap(
                    grid, depths, lengths, out_dir / "passkey.png", f"{label}: passkey accuracy", "length", "depth"
                )
            )
    for name in ("copy", *RETRIEVAL_TASKS):
        if name not in results:
            continue
        _write_csv(out_dir / f"{name}.csv", results[name])
        if plots:
            rows = results[name]
            lengths = [r["length"] for r in rows]
            lines = {f"{label}, exact match": (lengths, [r["accuracy"] for r in rows], None)}
            if any(r.get("token_accuracy") is not None for r in rows):
                lines[f"{label}, per byte"] = (lengths, [r.get("token_accuracy") for r in rows], None)
            images.append(
                plot_lines(
                    lines,
                    out_dir / f"{name}.png",
                    f"{label}: {name} accuracy"
                    + ("" if results.get("trained_task") == name else " (not trained on it)"),
                    "length",
                    "accuracy",
                    train_len=train_len,
                    ylim=ACCURACY_LIMITS,
                    references={"per-byte chance": CHANCE_PER_BYTE[name], **keyless_reference(rows)},
                )
            )
    if results.get("mqar_by_distance"):
        _write_csv(out_dir / "mqar_by_distance.csv", results["mqar_by_distance"])
        _write_csv(out_dir / "mqar_by_query.csv", results["mqar_by_query"])
        _write_csv(out_dir / "mqar_by_distance_position.csv", results.get("mqar_by_distance_position") or [])
        if plots:
            images.append(mqar_distance_plot(results, out_dir / "mqar_by_distance.png"))
    if "attention_stats" in results:
        _write_csv(out_dir / "attention_stats.csv", results["attention_stats"])
        if plots:
            images += attention_plots(results["attention_stats"], label, train_len, out_dir)
    return images


def _write_csv(path: Path, rows: list[dict[str, Any]], exclude: set[str] = frozenset()) -> None:
    if not rows:
        return
    fields = [key for key in rows[0] if key not in exclude]
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=fields, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    write_text(path, text.getvalue())


def _perplexity_lines(results: dict[str, Any]) -> list[str]:
    """Perplexity by length with the ratio to in-length, and what was scored (sample, documents left out)."""
    lines: list[str] = []
    label, train_len = results["label"], results["train_len"]
    if "perplexity" not in results:
        return lines
    rows = results["perplexity"]
    mode = rows[0]["mode"]
    if rows[0].get("stride_fraction") is not None:
        mode += f", stride {rows[0]['stride_fraction']:g} of each length"
    elif rows[0]["stride"]:
        mode += f", stride {rows[0]['stride']}"
    scored = rows[0]["tokens"]
    what = "; ".join(provenance(results.get("config") or {}, results.get("lineage")))
    lines.append(
        f"\nPerplexity of {label}{f' ({what})' if what else ''} trained at L={train_len} ({mode}; {scored} tokens "
        "scored at each length):"
    )
    documents = results.get("documents") or {}
    split = results["eval"].get("split", "validation")
    where = {
        "documents": f"a piece of each of the {len(documents.get('documents', []))} documents of the {split} split",
        "split": f"the whole {split} split",
        "long_documents": f"whole longest windows inside each of {len(documents.get('documents', []))} documents "
        f"of the {split} split",
    }.get(documents.get("sample"), f"the first tokens of the {split} split")
    data = (results.get("config") or {}).get("data") or {}
    if data.get("val_windows"):  # two perplexities at 1×: say why they differ
        lines.append(
            f"  (1× here scores {scored} tokens, {where}; training's val/ppl scored the first "
            f"{data['val_windows'] * train_len} of the split, so the two differ by sample, not by method)"
        )
    if documents.get("qualifying"):  # long_documents: which documents could hold a window of each length
        held = ", ".join(f"{n}: {count}" for n, count in documents["qualifying"].items())
        lines.append(
            f"  (every window inside one document, {where}; documents of the split that hold a window of each "
            f"length: {held}; {documents.get('too_short')} of {documents.get('split_documents')} are too short "
            "for the longest)"
        )
    leakage = documents.get("leakage") or {}
    if leakage.get("dropped"):
        dropped = leakage["dropped"]
        lines.append(
            f"  ({len(dropped)} of the split's {leakage['split_documents']} documents left out as near-copies of "
            f"training text, containment ≥ {leakage['max_containment']:g} in {leakage.get('unit', 'lines')}: "
            + ", ".join(f"#{d['document']} ({d['containment']:.2f}, {d['tokens']} tokens)" for d in dropped)
            + ")"
        )
    lines.append(f"  {'length':>7} {'×L':>5} {'loss':>8} {'ppl':>9} {'bits/byte':>9} {'vs 1×':>7}")
    for r in rows:
        if r["error"]:
            lines.append(
                f"  {r['length']:>7} {r['multiple']:>5g} {'n/a':>8} {'n/a':>9} {'':>9} {'':>7}  ({r['error']})"
            )
        else:
            ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else ""
            figures = f"{r['loss']:>8.4f} {r['ppl']:>9.3f} {r['bpb']:>9.4f} {ratio:>7}"
            lines.append(f"  {r['length']:>7} {r['multiple']:>5g} {figures}")
    return lines


def _task_lines(results: dict[str, Any]) -> list[str]:
    """Each evaluated task's accuracy by length, with its chance and whether the run trained on its format."""
    lines: list[str] = []
    label, train_len = results["label"], results["train_len"]
    for name in TASK_NAMES:
        if name == "mqar" and name in results:
            lines.append("\n".join(mqar_lines(results)))
            if results.get("trained_task") != name:
                lines.append(
                    f"  ({label} was not trained on mqar's format: these figures measure the format, not recall)"
                )
        elif name in results:
            exact = {k.split("@")[1]: v for k, v in results["summary"].items() if k.startswith(f"{name}_acc@")}
            byte = {k.split("@")[1]: v for k, v in results["summary"].items() if k.startswith(f"{name}_byte_acc@")}
            shown = ", ".join(f"{m} {v:.2f} ({byte.get(m, float('nan')):.2f} per byte)" for m, v in exact.items())
            lines.append(f"{name} accuracy by length: {shown}; per-byte chance {CHANCE_PER_BYTE[name]:.2f}")
            if results.get("trained_task") != name:
                lines.append(
                    f"  ({label} was not trained on {name}'s format: these figures measure the format, not recall)"
                )
            rows = [r for r in results[name] if "first_byte_accuracy" in r]
            if rows:
                chance = f"chance {rows[0]['chance_first_byte']:.3g}, exact {rows[0]['chance_exact']:.3g}"
                if "keyless_exact" in rows[0]:
                    chance += (
                        f"; without matching keys {rows[0]['keyless_first_byte']:.3g}, "
                        f"exact {rows[0]['keyless_exact']:.3g}"
                        f" ({rows[0].get('keyless_exact_elimination', rows[0]['keyless_exact']):.3g} with elimination)"
                    )
                firsts = ", ".join(f"{r['length'] / train_len:g}x {r['first_byte_accuracy']:.2f}" for r in rows)
                lines.append(f"{name} first answer byte by length ({chance}): {firsts}")
    return lines


def print_results(results: dict[str, Any]) -> None:
    """The human summary: perplexity by length (with the ratio to in-length), task accuracies."""
    print("\n".join([*_perplexity_lines(results), *_task_lines(results), *effective_lines(results)]))
    for stat in ("sink", "distance"):
        values = {k: v for k, v in results["summary"].items() if k.startswith(f"attn_{stat}@")}
        if values:
            print(
                f"attention {stat} (mean over layers and heads) by length: "
                + ", ".join(f"{k.split('@')[1]} {v:.3g}" for k, v in values.items())
            )
    skipped = results.get("not_evaluated")  # results.json says it too
    if skipped:
        print(f"not evaluated at {', '.join(map(str, skipped['lengths']))} tokens: {skipped['reason']}")


def mqar_distance_plot(results: dict[str, Any], path: Path) -> Path:
    """MQAR accuracy by query–key distance (each bin at its lower edge), one line per window length."""
    rows, label, train_len = results["mqar_by_distance"], results["label"], results["train_len"]
    series = {}
    for length in sorted({r["length"] for r in rows}):
        mine = [r for r in rows if r["length"] == length]
        series[f"windows of {length}"] = ([r["distance_low"] for r in mine], [r["accuracy"] for r in mine], None)
    return plot_lines(
        series,
        path,
        f"{label}: mqar accuracy by query–key distance (bins from their lower edge)",
        "query–key distance (tokens)",
        "accuracy",
        train_len=train_len,
        ylim=ACCURACY_LIMITS,
        references={"uniform guess": results["mqar"][0]["chance_exact"], **keyless_reference(results["mqar"])},
    )


def effective_lines(results: dict[str, Any]) -> list[str]:
    """Each rule's effective lengths, the rule spelled out with its thresholds (the run is its own comparison)."""
    recorded = results.get("effective_length") or {}
    if not isinstance(recorded.get("absolute"), dict):
        return []
    thresholds = recorded.get("absolute_thresholds") or {}
    settings = results.get("eval") or {}
    ratio = settings.get("effective_ppl_ratio", DEFAULT_PPL_RATIO)
    fraction = settings.get("effective_acc_fraction", DEFAULT_ACC_FRACTION)

    def shown(lengths: dict[str, int | None]) -> str:
        return ", ".join(f"{metric} {'n/a' if n is None else n}" for metric, n in lengths.items())

    limits = ", ".join(
        f"{metric} {'≤' if metric == 'ppl' else '≥'} {value:.4g}" for metric, value in thresholds.items()
    )
    return [
        f"effective length, absolute rule (one threshold for every model compared; here the run alone: {limits}; "
        f"accuracy also above its floor; at every length up to it): {shown(recorded['absolute'])}",
        f"effective length, relative rule (ppl ≤ {ratio:g}× the run's own in-length, accuracy ≥ {fraction:g}× its "
        f"own in-length and above its floor): {shown(recorded['relative'])}",
        "  (n/a: no in-length figure, an in-length figure that misses the threshold, or in-length at the floor)",
    ]


def keyless_reference(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The keyless floors of exact match as labelled lines, where the rows record them (the retrieval tasks)."""
    out = {}
    for key, name in (("keyless_exact", "keyless floor"), ("keyless_exact_elimination", "with elimination")):
        floors = [row[key] for row in rows if row.get(key) is not None]
        if floors:
            out[name] = max(floors)
    if out.get("with elimination") == out.get("keyless floor"):
        out.pop("with elimination", None)
    return out
