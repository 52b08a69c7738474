"""A sweep's W&B view, built offline from the report's results with W&B's own wandb-workspaces library.

The view's panels read what the runs log (``eval/<protocol>/perplexity_table``, ``drift/max``, ``train/tokens_per_sec``,
``eval/<protocol>/ppl_ratio@<longest>x``), so each name is checked against those keys; nothing is sent to W&B.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import wandb_workspaces.reports.v2 as wr

from posenc.report.__main__ import main as report
from posenc.report.wandb_view import VIEW_FILE, build_view


def _result(label: str, seed: int, mode: str = "nonoverlap", fraction: float | None = None) -> dict:
    rows = [
        {"length": 16 * m, "multiple": m, "mode": mode, "stride": None, "tokens": 256, "loss": math.log(10.0 + m),
         "ppl": 10.0 + m, "bpb": 1.0, "ratio": (10.0 + m) / 11.0, "error": None}
        for m in (1, 2, 4)
    ]  # fmt: skip
    return {
        "label": label,
        "train_len": 16,
        "seed": seed,
        "eval": {"mode": mode, "stride": None, "stride_fraction": fraction, "multiples": [1, 2, 4]},
        "perplexity": rows,
        "loss_by_position": {},
        "config": {"logger": {"kind": "wandb", "group": "sweep-g"}},
    }


RESULTS = [_result("alibi", 0), _result("rope", 0), _result("rope", 0, "sliding", 0.5)]


def test_the_view_overlays_the_schemes_of_one_group() -> None:
    view = build_view("team/posenc", "sweep-g", RESULTS)
    assert (view.entity, view.project) == ("team", "posenc")
    assert "Group" in view.runset_settings.filters and "sweep-g" in view.runset_settings.filters
    assert [str(key.name) for key in view.runset_settings.groupby] == ["label"]  # a colour per scheme
    names = [section.name for section in view.sections]
    assert names == ["Extrapolation, nonoverlap", "Extrapolation, sliding_f0.5", "Positional parameters"]
    ppl, ratio, cost = view.sections[0].panels
    for chart, y in ((ppl, "ppl"), (ratio, "ratio")):
        assert isinstance(chart, wr.CustomChart)
        assert chart.query == {"summaryTable": {"tableKey": "eval/nonoverlap/perplexity_table"}}
        assert chart.chart_fields == {"x": "length", "y": y, "stroke": "label"}
    assert isinstance(cost, wr.ScatterPlot)
    assert (cost.x, cost.y) == ("train/tokens_per_sec", "eval/nonoverlap/ppl_ratio@004x")  # the longest length
    assert view.sections[1].panels[0].query["summaryTable"]["tableKey"] == "eval/sliding_f0.5/perplexity_table"
    (drift,) = view.sections[2].panels
    assert isinstance(drift, wr.LinePlot) and drift.y == ["drift/max"] and drift.x == "trainer/global_step"
    spec = view._to_model().model_dump(by_alias=True)  # what would be saved, in W&B's own form
    assert spec["displayName"] == "posenc: sweep-g"


def test_one_report_command_builds_it_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    for index, result in enumerate(RESULTS):
        folder = tmp_path / "sweep" / f"run{index}" / "eval"
        folder.mkdir(parents=True)
        (folder / "results.json").write_text(json.dumps(result))
    monkeypatch.setenv("WANDB_MODE", "offline")
    report([str(tmp_path / "sweep"), "--no-plots", "--wandb-view", "team/posenc"])  # the group: the runs' own
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("W&B is offline: the view of group sweep-g is not saved")
    spec = json.loads((tmp_path / "sweep" / VIEW_FILE).read_text())
    sections = spec["spec"]["section"]["panelBankConfig"]["sections"]
    assert [section["name"] for section in sections][:2] == ["Extrapolation, nonoverlap", "Extrapolation, sliding_f0.5"]
    with pytest.raises(SystemExit, match="give ENTITY/PROJECT"):
        report([str(tmp_path / "sweep"), "--no-plots", "--wandb-view", "posenc"])
