"""Where the report's results come from: ``results.json`` files under run and sweep directories, or W&B summaries."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from posenc.evaluate import RESULTS_FILE
from posenc.jsonio import KEPT, read_record, record_path
from posenc.runs import CHECKPOINT, DONE_FILE, FAILED_FILE, RUN_FILE
from posenc.training.identity import identity, shown_label


def find_results(paths: Iterable[str | Path], unreadable: list[str] | None = None) -> list[dict[str, Any]]:
    """Load every results.json under ``paths`` (files or directories, searched recursively), and every failed run.

    A failed run (``failed.json``: it stopped on a non-finite loss) comes back as ``{"failed": reason, ...}`` with its
    config and stability record, and is listed apart, never pooled; the stability section counts it as diverged.
    A result carries its run's ``stability`` record (``run.json``). A file that cannot be read is skipped and named in
    ``unreadable`` with the reason. Hidden folders are not searched: they hold an evaluation being written
    (``posenc/evaluate/outputs.py``).
    """
    found: list[dict[str, Any]] = []
    for raw in paths:
        path = Path(raw)
        files = [path] if path.is_file() else _visible(path, [*path.rglob(RESULTS_FILE), *path.rglob(KEPT_RESULTS)])
        for file in files:
            try:
                data = read_record(file)
                if not isinstance(data, dict) or "label" not in data or "train_len" not in data:
                    raise ValueError("not a posenc results file")
            except (OSError, UnicodeDecodeError, ValueError) as err:
                if unreadable is not None:
                    unreadable.append(f"{file}: {_why(err)}")
                continue
            data["_source"] = str(file)
            data.setdefault("training", _recorded_training(file))
            stability = data.get("stability") or _run_summary(file).get("stability")
            if stability is not None:
                data["stability"] = stability
            found.append(data)
        failures = [*path.rglob(FAILED_FILE), *path.rglob(FAILED_FILE + KEPT)]
        for file in [] if path.is_file() else _visible(path, failures):
            try:
                record = read_record(file)
                failed = {"failed": record["reason"], "run_name": record["run_name"], "_source": str(file)}
                # What a diverged run measured, for the sections that count it as diverged (stability.py)
                failed.update({key: record[key] for key in ("config", "label", "stability", "step") if key in record})
                found.append(failed)
            except (OSError, UnicodeDecodeError, ValueError, KeyError) as err:
                if unreadable is not None:
                    unreadable.append(f"{file}: {_why(err)}")
    return found


KEPT_RESULTS = RESULTS_FILE + KEPT  # a study's kept copy (posenc/report/study.py)


def _visible(root: Path, files: Iterable[Path]) -> list[Path]:
    return sorted(file for file in files if not any(part.startswith(".") for part in file.relative_to(root).parts))


def _why(err: Exception) -> str:
    """Why a record was left out, in the words the report prints."""
    if isinstance(err, json.JSONDecodeError):
        return f"cut short or damaged JSON ({err})"
    if isinstance(err, KeyError):
        return f"no {err} in it"
    return str(err)


def _results_run(results_file: Path) -> Path:
    """The run directory a results file belongs to (its ``eval*/`` folder's parent)."""
    folder = results_file.parent
    return folder.parent if folder.name.startswith("eval") else folder


def _run_summary(results_file: Path) -> dict[str, Any]:
    """The ``run.json`` of a result's run; empty when there is none or it cannot be read."""
    path = _results_run(results_file) / RUN_FILE
    try:
        return read_record(path) if record_path(path) is not None else {}
    except (OSError, UnicodeDecodeError, ValueError):
        return {}


def _recorded_training(results_file: Path) -> dict[str, Any]:
    """Steps and tokens of a result written before results recorded them: from its run's ``run.json``.

    A run directory with a checkpoint but no ``done.json`` did not finish; without either, nothing is known.
    """
    run = _results_run(results_file)
    summary = _run_summary(results_file)
    record: dict[str, Any] = {"steps": summary.get("steps"), "tokens": summary.get("tokens")} if summary else {}
    if (run / CHECKPOINT).is_file() and record_path(run / DONE_FILE) is None:
        record["finished"] = False
    return record


def finished(result: dict[str, Any]) -> bool:
    """Whether a result's weights finished training; results that cannot say count as finished."""
    return (result.get("training") or {}).get("finished", True) is not False


def results_from_wandb(path: str, group: str | None) -> list[dict[str, Any]]:
    """Rebuild minimal results from W&B runs' summaries (``eval/nonoverlap/ppl@Nx``, ``trainer/global_step``).

    Steps and tokens trained come from the summary's step and the logged ``tokens_per_step``.
    """
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
        # eval/nonoverlap/ppl@4x; runs logged before protocols named their keys: eval/ppl@4x, before that ppl@4x
        prefix = next((p for p in ("eval/nonoverlap/", "eval/") if any(k.startswith(f"{p}ppl@") for k in summary)), "")
        for key, value in summary.items():
            name = key.removeprefix(prefix)
            if key.startswith(prefix) and name.startswith("ppl@") and name.endswith("x"):
                multiple = float(name[4:-1])
                ratio = summary.get(key.replace("ppl@", "ppl_ratio@"))
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
            steps, per_step = summary.get("trainer/global_step"), config.get("tokens_per_step")
            max_steps = (config.get("trainer") or {}).get("max_steps")
            training = {
                "steps": steps,
                "max_steps": max_steps,
                "tokens": steps * per_step if steps is not None and per_step else None,
                "finished": steps is None or max_steps is None or steps >= max_steps,
            }
            results.append(
                {
                    "label": label,
                    "run_name": run.name,
                    "training": training,
                    "train_len": train_len,
                    "seed": config.get("seed"),
                    "perplexity": sorted(rows, key=lambda r: r["length"]),
                }
            )
    return results


def distinct_seeds(results: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """Each seed of one configuration counted once: the newest run's result, and a line naming every one left out.

    Why: two runs of one configuration and one seed (a command run twice) are one draw of the seed, not two; pooled,
    they would count as two seeds and narrow every interval. Runs are the same when their shown label, their settings
    (``identity``: everything but the seed), their seed, training length and evaluation folder agree. The newest is
    the one whose ``done.json`` finished last (else whose run directory sorts last: its name holds its start time).
    """
    groups: dict[str, list[dict[str, Any]]] = {}
    for result in results:
        if result.get("seed") is None:
            groups[str(id(result))] = [result]
            continue
        evaluation = Path(str(result.get("_source", ""))).parent.name or repr(result.get("eval"))
        key = repr((shown_label(result), identity(result), result["seed"], result["train_len"], evaluation))
        groups.setdefault(key, []).append(result)
    kept, notes = [], []
    for group in groups.values():
        newest = max(group, key=_finished_at)
        kept.append(newest)
        if len(group) > 1:
            older = ", ".join(_run_folder(r) for r in group if r is not newest)
            notes.append(
                f"{shown_label(newest)} seed {newest['seed']} ({Path(str(newest.get('_source', ''))).parent.name}): "
                f"{len(group)} runs, counted once: kept {_run_folder(newest)}, left out {older}"
            )
    return kept, notes


def _run_folder(result: dict[str, Any]) -> str:
    folder = Path(str(result.get("_source", "W&B")))
    return str(folder.parent.parent if folder.parent.name.startswith("eval") else folder.parent)


def _finished_at(result: dict[str, Any]) -> tuple[str, str]:
    run = Path(_run_folder(result))
    try:
        finished_at = str(read_record(run / DONE_FILE).get("finished_at") or "")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        finished_at = ""
    return finished_at, str(run)
