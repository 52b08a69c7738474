"""The report's "Fine-tuned runs" section: each run started from another's weights (``init_from``) beside its parent.

A fine-tuned run's ``lineage`` (in its results, else its ``run.json``) names the parent's run directory; the parent's
results come from the runs reported, else from that directory, evaluated the same way (the same ``eval*`` folder).
One table per parent and evaluation: a row per run (the parent first, then each run fine-tuned from it), a column
per evaluation length in tokens, so that a run fine-tuned at 4× the length lines up with its parent at the same
lengths. Each row is one run (n = 1): there are no seeds to pool.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from posenc.evaluate import RESULTS_FILE
from posenc.jsonio import read_record
from posenc.report.common import Appendix, run_dir
from posenc.runs import RUN_FILE

Results = list[dict[str, Any]]


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = read_record(path)
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def lineage_of(result: Mapping[str, Any]) -> dict[str, Any] | None:
    """A result's lineage: recorded in it (training's evaluation), else in its run's ``run.json`` (a re-evaluation)."""
    if result.get("lineage"):
        return dict(result["lineage"])
    if not result.get("_source"):
        return None
    summary = _read(Path(run_dir(dict(result))) / RUN_FILE)
    return (summary or {}).get("lineage") or None


def _folder(result: Mapping[str, Any]) -> str:
    """The evaluation a result is (``eval``, ``eval_sliding_f0.5``…): its folder's name."""
    return Path(result["_source"]).parent.name if result.get("_source") else "eval"


def _parent_result(lineage: Mapping[str, Any], folder: str, results: Results) -> dict[str, Any] | None:
    parent_dir = Path(lineage["parent_run_dir"]).resolve()
    for result in results:
        if result.get("_source") and Path(run_dir(result)).resolve() == parent_dir and _folder(result) == folder:
            return result
    found = _read(parent_dir / folder / RESULTS_FILE)
    return {**found, "_source": str(parent_dir / folder / RESULTS_FILE)} if found else None


def _scaling(value: Any) -> str:
    if not value:
        return "none"
    if isinstance(value, Mapping):
        return f"{value['method']}×{float(value['factor']):g} from {value['original_length']}"
    return str(value)


def changes(lineage: Mapping[str, Any]) -> str:
    """``rope → nope; seq_len 16 → 64; training scaling none → yarn×4 from 16``: what a run changed from its parent."""
    out = []
    for what, change in (lineage.get("changed") or {}).items():
        before, after = change["from"], change["to"]
        if what == "scheme":
            out.append(f"{before} → {after}")
        elif what == "context_scaling":
            out.append(f"training scaling {_scaling(before)} → {_scaling(after)}")
        elif what == "eval_scaling":
            out.append(f"evaluation scaling {_scaling(before)} → {_scaling(after)}")
        else:
            out.append(f"{what} {before} → {after}")
    return "; ".join(out) or "nothing (the same settings, trained further)"


def _ppl(result: Mapping[str, Any]) -> dict[int, str]:
    return {
        int(row["length"]): "—" if row.get("ppl") is None else f"{row['ppl']:.2f}"
        for row in result.get("perplexity") or []
    }


def _steps(result: Mapping[str, Any]) -> str:
    steps = (result.get("training") or {}).get("steps")
    return "?" if steps is None else str(steps)


def _names(rows: list[tuple[Mapping[str, Any], Mapping[str, Any] | None]]) -> list[str]:
    """Each row's run: its run name and scheme (or "parent"), with its directory's name where run names repeat."""
    names = [str(result.get("run_name") or result["label"]) for result, _ in rows]
    out = []
    for name, (result, lineage) in zip(names, rows, strict=True):
        if names.count(name) > 1 and result.get("_source"):
            name += f" · {Path(run_dir(dict(result))).name}"
        out.append(f"{name} ({'parent' if lineage is None else result['label']})")
    return out


def _row(name: str, result: Mapping[str, Any], lineage: Mapping[str, Any] | None, lengths: list[int]) -> str:
    """One run's row: the parent's says so; a fine-tuned run's says what it changed and what carried over."""
    changed, weights = "—", "—"
    if lineage is not None:
        changed = changes(lineage)
        weights = f"{len(lineage['copied'])} copied, {len(lineage['fresh'])} fresh, {len(lineage['dropped'])} dropped"
    cells = _ppl(result)
    row = [name, str(result["train_len"]), _steps(result), changed, weights, *(cells.get(n, "") for n in lengths)]
    return "| " + " | ".join(row) + " |"


def finetuned_tables(results: Results, appendix: Appendix | None = None) -> str:
    """Markdown: one table per parent and evaluation, empty when no reported run was fine-tuned from another."""
    families: dict[tuple[str, str], list[tuple[dict[str, Any], dict[str, Any]]]] = defaultdict(list)
    for result in results:
        lineage = lineage_of(result)
        if lineage is not None and result.get("perplexity"):
            families[(str(Path(lineage["parent_run_dir"]).resolve()), _folder(result))].append((result, lineage))
    if not families:
        return ""
    lines = [
        "## Fine-tuned runs",
        "",
        "Runs started from another run's weights (init_from), each under its parent: perplexity by evaluation "
        "length in tokens, one run per row (n = 1, no interval). Weights: tensors copied from the parent, fresh "
        "(the new scheme's own) and dropped (the parent scheme's).",
    ]
    for (parent_dir, folder), members in sorted(families.items()):
        first = members[0][1]
        parent = _parent_result(first, folder, results)
        rows: list[tuple[Mapping[str, Any], Mapping[str, Any] | None]] = [(parent, None)] if parent else []
        rows += sorted(members, key=lambda item: str(item[0].get("run_name")))
        lengths = sorted({length for result, _ in rows for length in _ppl(result)})
        name = first["parent_run_name"] or Path(parent_dir).name
        where = "" if folder == "eval" else f", {folder}"
        title = (
            f"from {name} ({first['parent_scheme']} at {first['parent_seq_len']} tokens, "
            f"step {first['parent_step']}{where})"
        )
        lines += ["", f"### {title}", ""]
        if parent is None:
            lines += [
                f"The parent's results are not in {parent_dir}/{folder}: evaluate it (python -m posenc.evaluate)."
            ]
            lines.append("")
        lines.append("| run | trained at | steps | changed | weights | " + " | ".join(map(str, lengths)) + " |")
        lines.append("|---|---:|---:|---|---|" + "---:|" * len(lengths))
        names = _names(rows)
        lines += [_row(name, result, lineage, lengths) for name, (result, lineage) in zip(names, rows, strict=True)]
        if appendix is not None:
            appendix.add(
                f"Fine-tuned runs, {title}", {name: [dict(r)] for name, (r, _) in zip(names, rows, strict=True)}
            )
    return "\n".join(lines)
