"""The cost-vs-extrapolation chart: every point named without a name covering another or a point, and a cost axis
that says when the runs' conditions differ instead of drawing a busy machine as an expensive scheme."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest

from posenc.report.benchcost import find_bench
from posenc.report.collect import find_results
from posenc.report.cost import conditions_note, cost_plots, cost_points, cost_table
from posenc.report.perplexity import group_runs

# Sixteen schemes, most of them within 1% of ratio 1 and of NoPE's throughput: where names written beside the
# points used to pile up.
CROWDED = {f"scheme{i:02d}": (1.0 + 0.001 * i, 1000.0 - 3 * i) for i in range(16)} | {"nope": (1.002, 1000.0)}


def _run(root: Path, label: str, ratio: float, speed: float, conditions: dict | None) -> None:
    folder = root / label
    rows = [
        {"length": 32 * m, "mode": "nonoverlap", "stride": None, "tokens": 2048, "loss": math.log(p), "ppl": p,
         "bpb": 1.0, "error": None, "multiple": m, "ratio": p / 10.0}
        for m, p in ((1, 10.0), (32, 10.0 * ratio))
    ]  # fmt: skip
    result = {"label": label, "train_len": 32, "seed": 0, "perplexity": rows, "loss_by_position": {}}
    result["eval"] = {"mode": "nonoverlap", "stride": None, "multiples": [1, 32]}
    (folder / "eval").mkdir(parents=True)
    (folder / "eval" / "results.json").write_text(json.dumps(result))
    record = {"steps": 10, "tokens": 10 * speed, "train_seconds": 10.0, "tokens_per_sec": speed}
    if conditions is not None:
        record["train_conditions"] = conditions
    (folder / "run.json").write_text(json.dumps(record))


def _sweep(root: Path, conditions: dict[str, dict | None] | None = None) -> dict:
    same = {"device": "cpu × 2", "threads": 2, "load_per_core": 0.9, "load_samples": 10}
    for label, (ratio, speed) in CROWDED.items():
        _run(root, label, ratio, speed, (conditions or {}).get(label, same))
    (by_label,) = group_runs(find_results([root])).values()
    return by_label


def _boxes_overlap(a: matplotlib.transforms.Bbox, b: matplotlib.transforms.Bbox) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_no_label_covers_another_label_or_a_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    by_label = _sweep(tmp_path / "runs")
    kept = {}
    monkeypatch.setattr(plt, "close", lambda fig: kept.setdefault("fig", fig))
    (path,) = cost_plots({(32, "nonoverlap", None): by_label}, tmp_path / "out")
    assert path.stat().st_size > 0
    fig = kept["fig"]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (ax,) = [a for a in fig.axes if a.get_lines()]
    texts = [t for t in ax.get_legend().get_texts()] + list(ax.texts) + list(fig.texts)
    assert {t.get_text() for t in ax.get_legend().get_texts()} == set(CROWDED)  # every point is named
    boxes = [t.get_window_extent(renderer) for t in texts]
    for i, first in enumerate(boxes):
        for second in boxes[i + 1 :]:
            assert not _boxes_overlap(first, second)
    points = [ax.transData.transform(xy) for line in ax.get_lines() for xy in line.get_xydata()]
    assert len(points) >= len(CROWDED)
    for box in boxes:
        assert not any(box.contains(x, y) for x, y in points)
    # Each point's marker and colour belong to it alone, so the legend identifies it.
    styles = [(line.get_marker(), line.get_color()) for line in ax.get_lines() if line.get_label() in CROWDED]
    assert len(set(styles)) == len(CROWDED)


def test_conditions_that_differ_are_said_on_the_chart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    busy = {"device": "cpu × 2", "threads": 2, "load_per_core": 1.9, "load_samples": 10}
    by_label = _sweep(tmp_path / "runs", {"scheme03": busy, "scheme05": None})
    note = conditions_note(by_label)
    assert note is not None and "scheme03 1.90" in note and "not recorded for scheme05" in note
    kept = {}
    monkeypatch.setattr(plt, "close", lambda fig: kept.setdefault("fig", fig))
    cost_plots({(32, "nonoverlap", None): by_label}, tmp_path / "out")
    assert any("conditions that differ" in text.get_text() for text in kept["fig"].texts)


def test_runs_under_the_same_conditions_draw_no_note(tmp_path: Path) -> None:
    assert conditions_note(_sweep(tmp_path / "runs")) is None
    threads = {"device": "cpu × 2", "threads": 1, "load_per_core": 0.9, "load_samples": 10}
    note = conditions_note(_sweep(tmp_path / "other", {"nope": threads}))
    assert note is not None and "threads: " in note


def _bench(folder: Path, x_nope: dict[str, float], seq_len: int = 32) -> Path:
    """A benchmark's record: one train step per column timed in turn, as ``python -m posenc.bench`` writes it."""
    rows = [
        {"scheme": label, "label": label, "seq_len": seq_len, "batch": 4, "parameters": 1000 + i, "repeats": 5,
         "step_ms": 10.0 / x, "tokens_per_s": 128 * x * 100, "x_nope": x}
        for i, (label, x) in enumerate(x_nope.items())
    ]  # fmt: skip
    environment = {"device": "cpu: a test CPU", "threads": 1, "torch": "2.13.0+cpu", "date": "2026-11-27 07:00 UTC"}
    folder.mkdir(parents=True)
    (folder / "bench.json").write_text(json.dumps({"environment": environment, "train_step": rows}))
    return folder


def test_a_side_by_side_benchmark_gives_the_cost_axis_and_no_conditions_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    busy = {"device": "cpu × 2", "threads": 2, "load_per_core": 1.9, "load_samples": 10}
    by_label = _sweep(tmp_path / "runs", {"scheme03": busy})
    measured = {label: 1.0 if label == "nope" else 0.5 + 0.01 * i for i, label in enumerate(CROWDED)}
    bench = find_bench([_bench(tmp_path / "bench", measured)])
    points, against = cost_points(by_label, bench)
    assert {p["label"]: p["throughput"] for p in points} == pytest.approx(measured)  # not the runs' own logs
    assert against.startswith("NoPE, one train step of each timed in turn")
    kept = {}
    monkeypatch.setattr(plt, "close", lambda fig: kept.setdefault("fig", fig))
    cost_plots({(32, "nonoverlap", None): by_label}, tmp_path / "out", bench)
    assert not any("conditions that differ" in text.get_text() for text in kept["fig"].texts)
    # Beside it, the runs' own throughput and load, so the table shows how far a busy run's log was off.
    table = cost_table(by_label, bench).splitlines()
    row = next(line for line in table if line.startswith("| scheme03 |"))
    assert row.split(" | ")[3] == f"{measured['scheme03']:.2f}" and row.endswith("| 1.90 |")
    assert "1 thread(s), torch 2.13.0+cpu" in "\n".join(table)


def test_a_benchmark_missing_a_column_leaves_the_axis_to_the_runs_logs(tmp_path: Path) -> None:
    by_label = _sweep(tmp_path / "runs")
    bench = find_bench([_bench(tmp_path / "bench", {"nope": 1.0, "scheme01": 0.5})])
    points, against = cost_points(by_label, bench)
    assert against == "NoPE"  # mixing a benchmark's ratios with logged ones would compare unlike with unlike
    assert {p["label"]: p["throughput"] for p in points}["scheme01"] == pytest.approx(997.0 / 1000.0)
    assert find_bench([tmp_path / "runs"]) == []
    # Every column measured, but at another length than the runs trained at: that step does not price them.
    longer = find_bench([_bench(tmp_path / "longer", dict.fromkeys(CROWDED, 0.9), seq_len=64)])
    assert cost_points(by_label, longer)[1] == "NoPE" and cost_table(by_label, longer) == ""
