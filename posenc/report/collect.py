"""Where the report's results come from: ``results.json`` files under run and sweep directories, or W&B summaries."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from posenc.evaluate import RESULTS_FILE
from posenc.runs import FAILED_FILE


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
