"""Results as documents that regenerate: every table in docs/results/ is one the report writes from the runs'
records kept beside it, and writing the document again from those records gives the same tables."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest

from posenc.jsonio import read_record
from posenc.report import find_results
from posenc.report.study import BEGIN, END, TRANSCRIBED, generated_block, keep_records, write_study

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
DOCUMENTS = sorted(RESULTS.glob("*.md"))


def _run(root: Path, label: str, seed: int, ppl: tuple[float, float], speed: float) -> None:
    folder = root / f"{label}-L32-s{seed}"
    rows = [
        {"length": 32 * m, "mode": "nonoverlap", "stride": None, "tokens": 2048, "loss": math.log(p), "ppl": p,
         "bpb": 1.0, "error": None, "multiple": m, "ratio": p / ppl[0]}
        for m, p in zip((1, 2), ppl, strict=True)
    ]  # fmt: skip
    result = {"label": label, "train_len": 32, "seed": seed, "perplexity": rows, "loss_by_position": {}}
    result |= {"eval": {"mode": "nonoverlap", "stride": None, "multiples": [1, 2]}, "run_name": folder.name}
    result["training"] = {"steps": 10, "max_steps": 10, "finished": True}
    (folder / "eval").mkdir(parents=True)
    (folder / "eval" / "results.json").write_text(json.dumps(result))
    conditions = {"device": "cpu × 2", "torch": "2.13.0+cpu", "threads": 2, "load_per_core": 0.9}
    record = {"steps": 10, "tokens": 10 * speed, "train_seconds": 60.0, "tokens_per_sec": speed}
    (folder / "run.json").write_text(json.dumps(record | {"train_conditions": conditions}))
    done = {
        "run_name": folder.name,
        "finished_at": f"2026-11-26T10:0{seed}:00+0000",
        "steps": 10,
        "config": {"seed": seed},
    }
    (folder / "done.json").write_text(json.dumps(done))
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / "last.ckpt").write_bytes(b"weights")


def _sweep(root: Path) -> Path:
    for label, speed in (("nope", 1000.0), ("alibi", 900.0)):
        for seed in range(2):
            _run(root, label, seed, (10.0 + seed, 11.0 + 2 * seed if label == "nope" else 10.5 + seed), speed)
    return root


def test_a_study_document_regenerates_from_the_records_kept_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    sweep = _sweep(Path("outputs/sweeps/repro"))
    out = Path("docs/results/reproduction.md")
    out.parent.mkdir(parents=True)
    first = write_study("reproduction", [str(sweep)], out, make_plots=False)
    assert first.startswith("# Reproduction: which scheme extrapolates\n")
    assert "python -m posenc.train -m -cd sweeps -cn repro" in first
    assert (
        "| 4 (4) | 2 | cpu × 2 | 2.13.0+cpu | 2 min (4 min) | 2026-11-26 |" in first
    )  # runs, n, machine, torch, times
    records = Path("docs/results/reproduction/runs")
    kept = sorted(p.relative_to(records).as_posix() for p in records.rglob("*") if p.is_file())
    assert "alibi-L32-s0/eval/results.json.gz" in kept and "alibi-L32-s0/run.json.gz" in kept  # kept compressed
    assert not any(name.endswith(".ckpt") for name in kept)  # records only, never weights
    assert "config" not in read_record(records / "alibi-L32-s0" / "done.json")  # kept once, in the results
    # Hand-written reading after the block survives; the block regenerates from the kept records alone.
    out.write_text(out.read_text() + "\n## Reading\n\nA claim naming its table.\n")
    shutil.rmtree("outputs")
    second = write_study("reproduction", [str(records)], out, make_plots=False)
    assert generated_block(second) == generated_block(first)
    assert "| 32 | 1 |" in generated_block(second)  # the report's perplexity table is in the block
    assert out.read_text().endswith("## Reading\n\nA claim naming its table.\n")


def test_an_unknown_study_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown study 'nosuch': choose from reproduction"):
        write_study("nosuch", [str(_sweep(tmp_path / "runs"))], tmp_path / "x.md")


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_results_document_is_written_by_the_report(
    document: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = document.read_text()
    if BEGIN not in text:
        # Not yet run again on this code: it must say so at its top, before any table.
        assert TRANSCRIBED in text.split("\n|", 1)[0], f"{document.name}: neither generated nor marked transcribed"
        pytest.skip(f"{document.name}: transcribed from runs not kept here, not yet regenerated")
    assert END in text, f"{document.name} opens a generated block and never closes it"
    header = text.split(BEGIN, 1)[0]
    tables = [line for line in header.splitlines() if line.startswith("|")]
    assert len(tables) == 3 and tables[0].startswith("| runs (results) |"), "only the runs' own record above the block"
    after = text.split(END, 1)[1]
    assert not any(line.startswith("|") for line in after.splitlines()), "a table typed by hand after the block"
    name = document.stem
    # The records its last regenerating command reads: its own beside it, or other studies' kept records.
    command = [line for line in header.splitlines() if line.startswith("python -m posenc.report ")][-1]
    sources = _shell_words(command.split(" --study ")[0].removeprefix("python -m posenc.report "))
    for source in sources:
        folder = Path(source) if source.endswith("/runs") else Path(source).parent
        assert (ROOT / source).is_dir() and folder.name == "runs", f"{document.name}: {source} is not kept"
    # Written again from those records, in a copy of the repository's layout, the block comes out the same.
    monkeypatch.chdir(tmp_path)
    for source in sources:
        folder = Path(source) if source.endswith("/runs") else Path(source).parent
        shutil.copytree(ROOT / source, source)
        shutil.copyfile(ROOT / folder.parent.with_suffix(".md"), folder.parent.with_suffix(".md"))
    shutil.copyfile(document, Path("docs/results") / document.name)
    again = write_study(name, sources, Path("docs/results") / document.name)
    assert generated_block(again) == generated_block(text)


def test_a_study_of_other_studies_reads_their_kept_records_and_keeps_none_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for study in ("comparison", "comparison-2400"):
        sweep = _sweep(Path("outputs") / study)
        write_study(study, [str(sweep)], Path(f"docs/results/{study}.md"), make_plots=False)
    shutil.rmtree("outputs")
    sources = ["docs/results/comparison/runs", "docs/results/comparison-2400/runs"]
    out = Path("docs/results/comparison-budgets.md")
    first = write_study("comparison-budgets", sources, out, make_plots=False)
    assert not Path("docs/results/comparison-budgets").exists()  # nothing copied, no empty folder left
    assert f"python -m posenc.report {' '.join(sources)} --study comparison-budgets --out {out}" in first
    assert "keeps no records of its own" in first


def _shell_words(words: str) -> list[str]:
    """``words`` as bash expands them (braces, globs) in the repository's root."""
    done = subprocess.run(["bash", "-c", f"printf '%s\\n' {words}"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.split()


def test_a_study_keeps_its_own_runs_and_reads_another_studys_baselines_where_they_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    write_study("comparison", [str(_sweep(Path("outputs/comparison")))], Path("docs/results/comparison.md"))
    fresh = Path("outputs/sensitivity")
    for seed in range(2):
        _run(fresh, "rope", seed, (10.0 + seed, 12.0 + seed), 950.0)
    baselines = [f"docs/results/comparison/runs/alibi-L32-s{seed}" for seed in range(2)]
    out = Path("docs/results/sensitivity.md")
    first = write_study("sensitivity", [str(fresh), *baselines], out, make_plots=False)
    kept = sorted(p.name for p in Path("docs/results/sensitivity/runs").iterdir())
    assert kept == ["rope-L32-s0", "rope-L32-s1"]  # the baselines stay where the comparison keeps them
    command = (
        "python -m posenc.report docs/results/sensitivity/runs "
        f"docs/results/comparison/runs/{{alibi-L32-s0,alibi-L32-s1}} --study sensitivity --out {out}"
    )
    assert command in first and "alibi (n=2" in first and "rope (n=2" in first
    shutil.rmtree("outputs")
    again = write_study("sensitivity", ["docs/results/sensitivity/runs", *baselines], out, make_plots=False)
    assert generated_block(again) == generated_block(first) and command in again


def test_runs_of_one_name_from_two_sweeps_keep_records_of_their_own(tmp_path: Path) -> None:
    for sweep, ppl in (("gpt2_init", 6.0), ("pytorch_init", 5.0)):
        run = tmp_path / sweep / "alibi-L64-s0"
        (run / "eval").mkdir(parents=True)
        result = {"label": "alibi", "train_len": 64, "seed": 0, "perplexity": [], "ppl": ppl}
        (run / "eval" / "results.json").write_text(json.dumps(result))
    records = tmp_path / "kept"
    keep_records(find_results([tmp_path / "gpt2_init", tmp_path / "pytorch_init"]), records)
    kept = {path.parent.parent.name: read_record(path)["ppl"] for path in records.rglob("results.json*")}
    assert kept == {"gpt2_init--alibi-L64-s0": 6.0, "pytorch_init--alibi-L64-s0": 5.0}


def test_the_cost_study_keeps_the_benchmark_beside_the_runs_and_regenerates_from_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    sweep = _sweep(Path("outputs/sweeps/repro"))
    rows = [
        {"scheme": label, "label": label, "seq_len": 32, "batch": 4, "parameters": 100, "repeats": 3,
         "step_ms": ms, "tokens_per_s": 128e3 / ms, "x_nope": 10.0 / ms}
        for label, ms in (("nope", 10.0), ("alibi", 12.5))
    ]  # fmt: skip
    bench = Path("outputs/bench/cost")
    bench.mkdir(parents=True)
    (bench / "bench.json").write_text(json.dumps({"environment": {"device": "cpu: test"}, "train_step": rows}))
    out = Path("docs/results/cost.md")
    out.parent.mkdir(parents=True)
    first = write_study("cost", [str(sweep), str(bench)], out, make_plots=False)
    block = generated_block(first)
    assert "## Training cost, measured side by side" in block
    assert "| alibi | 100 | 12.5 | 0.80 | 900 | 0.90 | 0.90 |" in block  # side by side, then the runs' logs
    assert "python -m posenc.bench model=tiny train_step.seq_len=64" in first
    assert "| 32 | 1 |" not in block  # the cost study leaves the perplexity tables to the reproduction
    kept = Path("docs/results/cost/runs/bench-0/bench.json")
    assert json.loads(kept.read_text())["train_step"] == rows
    shutil.rmtree("outputs")
    again = write_study("cost", ["docs/results/cost/runs"], out, make_plots=False)
    assert generated_block(again) == block


def test_the_results_folder_stays_small_enough_for_a_quick_clone() -> None:
    # Only what each study's report reads is kept, compressed: every study together under 20 MB.
    size = sum(path.stat().st_size for path in RESULTS.rglob("*") if path.is_file())
    assert size < 20_000_000, f"docs/results/ holds {size / 1e6:.1f} MB: keep only what the reports read, compressed"
