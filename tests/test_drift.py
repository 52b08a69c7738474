"""Positional parameters watched: how far each scheme tensor moved, what the bias became, and the report's marks."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
from helpers import FAST, compose_train

from posenc.encodings import available, build
from posenc.encodings.base import PositionalEncoding
from posenc.evaluate.bias_curve import bias_by_distance, bias_function, sampled_distances
from posenc.evaluate.drift import (
    BARELY_MOVED,
    RMS_FLOOR,
    drift_record,
    from_checkpoint,
    relative_change,
    short_name,
)
from posenc.model import Decoder
from posenc.report import build_report, find_results
from posenc.report.drift import drift_groups
from posenc.report.study import keep_records
from posenc.runs import load_checkpoint, load_module
from posenc.train import train


def test_relative_change_is_against_the_initial_size_with_a_floor_at_zero() -> None:
    start = torch.tensor([3.0, 4.0])  # norm 5
    assert relative_change(torch.tensor([3.0, 5.0]), start) == pytest.approx(1 / 5)
    zeros = torch.zeros(4)
    moved = torch.tensor([0.01, 0.0, 0.0, 0.0])
    assert relative_change(moved, zeros) == pytest.approx(0.01 / (RMS_FLOOR * 2))


def test_the_record_marks_still_moving_and_barely_moved_by_speed_per_unit_of_learning_rate() -> None:
    initial = {"a": torch.ones(4), "b": torch.ones(4)}  # norm 2 each
    final = {"a": torch.full((4,), 1.5), "b": torch.ones(4)}
    settled = drift_record(final, initial, {**final}, 9, lr_spent=(1.0, 0.9))
    assert settled["max_total_change"] == pytest.approx(0.5) and settled["max_late_change"] == 0
    assert not settled["still_moving"] and not settled["barely_moved"] and settled["late_from_step"] == 9
    # All of the change in the last tenth of the learning rate spent: 10× the average speed.
    moving = drift_record(final, initial, {**initial}, 9, lr_spent=(1.0, 0.9))
    assert moving["still_moving"] and moving["late_speed_ratio"] == pytest.approx(10.0)
    # The same share of the change over the same share of the rate reads the same whatever the step count.
    halfway = {"a": torch.full((4,), 1.45), "b": torch.ones(4)}  # 0.05 of 0.5 in the last tenth: the average speed
    short = drift_record(final, initial, halfway, 9, lr_spent=(0.3, 0.27))
    long = drift_record(final, initial, halfway, 1999, lr_spent=(12.0, 10.8))
    assert short["late_speed_ratio"] == pytest.approx(long["late_speed_ratio"]) == pytest.approx(1.0)
    assert short["still_moving"] and long["still_moving"]
    small = 1 + BARELY_MOVED / 4
    still = drift_record({"a": torch.full((4,), small), "b": torch.ones(4)}, initial, None, None)
    assert still["barely_moved"] and still["max_late_change"] is None and not still["still_moving"]
    assert drift_record({}, {}, None, None) is None


def test_the_marks_read_the_bias_function_so_a_row_constant_moves_nothing() -> None:
    """FIRE's output bias adds one constant to every score of a row: attention cannot see it, nor can the marks."""
    torch.manual_seed(0)
    fire = build("fire", num_heads=2, head_dim=8, init_threshold=16)
    start, tensors = bias_function(fire, 64), {"out.bias": fire.out.bias.detach().clone()}
    with torch.no_grad():
        fire.out.bias += 3.0
    assert torch.allclose(bias_function(fire, 64), start, atol=1e-5)
    record = drift_record(
        {"out.bias": fire.out.bias.detach().clone()}, tensors, None, None, functions=({"f": start}, {"f": start}, None)
    )
    assert record["measured_on"] == "bias function" and record["barely_moved"]
    assert record["tensors"][0]["total_change"] > 1  # the tensor moved a lot; the function did not
    with torch.no_grad():
        fire.hidden.weight.mul_(-2.0)  # a change of shape, which attention does see
    assert not torch.allclose(bias_function(fire, 64), start, atol=1e-3)


def test_scheme_parameters_are_found_by_structure() -> None:
    for name in available():
        model = Decoder(name, vocab_size=32, dim=32, depth=2, heads=4)
        found = model.scheme_parameters()
        owned = {id(p) for m in model.modules() if isinstance(m, PositionalEncoding) for p in m.parameters()}
        assert {id(p) for p in found.values()} == {id(p) for p in model.parameters() if id(p) in owned}, name
        assert all(p.requires_grad for p in found.values())
    assert Decoder("alibi", vocab_size=32, dim=32, depth=2).scheme_parameters() == {}
    names = [short_name(n) for n in Decoder("kerple_log", vocab_size=32, dim=32, depth=2).scheme_parameters()]
    assert names == ["layer0.r1", "layer0.r2", "layer1.r1", "layer1.r2"]


@pytest.mark.parametrize("name", available())
def test_every_scheme_with_a_bias_gives_its_curve_through_the_contract(name: str) -> None:
    scheme = build(name, num_heads=4, head_dim=8)
    curve = bias_by_distance(scheme, 200)
    if not (scheme.adds_bias or scheme.adds_content_bias):
        assert curve is None
        return
    assert curve["distances"] == sampled_distances(200) and curve["query_position"] == 200
    assert len(curve["by_head"]) == 4 and all(len(h) == len(curve["distances"]) for h in curve["by_head"])
    assert all(math.isfinite(v) for head in curve["by_head"] for v in head)
    if scheme.adds_bias and not scheme.adds_content_bias:  # the dense reference's last row, at those distances
        positions = torch.arange(201)
        dense = scheme.bias(positions, positions)[:, 200, 200 - torch.tensor(curve["distances"])]
        torch.testing.assert_close(torch.tensor(curve["by_head"]), dense.float())


def test_data_dependent_alibi_reads_as_alibi_at_zero_content_when_untrained() -> None:
    # Its gates start at ALiBi's slopes (σ(b) = e^-m) with zero weights: the curve is ALiBi's.
    dd, alibi = (
        bias_by_distance(build("alibi_dd", num_heads=4, head_dim=8), 100),
        build("alibi", num_heads=4, head_dim=8),
    )
    expected = alibi.distance_bias(101)[:, dd["distances"]]
    torch.testing.assert_close(torch.tensor(dd["by_head"]), expected, atol=1e-4, rtol=1e-4)


def test_sampled_distances_are_exact_near_and_log_spaced_far() -> None:
    assert sampled_distances(5) == [0, 1, 2, 3, 4, 5]
    far = sampled_distances(2047)
    assert far[:16] == list(range(16)) and far[-1] == 2047 and len(far) < 120


def test_a_run_records_drift_everywhere_and_evaluation_rebuilds_it(tmp_path: Path, capsys) -> None:
    overrides = [o for o in FAST if not o.startswith(("logger", "trainer.max_steps"))]
    overrides += ["logger=csv", "trainer.log_every_n_steps=1", "trainer.max_steps=10", "optim.warmup_steps=2"]
    overrides.append("optim.scheme_lr_multiplier=5")
    summary = train(compose_train("+encoding=t5", *overrides), tmp_path)
    record = summary["positional_drift"]
    assert [row["name"] for row in record["tensors"]] == [f"layer{i}.table" for i in range(4)]
    assert [row["name"] for row in record["function"]] == [f"layer{i}" for i in range(4)]
    assert record["measured_on"] == "bias function" and record["late_speed_ratio"] > 0
    assert record["late_from_step"] == 9 and record["max_total_change"] > record["max_late_change"] > 0
    assert "Positional parameters of t5" in capsys.readouterr().out
    run = json.loads((tmp_path / "run.json").read_text())
    saved = run["positional_drift"]
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert run["scheme_lr_multiplier"] == 5 and results["config"]["optim"]["scheme_lr_multiplier"] == 5
    assert saved == results["positional_drift"] == json.loads(json.dumps(record))
    assert results["summary"]["drift/max_total_change"] == pytest.approx(record["max_total_change"])
    assert results["learned_bias"]["query_position"] == 16 * 4 - 1
    with (tmp_path / "csv" / "metrics.csv").open() as handle:
        logged = [row for row in csv.DictReader(handle) if row.get("drift/max")]
    assert [int(row["step"]) for row in logged] == list(range(10))  # one row per step (Lightning counts from 0)
    assert float(logged[-1]["drift/layer0.table"]) > 0
    # The curve in the record is the logged one, step for step (the record counts the steps done).
    assert [step for step, _ in record["curve"]] == list(range(1, 11))
    assert [value for _, value in record["curve"]] == pytest.approx([float(row["drift/max"]) for row in logged])
    checkpoint = tmp_path / "checkpoints" / "last.ckpt"
    module, _ = load_module(checkpoint, "cpu", None)
    rebuilt = from_checkpoint(load_checkpoint(checkpoint, mmap=True)["callbacks"], module.model)
    assert rebuilt["tensors"] == record["tensors"] and rebuilt["late_from_step"] == 9
    assert len(rebuilt["function"]) == len(record["function"])
    for again, first in zip(rebuilt["function"], record["function"], strict=True):  # per layer, to float precision
        assert {k: v for k, v in again.items() if not isinstance(v, float)} == {
            k: v for k, v in first.items() if not isinstance(v, float)
        }
        assert {k: v for k, v in again.items() if isinstance(v, float)} == pytest.approx(
            {k: v for k, v in first.items() if isinstance(v, float)}
        )
    assert rebuilt["late_speed_ratio"] == pytest.approx(record["late_speed_ratio"])
    assert rebuilt["curve"] == record["curve"]


def _drift_result(root: Path, label: str, seed: int, total: float | None, late: float | None) -> None:
    folder = root / f"{label}_{seed}" / "eval"
    folder.mkdir(parents=True)
    drift = (
        None
        if total is None
        else {
            "tensors": [],
            "late_from_step": 90,
            "max_total_change": total,
            "max_late_change": late,
            "still_moving": late > 0.05,  # an older record's rule: its own mark is what the report reads
            "barely_moved": total < BARELY_MOVED,
        }
    )
    curve = {
        "distances": [0, 1, 2, 63],
        "query_position": 63,
        "source": "distance_bias",
        "by_head": [[0, -1, -2, -63]] * 2,
    }
    result = {
        "label": label,
        "train_len": 16,
        "seed": seed,
        "eval": {},
        "positional_drift": drift,
        "learned_bias": curve,
    }
    (folder / "results.json").write_text(json.dumps(result))


def test_the_report_marks_learnable_schemes_and_draws_their_bias(tmp_path: Path) -> None:
    for seed in (0, 1):
        _drift_result(tmp_path, "alibi", seed, None, None)
        _drift_result(tmp_path, "t5", seed, 0.02 + seed / 100, 0.001)  # barely moved
        _drift_result(tmp_path, "kerple_log", seed, 0.8, 0.2 if seed else 0.01)  # one seed still moving
        _drift_result(tmp_path, "fire", seed, 0.9, 0.01)  # settled
    markdown = build_report(find_results([tmp_path]), tmp_path / "report")
    section = markdown.split("## Positional parameters, trained at L=16")[1].split("\n## ")[0]
    table = [line for line in section.splitlines() if line.startswith("| ")]
    header = [cell.split(" (")[0].strip() for cell in table[0].split("|")[2:-1]]
    assert header == ["alibi", "fire", "kerple_log‡", "t5‡"]  # under-trained, marked wherever the column stands
    header = [name.rstrip("‡") for name in header]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table[1:]}
    marks = dict(zip(header, rows["mark"], strict=True))
    assert marks == {"alibi": "fixed", "kerple_log": "**still moving**", "fire": "settled", "t5": "**barely moved**"}
    assert dict(zip(header, rows["seeds still moving"], strict=True))["kerple_log"] == "1/2"
    assert dict(zip(header, rows["largest total change"], strict=True))["t5"].startswith("0.0250 ±")
    assert "## First-layer bias by distance, trained at L=16" in markdown
    figure = tmp_path / "report" / "learned_bias_L16.png"
    assert figure.is_file() and not list((tmp_path / "report").glob(".*partial*"))


def test_a_run_evaluated_under_several_protocols_is_one_column_of_drift(tmp_path: Path) -> None:
    _drift_result(tmp_path, "t5", 0, 0.5, 0.01)
    nonoverlap = json.loads((tmp_path / "t5_0" / "eval" / "results.json").read_text())
    sliding = tmp_path / "t5_0" / "eval_sliding_f0.5"
    sliding.mkdir()
    (sliding / "results.json").write_text(
        json.dumps({**nonoverlap, "eval": {"mode": "sliding", "stride_fraction": 0.5}})
    )
    (by_label,) = drift_groups(find_results([tmp_path]), "positional_drift").values()
    assert list(by_label) == ["t5"] and len(by_label["t5"]) == 1
    assert Path(by_label["t5"][0]["_source"]).parent.name == "eval"


def test_the_report_tables_the_drift_curve_and_reads_an_older_runs_curve_from_its_log(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    for seed in (0, 1):
        _drift_result(runs, "alibi", seed, None, None)
        _drift_result(runs, "t5", seed, 0.5, 0.01)
    # Seed 0 records its curve; seed 1 predates that and logged it only as drift/max in its CSV (steps from 0).
    results_file = runs / "t5_0" / "eval" / "results.json"
    result = json.loads(results_file.read_text())
    result["positional_drift"]["curve"] = [[10 * (i + 1), 0.1 * (i + 1)] for i in range(10)]
    results_file.write_text(json.dumps(result))
    (runs / "t5_1" / "csv").mkdir()
    lines = ["step,drift/max,train/loss"] + [f"{10 * i + 9},{0.2 * (i + 1)},1.0" for i in range(10)] + ["99,,0.9"]
    (runs / "t5_1" / "csv" / "metrics.csv").write_text("\n".join(lines) + "\n")

    markdown = build_report(find_results([runs]), tmp_path / "report")
    section = markdown.split("## Positional parameters by step, trained at L=16")[1].split("\n## ")[0]
    table = [line for line in section.splitlines() if line.startswith("| ")]
    assert [cell.split(" (")[0].strip() for cell in table[0].split("|")[2:-1]] == ["t5"]  # fixed schemes: no curve
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in table[1:]}
    assert list(rows) == ["10%", "25%", "50%", "75%", "90%", "100%"]
    assert rows["50%"].startswith("0.7500 ±") and rows["100%"].startswith("1.5000 ±")  # (0.5 + 1.0) / 2, (1 + 2) / 2
    assert (tmp_path / "report" / "drift_curve_L16.png").is_file()

    # A study keeps the older run's log beside its records, so the table regenerates from them.
    keep_records(find_results([runs]), tmp_path / "kept")
    assert (tmp_path / "kept" / "t5_1" / "csv" / "metrics.csv").is_file()
    assert not (tmp_path / "kept" / "t5_0" / "csv").exists()
    again = build_report(find_results([tmp_path / "kept"]), tmp_path / "again", make_plots=False)
    assert again.split("## Positional parameters by step, trained at L=16")[1].split("\n## ")[0].replace(
        str(tmp_path / "kept"), ""
    ) == section.replace(str(runs), "")


def test_a_column_that_had_not_settled_is_marked_in_every_table_and_comparison(tmp_path: Path) -> None:
    # A scheme still moving at the end of training is under-trained at that budget, not worse: each table that
    # shows it, the comparisons fixed in advance included, says so beside its name and says in how many seeds.
    for seed in (0, 1, 2):
        _drift_result(tmp_path, "alibi", seed, None, None)
        _drift_result(tmp_path, "nope", seed, None, None)
        _drift_result(tmp_path, "t5", seed, 0.8, 0.2 if seed else 0.01)
        _drift_result(tmp_path, "fire", seed, 0.9, 0.01)
    for path in tmp_path.rglob("results.json"):
        result = json.loads(path.read_text())
        seed, base = result["seed"], {"alibi": 5.0, "nope": 6.0, "t5": 4.0, "fire": 4.5}[result["label"]]
        result["eval"] = {"mode": "nonoverlap", "stride": None, "multiples": [1, 2]}
        result["perplexity"] = [
            {"length": 16 * m, "mode": "nonoverlap", "stride": None, "tokens": 512, "loss": math.log(ppl), "ppl": ppl,
             "bpb": 1.0, "error": None, "multiple": m, "ratio": ppl / base}
            for m, ppl in ((1, base + seed / 10), (2, base * 1.1 + seed / 10))
        ]  # fmt: skip
        path.write_text(json.dumps(result))
    markdown = build_report(find_results([tmp_path]), tmp_path / "report", make_plots=False)
    perplexity = markdown.split("## Trained at L=16")[1].split("\n## ")[0]
    head = next(line for line in perplexity.splitlines() if line.startswith("| length"))
    assert "t5‡ (n=3" in head and "fire (n=3" in head and "alibi (n=3" in head
    assert "t5: still moving in 2 of 3 seeds" in perplexity and "fire: still moving" not in perplexity
    preset = markdown.split("## Comparisons fixed in advance")[1]
    heads = [line for line in preset.splitlines() if line.startswith("| length")]
    assert heads and all("t5‡" in line and "fire‡" not in line for line in heads if "t5" in line)
    assert "under-trained at this budget" in preset and "t5: still moving in 2 of 3 seeds" in preset
