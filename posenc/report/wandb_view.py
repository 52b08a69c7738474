"""A sweep's saved view in W&B, built with W&B's own ``wandb-workspaces`` library: the report's figures, live.

``python -m posenc.report <sweep> --wandb-view ENTITY/PROJECT --group <group>`` saves a workspace view of the
group's runs, one section per evaluation protocol the report holds:

- perplexity by evaluation length, a line per run coloured by scheme (a custom chart over every run's
  ``eval/<protocol>/perplexity_table``, the table each evaluation logs);
- the same as a ratio to the in-length (1×) perplexity;
- drift curves: the largest relative change of any positional parameter since the start (``drift/max``) by step,
  the runs grouped by scheme (mean and range over seeds);
- the cost chart: the ratio at the longest length against training tokens per second, a point per run.

The runs are the group's (a filter on W&B's ``Group``), grouped by their ``label`` (the scheme): the view updates
as runs finish. Without a network (W&B offline or disabled), the view is not saved: W&B's own JSON of it is written
to ``wandb_view.json`` beside the report, and the same command saves it once online.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from posenc.evaluate import protocol_name, sortable
from posenc.jsonio import write_text

VIEW_FILE = "wandb_view.json"
LINE_CHART = "wandb/line/v0"  # W&B's built-in Vega line chart: x, y, and a stroke (colour) field


def protocols(results: Sequence[dict[str, Any]]) -> dict[str, int]:
    """{protocol: its longest evaluated multiple of the training length} over the report's results."""
    longest: dict[str, int] = {}
    for result in results:
        name = protocol_name(result.get("eval") or {})
        train_len = int(result.get("train_len") or 0)
        multiples = [
            row["length"] / train_len for row in result.get("perplexity") or [] if train_len and row.get("ppl")
        ]
        if multiples:
            longest[name] = max(longest.get(name, 0), int(max(multiples)))
    return dict(sorted(longest.items(), key=lambda item: (item[0] != "nonoverlap", item[0])))


def view_target(entity_project: str) -> tuple[str, str]:
    """(entity, project) of ``--wandb-view ENTITY/PROJECT``; one line for anything else, before the report is built."""
    entity, _, project = entity_project.partition("/")
    if not entity or not project or "/" in project:
        raise SystemExit(f"--wandb-view {entity_project}: give ENTITY/PROJECT, e.g. --wandb-view my-team/posenc")
    return entity, project


def build_view(entity_project: str, group: str, results: Sequence[dict[str, Any]]) -> Any:
    """The W&B workspace (``wandb_workspaces.workspaces.Workspace``) for ``group``'s runs; nothing is sent."""
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    entity, project = view_target(entity_project)
    found = protocols(results) or {"nonoverlap": 1}
    sections = []
    for name, longest in found.items():
        table = f"eval/{name}/perplexity_table"
        sections.append(
            ws.Section(
                name=f"Extrapolation, {name}",
                is_open=True,
                panels=[
                    wr.CustomChart(
                        query={"summaryTable": {"tableKey": table}},
                        chart_name=LINE_CHART,
                        chart_fields={"x": "length", "y": "ppl", "stroke": "label"},
                        chart_strings={"title": f"perplexity by evaluation length ({name}), colour: scheme"},
                    ),
                    wr.CustomChart(
                        query={"summaryTable": {"tableKey": table}},
                        chart_name=LINE_CHART,
                        chart_fields={"x": "length", "y": "ratio", "stroke": "label"},
                        chart_strings={"title": f"perplexity / in-length (1×) perplexity ({name})"},
                    ),
                    wr.ScatterPlot(
                        title=f"cost: ratio at {longest}× against training tokens/s ({name})",
                        x="train/tokens_per_sec",
                        y=sortable(f"eval/{name}/ppl_ratio@{longest}x"),
                        log_x=True,
                    ),
                ],
            )
        )
    sections.append(
        ws.Section(
            name="Positional parameters",
            is_open=True,
            panels=[
                wr.LinePlot(
                    title="drift: largest relative change of a positional parameter since the start",
                    x="trainer/global_step",
                    y=["drift/max"],
                    log_y=True,
                )
            ],
        )
    )
    return ws.Workspace(
        entity=entity,
        project=project,
        name=f"posenc: {group}",
        sections=sections,
        runset_settings=ws.RunsetSettings(filters=[ws.Metric("Group") == group], groupby=[ws.Config("label")]),
    )


def save_view(entity_project: str, group: str, results: Sequence[dict[str, Any]], out_dir: Path, mode: str) -> str:
    """Save the view (``mode`` online) and return the line to print; offline, write W&B's JSON of it instead."""
    try:
        view = build_view(entity_project, group, results)
    except ImportError:
        raise SystemExit(
            "--wandb-view needs W&B's wandb-workspaces library: pip install -e '.[wandb]' (or wandb-workspaces)"
        ) from None
    if mode != "online":
        spec = view._to_model().model_dump(by_alias=True, exclude_none=True)  # W&B's own form of the view
        write_text(out_dir / VIEW_FILE, json.dumps(spec, indent=1))
        return (
            f"W&B is {mode}: the view of group {group} is not saved; its spec is in {out_dir / VIEW_FILE}. "
            "Run the same command online to save it"
        )
    try:
        view.save()
    except Exception as err:  # the W&B client raises many types for a key, a project or a network it lacks
        raise SystemExit(f"could not save the W&B view in {entity_project}: {err}") from None
    return f"saved the W&B view of group {group}: {view.url}"
