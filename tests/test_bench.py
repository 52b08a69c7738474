"""``posenc.bench`` runs at a tiny size on CPU and writes what it measured, honestly labelled."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch.profiler import ProfilerActivity, profile

from posenc.bench import compare as bench_compare
from posenc.bench.attention import attention_call, fastest, record_failure, reference_backends
from posenc.bench.run import markdown, run
from posenc.bench.step import interleaved_steps_ms
from posenc.config import CONF_DIR
from posenc.encodings import build
from posenc.gpu import plan

TINY = [
    "device=cpu",
    "warmup=1",
    "repeats=2",
    "attention.heads=2",
    "attention.head_dim=8",
    "attention.tokens=64",
    "attention.lengths=[32,64]",
    "attention.schemes=[alibi,t5,learned]",
    "attention.backends=[sdpa,flex_learnable,auto]",
    "model=tiny",
    "model.depth=1",
    "train_step.schemes=[nope,alibi,t5]",
    "train_step.seq_len=16",
    "train_step.batch_size=2",
    "long_context.length=128",
]


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="bench", overrides=[*TINY, *overrides])


def test_bench_writes_json_and_markdown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = run(_compose(), tmp_path)
    saved = json.loads((tmp_path / "bench.json").read_text())
    # One progress line per case, printed as it finished (a long GPU run shows where it is).
    printed = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("attention") for line in printed) == len(saved["attention"])
    assert sum(line.startswith("long context") for line in printed) == len(saved["long_context"])
    assert any(line.startswith("train step") and " t5 " in line and "× NoPE" in line for line in printed)
    assert any(" t5 " in line and "flex_learnable" in line and "× best" in line for line in printed)
    assert saved["environment"]["device"].startswith("cpu") and saved["environment"]["torch"]
    assert (tmp_path / "bench.md").read_text() == markdown(results)

    rows = {(r["length"], r["scheme"], r["backend"]): r for r in saved["attention"]}
    winners = {w["length"]: w for w in saved["reference"]}
    for length in (32, 64):
        # NoPE through every unbiased kernel the CPU has; the fastest per mode is every ratio's denominator.
        references = [rows[length, "nope", backend] for backend in ("sdpa", "sdpa:flash")]
        for mode in ("forward", "train"):
            best = min((r for r in references if f"{mode}_ms" in r), key=lambda r: r[f"{mode}_ms"])
            assert winners[length][mode] == best["backend"] and best[f"{mode}_x_best"] == 1.0
            assert all(r[f"{mode}_x_best"] >= 1.0 for r in references if f"{mode}_ms" in r)
            t5 = rows[length, "t5", "sdpa"]
            assert t5[f"{mode}_x_best"] == pytest.approx(t5[f"{mode}_ms"] / best[f"{mode}_ms"])
        assert (length, "nope", "flex") not in rows  # uncompiled and forward-only on CPU: no reference there
        assert any(line.startswith(f"fastest unbiased attention  L={length} ") for line in printed)
        flash = rows[length, "nope", "sdpa"]
        assert flash["batch"] * length == 64 and flash["train_tokens_per_s"] > 0
        assert flash["train_peak_mib"] is None  # not measured on CPU, and said so
        # flex_learnable only where a bias is learnable; auto names what it resolved to.
        assert (length, "alibi", "flex_learnable") not in rows
        assert rows[length, "t5", "flex_learnable"]["train_x_best"] > 0
        assert rows[length, "t5", "auto"]["resolved"] == "sdpa"
    names = f"fwd {winners[32]['forward']}, fwd+bwd {winners[32]['train']}."
    assert names in (tmp_path / "bench.md").read_text()  # the table says what its ratios are divided by
    step = {r["scheme"]: r for r in saved["train_step"]}
    assert step["nope"]["x_nope"] == 1.0 and step["t5"]["tokens_per_s"] > 0
    long = {r["scheme"] for r in saved["long_context"]}
    assert long == {"alibi", "t5"}  # relative schemes only: not learned
    assert all("forward_ms" in r for r in saved["long_context"])


def test_the_kernels_part_times_the_fused_kernel_beside_the_blocked_form(tmp_path: Path) -> None:
    # The GPU plan's kernels part at a tiny size: each scheme with a fused kernel of its own attention through triton
    # (here Triton's interpreter) and through auto (its blocked form), beside the unbiased references.
    schemes = plan.kernel_schemes()
    cfg = _compose(
        "attention.lengths=[32]", "attention.head_dim=16", f"attention.schemes=[{','.join(schemes)}]",
        f"attention.backends=[{','.join(plan.KERNEL_BACKENDS)}]", "train_step.schemes=[]", "long_context.length=null",
    )  # fmt: skip
    rows = {(r["scheme"], r["backend"]): r for r in run(cfg, tmp_path)["attention"]}
    assert schemes and {"stick_breaking"} <= set(schemes)
    for scheme in schemes:
        assert rows[scheme, "auto"]["resolved"] == "scheme"  # nothing measured: auto keeps the blocked form
        for backend in plan.KERNEL_BACKENDS:
            assert rows[scheme, backend]["train_x_best"] > 0 and "train_error" not in rows[scheme, backend]


def test_a_profiled_train_step_says_where_its_time_went(tmp_path: Path) -> None:
    cfg = _compose("attention.lengths=[]", "long_context.length=null", "train_step.profile_schemes=[t5]")
    results = run(cfg, tmp_path)
    step = {r["scheme"]: r for r in results["train_step"]}
    assert "profile" not in step["alibi"]  # only the schemes named
    prof = step["t5"]["profile"]
    assert prof["clock"] == "cpu" and prof["steps"] == cfg.train_step.profile_steps
    top = prof["top"]
    assert 0 < len(top) <= cfg.train_step.profile_rows
    # Heaviest first, each a share of the operators' own time, which the rows cannot exceed together.
    assert [e["ms_per_step"] for e in top] == sorted((e["ms_per_step"] for e in top), reverse=True)
    assert 0 < sum(e["share"] for e in top) <= 1 + 1e-9 and prof["busy_ms_per_step"] > 0
    assert any(e["name"].startswith("aten::") for e in top)  # the step's own operators, not the profiler's
    text = (tmp_path / "profile_t5.txt").read_text()  # the full table beside the summary
    assert "Self CPU" in text and "aten::" in text
    assert "text" not in json.loads((tmp_path / "bench.json").read_text())["train_step"][2]["profile"]
    shown = (tmp_path / "bench.md").read_text()
    assert "#### Profile of the train step: t5 (3 steps, cpu time)" in shown and f"`{top[0]['name']}`" in shown


def test_bench_reports_a_failure_as_a_result(tmp_path: Path) -> None:
    # flex has no CPU backward: its forward is timed, its training is recorded as refused, not as a number; a
    # train step through it fails the same way, and the run goes on to the next scheme.
    overrides = ["attention.lengths=[32]", "attention.schemes=[alibi]", "attention.backends=[flex]"]
    results = run(_compose(*overrides, "train_step.attention=flex", "long_context.length=null"), tmp_path)
    (flex,) = [r for r in results["attention"] if r["backend"] == "flex" and r["scheme"] == "alibi"]
    assert flex["forward_ms"] > 0 and "cannot train on CPU" in flex["train_error"]
    assert "Traceback" in flex["train_error_traceback"]  # kept whole in bench.json, beside the table's cause
    step = {r["scheme"]: r for r in results["train_step"]}
    assert "cannot train on CPU" in step["alibi"]["error"] and "tokens_per_s" not in step["alibi"]
    assert "cannot train on CPU" in (tmp_path / "bench.md").read_text()
    assert results["long_context"] == []


def test_a_failed_case_keeps_its_cause_and_its_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    # A compile error's first line is a header; the cause follows it. The table cell gets the cause, the record
    # and the log (stdout, which the GPU session keeps as the step's log) the whole exception and traceback.
    def compile_kernel() -> None:
        raise RuntimeError("backend='inductor' raised:\nCompilationError: at 12:4:\n    acc += tl.dot(p, v)\n    ^")

    row: dict = {"item": "fused table kernel"}
    try:
        compile_kernel()
    except RuntimeError as err:
        record_failure(row, "train_error", err)
    assert (
        row["train_error"].startswith("RuntimeError: CompilationError: at 12:4:")
        and "raised:" not in row["train_error"]
    )
    trace = row["train_error_traceback"]
    assert "compile_kernel" in trace and "acc += tl.dot(p, v)" in trace and "backend='inductor' raised:" in trace
    printed = capsys.readouterr().out
    assert "fused table kernel" in printed and "compile_kernel" in printed and "at 12:4:" in printed


COMPARE = [
    "attention.lengths=[]",
    "train_step.schemes=[]",
    "long_context.length=null",
    "compare.lengths=[16]",
    "compare.batch_size=2",
    "compare.dim=16",
    "compare.heads=2",
    "compare.depth=1",
    "compare.warmup=0",
    "compare.repeats=2",
]


def test_compare_with_x_transformers(tmp_path: Path) -> None:
    pytest.importorskip("x_transformers")
    schemes = ["alibi", "rope", "t5"]
    results = run(_compose(*COMPARE, f"compare.schemes=[{','.join(schemes)}]"), tmp_path)
    rows = {row["scheme"]: row for row in results["compare"]}
    assert list(rows) == schemes
    for row in rows.values():
        assert row["posenc_ms"] > 0 and row["x_ms"] > 0 and row["ratio"] == row["posenc_ms"] / row["x_ms"]
        assert row["posenc_tokens_per_s"] == pytest.approx(2 * 16 / row["posenc_ms"] * 1e3)
    # The same decoder on both sides: position-free schemes have exactly the same parameter count.
    assert rows["alibi"]["posenc_params"] == rows["alibi"]["x_params"]
    assert rows["rope"]["x_flags"]["attn_flash"] is True
    assert "### posenc against x-transformers" in (tmp_path / "bench.md").read_text()


def _killed_by_the_kernel(*args: object) -> dict:
    os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's out-of-memory killer does: no exception, no answer
    return {}


def _answers(*args: object) -> dict:
    return {"posenc_ms": 1.0, "peak_rss_mib": 2.0}


def test_a_case_runs_in_a_child_and_a_killed_child_is_reported() -> None:
    assert bench_compare.in_child((), _answers) == {"posenc_ms": 1.0, "peak_rss_mib": 2.0}
    killed = bench_compare.in_child((), _killed_by_the_kernel)
    assert killed["killed"] and "SIGKILL" in killed["error"]


def test_compare_keeps_the_library_that_fit_when_the_other_is_killed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Both in one child are killed; alone, posenc runs and x-transformers is killed: posenc's time is kept."""
    pytest.importorskip("x_transformers")
    calls = []

    def fake_child(args: tuple) -> dict:
        sides = args[-1]
        calls.append(sides)
        if sides == ("posenc",):
            return {"posenc_ms": 50.0, "posenc_params": 10, "x_params": 10, "peak_rss_mib": 300.0}
        return {"error": "killed (SIGKILL: out of memory, most likely)", "killed": True}

    monkeypatch.setattr(bench_compare, "in_child", fake_child)
    results = run(_compose(*COMPARE, "compare.schemes=[cope]"), tmp_path)
    (row,) = results["compare"]
    assert calls == [("posenc", "x"), ("posenc",), ("x",)]
    assert row["posenc_ms"] == 50.0 and "x_ms" not in row and "ratio" not in row
    assert row["error"].startswith("x-transformers: killed (SIGKILL")
    assert row["posenc_tokens_per_s"] == pytest.approx(2 * 16 / 50.0 * 1e3) and row["posenc_peak_rss_mib"] == 300.0
    table = [line for line in (tmp_path / "bench.md").read_text().splitlines() if line.startswith("| cope | 16 |")]
    assert table and "| 50.0 |" in table[0] and "posenc 300" in table[0]


def test_compare_without_x_transformers_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "x_transformers", None)  # import fails as if not installed
    with pytest.raises(SystemExit, match="pip install x-transformers"):
        run(_compose(*COMPARE, "compare.schemes=[alibi]"), tmp_path)


@pytest.mark.slow
def test_bench_command_line(tmp_path: Path) -> None:
    overrides = [o for o in TINY if not o.startswith(("attention.schemes", "train_step.schemes"))]
    command = [sys.executable, "-m", "posenc.bench", *overrides, "attention.schemes=[alibi]"]
    command += ["train_step.schemes=[alibi]", f"output_root={tmp_path}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    written = list((tmp_path / "bench").glob("*/bench.md"))
    assert len(written) == 1 and "### Attention, L = 64" in written[0].read_text()
    assert "wrote" in done.stdout


@pytest.mark.parametrize(
    ("reference", "kernel"),
    [
        ("sdpa:flash", "aten::_scaled_dot_product_flash_attention_for_cpu"),
        ("sdpa", "aten::scaled_dot_product_attention"),
    ],
)
def test_a_reference_runs_its_kernel_and_refuses_a_bias(reference: str, kernel: str) -> None:
    q, k, v = (torch.randn(2, 2, 16, 8, requires_grad=True) for _ in range(3))
    call = attention_call(build("nope", num_heads=2, head_dim=8), reference, q, k, v)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = call()
        out.sum().backward()
    assert kernel in {event.name for event in prof.events()}
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expected)


def test_a_held_kernel_is_only_for_attention_without_a_position_signal() -> None:
    q = k = v = torch.randn(1, 2, 8, 8)
    for scheme in ("alibi", "rope", "alibi_dd"):
        with pytest.raises(ValueError, match="reference without a bias or rotation"):
            attention_call(build(scheme, num_heads=2, head_dim=8), "sdpa:flash", q, k, v)
    with pytest.raises(RuntimeError):  # a kernel the device lacks fails the case, which the table reports
        attention_call(build("nope", num_heads=2, head_dim=8), "sdpa:cudnn", q, k, v)()


def test_the_fastest_reference_is_chosen_per_mode_among_those_that_ran() -> None:
    rows = [
        {"backend": "sdpa", "forward_ms": 2.0, "train_ms": 5.0},
        {"backend": "flex", "forward_ms": 1.5, "train_error": "no backward"},
        {"backend": "sdpa:cudnn", "forward_error": "no kernel", "train_error": "no kernel"},
        {"backend": "sdpa:flash", "forward_ms": 1.8, "train_ms": 4.0},
    ]
    assert fastest(rows, "forward")["backend"] == "flex"  # a failed backward does not cost it the forward
    assert fastest(rows, "train")["backend"] == "sdpa:flash"
    assert fastest(rows[2:3], "train") is None
    # Every kernel torch has on a GPU competes there; a list in the config is taken as given.
    assert reference_backends("auto", torch.device("cuda")) == [
        "sdpa",
        "sdpa:flash",
        "sdpa:cudnn",
        "sdpa:efficient",
        "flex",
    ]
    assert reference_backends(["sdpa"], torch.device("cuda")) == ["sdpa"]


def test_train_steps_are_timed_in_turns_and_a_failing_step_leaves_the_rotation() -> None:
    calls: list[str] = []

    def step(name: str) -> Callable[[], None]:
        def call() -> None:
            calls.append(name)
            if name == "b" and calls.count("b") == 3:
                raise RuntimeError("out of memory")

        return call

    rows: list[dict] = [{"scheme": name} for name in "abc"]
    steps = {index: step(name) for index, name in enumerate("abc")}
    times = interleaved_steps_ms(steps, rows, torch.device("cpu"), warmup=1, repeats=4, budget_s=60.0)
    # One call of each per repetition, in the same order: a change of load falls on every scheme alike.
    assert calls == ["a", "b", "c", "a", "b", "c", "a", "b", "c", "a", "c", "a", "c"]
    assert sorted(times) == [0, 2] and len(times[0]) == len(times[2]) == 4
    assert rows[1]["error"].startswith("RuntimeError: out of memory") and "error" not in rows[0]


def test_the_train_step_reads_encoding_configs_and_names_them_as_runs_do(tmp_path: Path) -> None:
    cfg = _compose("attention.lengths=[]", "long_context.length=null", "train_step.schemes=[rnope,rope_alibi,alibi]")
    rows = {row["scheme"]: row for row in run(cfg, tmp_path)["train_step"]}
    assert {scheme: row["label"] for scheme, row in rows.items()} == {
        "rnope": "rope×3,nope",
        "rope_alibi": "rope+alibi",
        "alibi": "alibi",
    }
    assert all(row["repeats"] == cfg.repeats and row["x_nope"] > 0 and row["parameters"] > 0 for row in rows.values())
    # The ratio is the median of the steps' paired ratios, inside its bootstrap interval over the repetitions.
    assert all(low <= row["x_nope"] <= high for row in rows.values() for low, high in [row["x_nope_interval"]])
    assert "timed in turn" in (tmp_path / "bench.md").read_text()
