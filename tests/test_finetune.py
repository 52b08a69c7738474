"""Fine-tuning from a run (``init_from``): what carries over, what is refused, and the lineage every record shows."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import FAST, compose_train

import posenc.training.loop
from posenc.api import load_run
from posenc.encodings.alibi import alibi_slopes
from posenc.report import build_report, find_results
from posenc.runs import RunError
from posenc.train import train

PARENT_STEPS = ["trainer.max_steps=10"]
CHILD_STEPS = ["trainer.max_steps=10"]


def run_json(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "run.json").read_text())


@pytest.fixture(scope="module")
def parents(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny parents (16 tokens, 10 steps): RoPE, ALiBi, and a learned table of 16 positions."""
    runs = {}
    for scheme in ("rope", "alibi", "learned"):
        runs[scheme] = tmp_path_factory.mktemp(f"parent-{scheme}")
        train(compose_train(f"+encoding={scheme}", *FAST, *PARENT_STEPS), runs[scheme])
    return runs


@pytest.fixture(scope="module")
def children(parents: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The fine-tuned runs: DroPE (RoPE → NoPE at 16), RoPE + YaRN at 4× (64 tokens), ALiBi → data-dependent ALiBi."""
    overrides = {
        "drope": ["+encoding=nope", f"init_from={parents['rope']}"],
        "yarn": [
            "+encoding=rope",
            f"init_from={parents['rope']}",
            "data.seq_len=64",
            "model.context_scaling={method:yarn,factor:4,original_length:16}",
        ],
        "alibi_dd": ["+encoding=alibi_dd", f"init_from={parents['alibi'] / 'checkpoints' / 'last.ckpt'}"],
    }
    runs = {}
    for name, extra in overrides.items():
        runs[name] = tmp_path_factory.mktemp(f"child-{name}")
        train(compose_train(*FAST, *CHILD_STEPS, *extra), runs[name])
    return runs


def _state(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_run(run_dir)[0].state_dict()


@pytest.mark.slow
def test_same_scheme_copies_every_weight_and_starts_a_fresh_run(parents: dict[str, Path], tmp_path: Path) -> None:
    # A learning rate too small to move a weight: what the child holds is what it copied.
    train(compose_train("+encoding=rope", *FAST, f"init_from={parents['rope']}", "optim.lr=1e-12"), tmp_path)
    parent, child = _state(parents["rope"]), _state(tmp_path)
    assert parent.keys() == child.keys()
    for name in parent:
        torch.testing.assert_close(child[name], parent[name], rtol=0, atol=1e-6, msg=name)
    summary = run_json(tmp_path)
    lineage = summary["lineage"]
    assert lineage["copied"] == sorted(parent) and lineage["fresh"] == [] and lineage["dropped"] == []
    assert lineage["changed"] == {} and lineage["parent_step"] == 10
    assert summary["steps"] == 3 and summary["resumed_from"] is None  # its own step count, not the parent's


@pytest.mark.slow
def test_drope_drops_rope_and_records_it(parents: dict[str, Path], children: dict[str, Path]) -> None:
    summary = run_json(children["drope"])
    lineage = summary["lineage"]
    assert summary["label"] == "nope"
    assert lineage["parent_run_dir"] == str(parents["rope"].resolve())
    assert lineage["parent_checkpoint"] == str(parents["rope"].resolve() / "checkpoints" / "last.ckpt")
    assert lineage["parent_scheme"] == "rope" and lineage["parent_seq_len"] == 16
    assert lineage["changed"] == {"scheme": {"from": "rope", "to": "nope"}}
    assert "blocks.0.attn.qkv.weight" in lineage["copied"] and lineage["fresh"] == lineage["dropped"] == []
    results = json.loads((children["drope"] / "eval" / "results.json").read_text())
    assert results["lineage"] == lineage  # the report reads it beside the figures


@pytest.mark.slow
def test_yarn_at_four_times_trains_with_the_scaling(parents: dict[str, Path], children: dict[str, Path]) -> None:
    summary = run_json(children["yarn"])
    assert summary["train_len"] == 64
    scaling = {"method": "yarn", "factor": 4, "original_length": 16}
    assert summary["lineage"]["changed"] == {
        "seq_len": {"from": 16, "to": 64},
        "context_scaling": {"from": None, "to": scaling},
    }
    model, config = load_run(children["yarn"])  # rebuilt from the checkpoint: with the scaling it trained with
    assert config["model"]["context_scaling"] == scaling
    plain = load_run(parents["rope"])[0].layer_encodings[0]
    for encoding in model.layer_encodings:
        assert encoding.scaling == ("yarn", 4.0) and encoding.attention_scale == pytest.approx(
            0.1 * torch.log(torch.tensor(4.0)).item() + 1
        )
        assert not torch.equal(encoding.inv_freq, plain.inv_freq)
    results = json.loads((children["yarn"] / "eval" / "results.json").read_text())
    assert [row["length"] for row in results["perplexity"]] == [64, 128, 256]  # by its own length: 1×, 2×, 4×


@pytest.mark.slow
def test_alibi_to_data_dependent_alibi_keeps_the_gates_fresh(
    parents: dict[str, Path], children: dict[str, Path]
) -> None:
    lineage = run_json(children["alibi_dd"])["lineage"]
    assert lineage["changed"]["scheme"] == {"from": "alibi", "to": "alibi_dd"}
    gates = {f"blocks.{i}.attn.encoding.{name}" for i in range(4) for name in ("gate_weight", "gate_bias")}
    assert set(lineage["fresh"]) == gates
    parent = _state(parents["alibi"])
    assert set(lineage["dropped"]) == {name for name in parent if ".encoding." in name}
    assert set(lineage["copied"]) == {name for name in parent if ".encoding." not in name}
    # The gates started as data-dependent ALiBi starts (σ(b) = e^(−m)), not from anything of the parent's.
    built = torch.load(children["alibi_dd"] / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]
    start = -torch.log(torch.expm1(torch.tensor(alibi_slopes(4), dtype=torch.float64))).float()
    assert built["model.blocks.0.attn.encoding.gate_bias"].sub(start).abs().max() < 0.1


@pytest.mark.slow
def test_lineage_reaches_wandb(parents: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def capture(cfg: dict, run_dir: Path, run_name: str, config: dict, tags: list[str], *args: Any) -> list:
        seen.update(config=config, tags=tags)
        return []

    monkeypatch.setattr(posenc.training.loop, "build_loggers", capture)
    train(compose_train("+encoding=nope", *FAST, f"init_from={parents['rope']}"), tmp_path)
    assert seen["config"]["lineage"] == run_json(tmp_path)["lineage"]
    assert {"finetuned", "from:rope", "changed:scheme", "parent:rope-L16-s0"} <= set(seen["tags"])


@pytest.mark.slow
def test_report_places_each_child_beside_its_parent(
    parents: dict[str, Path], children: dict[str, Path], tmp_path: Path
) -> None:
    # The parent's results are found through the lineage even when the report is not given its directory.
    markdown = build_report(find_results(children.values()), tmp_path, make_plots=False)
    section = markdown.split("## Fine-tuned runs", 1)[1].split("\n## ", 1)[0]
    assert section.count("(parent)") == 2  # RoPE's two children share one table; ALiBi's child has its own
    for run in children.values():
        assert run_json(run)["run_name"] in section
    assert "rope → nope" in section and "seq_len 16 → 64" in section and "yarn×4 from 16" in section
    assert "alibi → alibi_dd" in section and "8 fresh" in section


REFUSALS = [
    ("heads", ["+encoding=rope", "model.heads=2"], "the parent has model.heads=4 but this run asks for model.heads=2"),
    ("width", ["+encoding=rope", "model.dim=64", "model.heads=2"], "the parent has model.dim=128, model.heads=4"),
    ("learned past its table", ["+encoding=learned", "data.seq_len=64"], "table holds 16 positions and this run's 64"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "overrides", "message"), REFUSALS, ids=[row[0] for row in REFUSALS])
def test_refuses_what_cannot_carry_over(
    name: str, overrides: list[str], message: str, parents: dict[str, Path], tmp_path: Path
) -> None:
    parent = parents["learned" if "learned" in name else "rope"]
    with pytest.raises(RunError, match=re.escape(message)):
        train(compose_train(*FAST, *overrides, f"init_from={parent}"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_refuses_a_parent_that_is_not_there(tmp_path: Path) -> None:
    (tmp_path / "empty-run").mkdir()
    (tmp_path / "truncated.ckpt").write_bytes(b"PK\x03\x04 not a whole checkpoint")
    for target, message in (
        (tmp_path / "nowhere", "is neither a run directory nor a checkpoint file"),
        (tmp_path / "empty-run", "no checkpoint at"),
        (tmp_path / "truncated.ckpt", "cannot be read as a checkpoint"),
    ):
        with pytest.raises(RunError, match=message):
            train(compose_train("+encoding=rope", *FAST, f"init_from={target}"), tmp_path / "run")
        assert not (tmp_path / "run").exists()


def test_training_time_scaling_needs_a_scheme_that_stretches(tmp_path: Path) -> None:
    scaling = "model.context_scaling={method:pi,factor:4,original_length:16}"
    with pytest.raises(RunError, match="needs a scheme that can be stretched"):
        train(compose_train("+encoding=alibi", *FAST, scaling), tmp_path / "run")
    with pytest.raises(RunError, match="drop eval\\.rope_scaling"):
        train(
            compose_train("+encoding=rope", *FAST, scaling, "eval.rope_scaling=yarn", "eval.rope_scaling_factor=2"),
            tmp_path / "run",
        )
    assert not (tmp_path / "run").exists()


def test_report_reads_the_lineage_of_a_re_evaluated_run_from_its_run_json(tmp_path: Path) -> None:
    from posenc.report.finetuned import finetuned_tables

    def write(path: Path, data: dict) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data))
        return path

    def result(run_name: str, label: str, train_len: int, ppl: dict[int, float]) -> dict:
        rows = [{"length": length, "ppl": value} for length, value in ppl.items()]
        return {"run_name": run_name, "label": label, "train_len": train_len, "perplexity": rows}

    parent, child = tmp_path / "parent", tmp_path / "child"
    write(parent / "eval" / "results.json", result("rope-L64-s0", "rope", 64, {64: 10.0, 256: 90.0}))
    lineage = {
        "parent_run_dir": str(parent),
        "parent_run_name": "rope-L64-s0",
        "parent_scheme": "rope",
        "parent_seq_len": 64,
        "parent_step": 600,
        "changed": {
            "seq_len": {"from": 64, "to": 256},
            "context_scaling": {"from": None, "to": {"method": "pi", "factor": 4, "original_length": 64}},
        },
        "copied": ["a", "b"],
        "fresh": [],
        "dropped": ["c"],
    }
    write(child / "run.json", {"lineage": lineage})
    # A re-evaluation (python -m posenc.evaluate) writes results without the lineage; run.json still has it.
    source = write(child / "eval" / "results.json", result("rope-L256-s0", "rope", 256, {256: 11.0, 1024: 12.5}))
    text = finetuned_tables([{**json.loads(source.read_text()), "_source": str(source)}])
    rows = [line for line in text.splitlines() if line.startswith("| rope")]
    assert rows[0].startswith("| rope-L64-s0 (parent) | 64 | ? | — | — | 10.00 | 90.00 |  |")
    assert rows[1] == (
        "| rope-L256-s0 (rope) | 256 | ? | seq_len 64 → 256; training scaling none → pi×4 from 64 | "
        "2 copied, 0 fresh, 1 dropped |  | 11.00 | 12.50 |"
    )
    assert "from rope-L64-s0 (rope at 64 tokens, step 600)" in text
