"""Known answers for the extrapolation metrics, the synthetic tasks, the standalone evaluator and the report."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import FAST, compose_train
from torch import nn

from posenc.evaluate.perplexity import _windows, evaluate_lengths, scored_span
from posenc.evaluate.tasks import (
    IGNORE,
    TaskDataset,
    copy_sample,
    evaluate_copy,
    evaluate_passkey,
    passkey_depth,
    passkey_sample,
)
from posenc.report import build_report, find_results
from posenc.train import train

VOCAB = 257


class Uniform(nn.Module):
    """Equal logits everywhere: perplexity must be exactly the vocabulary size."""

    def __init__(self) -> None:
        super().__init__()
        self.dummy = nn.Parameter(torch.zeros(()))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*tokens.shape, VOCAB) + self.dummy


class Bigram(nn.Module):
    """A fixed random bigram model: context-free, so any window cut must give the same loss per token."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(VOCAB, VOCAB))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table[tokens]


class Counter(nn.Module):
    """Context-dependent: logits depend on the position in the window, so the window cut matters."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(0.05))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        position = torch.arange(tokens.shape[1], dtype=torch.float32)[None, :, None]
        return (position * self.scale * torch.arange(VOCAB) / VOCAB).expand(tokens.shape[0], -1, -1) + 0 * tokens[
            ..., None
        ]


class Oracle(nn.Module):
    """Predicts every answer token of a passkey/copy sample perfectly, from the input alone."""

    def __init__(self, task: str) -> None:
        super().__init__()
        self.task = task
        self.dummy = nn.Parameter(torch.zeros(()))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*tokens.shape, VOCAB)
        for row, seq in enumerate(tokens.tolist()):
            if self.task == "passkey":
                start = seq.index(ord("#"))
                key = seq[start + 1 : seq.index(ord("#"), start + 1)]
                query = seq.index(ord("?"))
                answer = {query + i: digit for i, digit in enumerate(key)}
            else:
                bar = seq.index(ord("|"))
                n = len(seq) - bar
                text = seq[bar - n : bar]
                answer = {bar + i: text[i] for i in range(n)}
            for position, token in answer.items():
                if position < len(seq):
                    logits[row, position, token] = 10.0
        return logits


def stream(n: int = 5000) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, n).astype(np.uint16)


@pytest.mark.parametrize("mode", ["nonoverlap", "sliding"])
def test_uniform_model_has_vocab_perplexity_at_every_length(mode: str) -> None:
    rows = evaluate_lengths(Uniform(), stream(), [16, 32, 64, 128], mode=mode, stride=8, max_tokens=2048)
    context = 128 - 8 if mode == "sliding" else 0  # what the longest length's windows need before their first score
    for row in rows:
        assert row.ppl == pytest.approx(VOCAB, rel=1e-6)  # fp32 logits
        assert row.tokens == 2048 - context and row.bpb == pytest.approx(math.log2(VOCAB), rel=1e-6)


def test_same_tokens_scored_at_every_length() -> None:
    assert scored_span(5000, [16, 32, 64, 128], 2048) == 2048
    assert scored_span(5000, [16, 48], None) == 4992  # common multiple of the lengths, below available - 1
    with pytest.raises(ValueError, match="too few for one window"):
        scored_span(100, [64, 128], None)
    # A context-free model scores identical tokens identically whatever the window length.
    rows = evaluate_lengths(Bigram(), stream(), [16, 64, 256], max_tokens=2048)
    assert rows[0].loss == pytest.approx(rows[1].loss, rel=1e-12) == pytest.approx(rows[2].loss, rel=1e-12)


def test_sliding_with_stride_equal_to_length_is_nonoverlap() -> None:
    model = Counter()
    for length in (16, 64):
        (sliding,) = evaluate_lengths(model, stream(), [length], mode="sliding", stride=length, max_tokens=2048)
        (disjoint,) = evaluate_lengths(model, stream(), [length], mode="nonoverlap", max_tokens=2048)
        assert sliding.loss == disjoint.loss
        assert sliding.loss_by_position == disjoint.loss_by_position


def _after(model, context: int, length: int = 64) -> float:
    """The disjoint windows' mean loss over targets context+1..2048: what a sliding protocol scores."""
    documents = (np.arange(5000) > context).astype(np.int64)  # owner of target t is documents[t]
    (disjoint,) = evaluate_lengths(model, stream(), [length], max_tokens=2048, documents=documents)
    return disjoint.document_loss[1] / disjoint.document_tokens[1]


def test_sliding_scores_each_token_once_with_more_context() -> None:
    model = Counter()
    (sliding,) = evaluate_lengths(model, stream(), [64], mode="sliding", stride=16, max_tokens=2048)
    (disjoint,) = evaluate_lengths(model, stream(), [64], mode="nonoverlap", max_tokens=2048)
    assert disjoint.tokens == 2048 and sliding.tokens == 2048 - 48  # the first 48 targets are context only
    assert sliding.loss != disjoint.loss  # later positions (more context) are the ones scored


def test_every_sliding_score_at_the_longest_length_sees_its_share_of_context() -> None:
    """At the longest length a stream may hold one window: sliding then still differs from disjoint windows."""
    for stride, length, span in ((1024, 2048, 2048), (1024, 2048, 4096), (48, 64, 2048)):
        context = length - stride
        windows = _windows(span, length, stride, context)
        targets = [t for start, end, first in windows for t in range(start + 1 + first, end + 1)]
        assert targets == list(range(context + 1, span + 1))  # every target after the context, once
        assert min(first + 1 for _, _, first in windows) >= length - stride + 1  # context of its first scored target
    model = Counter()
    one_window = stream(2049)
    (sliding,) = evaluate_lengths(model, one_window, [2048], mode="sliding", stride_fraction=0.5, max_tokens=None)
    (disjoint,) = evaluate_lengths(model, one_window, [2048], mode="nonoverlap", max_tokens=None)
    assert (sliding.tokens, disjoint.tokens) == (1024, 2048) and sliding.loss != disjoint.loss


def test_sliding_with_a_stride_that_does_not_divide_scores_every_target_once() -> None:
    # A context-free model gives each target the same loss however it is windowed: any target scored twice or
    # missed, or a total divided by the wrong count, moves the mean away from the disjoint windows' figure.
    model = Bigram()
    for stride in (24, 40, 7):
        (sliding,) = evaluate_lengths(model, stream(), [64], mode="sliding", stride=stride, max_tokens=2048)
        assert sliding.tokens == 2048 - (64 - stride)
        assert sliding.loss == pytest.approx(_after(model, 64 - stride), rel=1e-12), stride


def test_a_stride_fraction_slides_each_length_by_its_share_and_scores_every_target_once() -> None:
    model = Bigram()
    lengths = [32, 64, 128]
    rows = evaluate_lengths(model, stream(), lengths, mode="sliding", stride_fraction=0.125, max_tokens=2048)
    assert [row.stride for row in rows] == [4, 8, 16] and {row.stride_fraction for row in rows} == {0.125}
    expected = _after(model, 128 - 16)  # the same targets at every length: after the longest one's context
    assert all(row.loss == pytest.approx(expected, rel=1e-12) for row in rows)  # context-free: same loss
    whole = evaluate_lengths(Counter(), stream(), lengths, mode="sliding", stride_fraction=1.0, max_tokens=2048)
    plain = evaluate_lengths(Counter(), stream(), lengths, mode="nonoverlap", max_tokens=2048)
    assert [r.loss for r in whole] == pytest.approx([r.loss for r in plain], rel=1e-12)  # a stride of N is disjoint
    with pytest.raises(ValueError, match="needs one stride"):
        evaluate_lengths(model, stream(), [32], mode="sliding", stride=8, stride_fraction=0.5)


def test_each_documents_loss_is_recorded_and_they_sum_to_the_total() -> None:
    documents = np.repeat(np.arange(5), 1000)  # five documents of 1,000 tokens
    rows = evaluate_lengths(Counter(), stream(), [32, 128], mode="sliding", stride=24, max_tokens=4096,
                            documents=documents)  # fmt: skip
    for row in rows:
        assert len(row.document_loss) == 5  # the targets 1..4096 reach into the fifth document
        assert sum(row.document_loss) == pytest.approx(row.loss * row.tokens, rel=1e-9)
    # worked out target by target for disjoint windows of 32: target t is predicted at position (t − 1) mod 32
    (disjoint,) = evaluate_lengths(Counter(), stream(), [32], max_tokens=4096, documents=documents)
    tokens = torch.from_numpy(stream()[: 4096 + 1].astype(np.int64))
    logits = Counter()(tokens[:-1].reshape(-1, 32)).reshape(4096, VOCAB)
    losses = torch.nn.functional.cross_entropy(logits, tokens[1:], reduction="none").double().detach()
    by_document = np.bincount(documents[1:4097], weights=losses.numpy())
    assert disjoint.document_loss == pytest.approx(by_document.tolist(), rel=1e-6)  # float32 losses, summed apart


def test_the_held_out_sample_takes_a_piece_of_every_document() -> None:
    from posenc.data.heldout import document_bounds, heldout_sample, piece_cap

    eod = 256
    sizes = [5000, 40, 900, 12000, 300]
    split = np.concatenate([np.concatenate([np.full(n, i % 200), [eod]]) for i, n in enumerate(sizes)])
    assert [end - start for start, end in document_bounds(split, eod)] == [n + 1 for n in sizes]
    assert piece_cap(sizes, 40 + 300 + 3 * 700) == 700  # 40 + 300 + 700 · 3 = 2440
    held = heldout_sample(split, 2440 + 5 - 1, "documents", seed=3, eod=eod)
    assert held.sample == "documents" and held.cap == 700
    assert sorted(set(held.documents.tolist())) == [0, 1, 2, 3, 4]  # every document, even the short ones whole
    assert [int((held.documents == i).sum()) for i in range(5)] == [701, 41, 701, 701, 301]
    assert all(set(held.tokens[held.documents == i][:-1].tolist()) == {i % 200} for i in range(5))  # its own text
    assert np.array_equal(held.tokens, heldout_sample(split, 2444, "documents", seed=3, eod=eod).tokens)  # seeded
    assert heldout_sample(split, 1000, "head", eod=eod).tokens.size == 1001
    assert heldout_sample(split, None, eod=eod).sample == "split"
    described = held.describe(2444)  # the targets a full budget scores: every document's piece
    assert described["documents"] == [0, 1, 2, 3, 4] and described["tokens"] == [700, 41, 701, 701, 301]


class ShapeRecorder(nn.Module):
    """Uniform logits, recording every input shape: each new shape is one compilation of a static-shape model."""

    def __init__(self) -> None:
        super().__init__()
        self.dummy = nn.Parameter(torch.zeros(()))
        self.shapes: set[tuple[int, ...]] = set()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.shapes.add(tuple(tokens.shape))
        return torch.zeros(*tokens.shape, VOCAB) + self.dummy


def test_sliding_evaluation_runs_at_most_two_shapes_per_length() -> None:
    # Stride 4 to 16x a length of 16 would be ~1,000 windows; partial windows at the stream's start used to be one
    # shape each, which past dynamo's recompile limit stops a GPU evaluation.
    model = ShapeRecorder()
    lengths = [16 * m for m in (1, 2, 4, 8, 16)]
    rows = evaluate_lengths(
        model, stream(9000), lengths, mode="sliding", stride=4, max_tokens=8192, tokens_per_batch=600
    )
    assert all(row.ppl == pytest.approx(VOCAB, rel=1e-6) for row in rows)
    for length in lengths:
        assert len({shape for shape in model.shapes if shape[1] == length}) <= 2, length
    assert {shape[1] for shape in model.shapes} == set(lengths)


def test_loss_by_position_follows_the_model() -> None:
    (row,) = evaluate_lengths(Counter(), stream(), [32], max_tokens=2048)
    assert len(row.loss_by_position) == 32
    # Counter's logits sharpen with position towards high token ids; random targets make later positions worse.
    assert row.loss_by_position[0] == pytest.approx(math.log(VOCAB), rel=1e-6)
    assert row.loss_by_position[-1] > row.loss_by_position[0]


def test_length_the_model_cannot_handle_is_reported_not_fatal() -> None:
    model = Uniform()
    model.max_positions = 32
    rows = evaluate_lengths(model, stream(), [16, 32, 64], max_tokens=1024)
    assert [r.error is None for r in rows] == [True, True, False]
    assert "max_positions=32" in rows[2].error


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_passkey_places_the_key_at_the_requested_depth(depth: float) -> None:
    sample = passkey_sample(200, depth, np.random.default_rng(1))
    assert sample.inputs.shape == (200,) and sample.targets.shape == (200,)
    assert passkey_depth(sample) == pytest.approx(depth, abs=1 / 180)
    answer = sample.targets[sample.targets != IGNORE]
    assert len(answer) == 5 and all(ord("0") <= t <= ord("9") for t in answer.tolist())
    text = bytes(sample.inputs.tolist()).decode()
    assert text.count("#") == 2 and text.endswith("?" + bytes(answer[:-1].tolist()).decode())


def test_passkey_oracle_scores_perfectly_and_uniform_scores_zero() -> None:
    rows = evaluate_passkey(Oracle("passkey"), [64, 256], [0.0, 0.5, 1.0], samples=6, seed=0)
    assert len(rows) == 6 and all(row["accuracy"] == 1.0 for row in rows)
    rows = evaluate_passkey(Uniform(), [64], [0.5], samples=6, seed=0)
    assert rows[0]["accuracy"] < 1.0


def test_copy_oracle_scores_perfectly() -> None:
    rows = evaluate_copy(Oracle("copy"), [64, 129], samples=5, seed=0)
    assert all(row["accuracy"] == 1.0 and row["token_accuracy"] == 1.0 for row in rows)
    sample = copy_sample(64, np.random.default_rng(0))
    scored = sample.targets[sample.targets != IGNORE]
    assert len(scored) == 32


def test_task_dataset_is_seeded() -> None:
    a, b = TaskDataset("passkey", 64, 10, seed=1), TaskDataset("passkey", 64, 10, seed=2)
    assert torch.equal(a[3][0], TaskDataset("passkey", 64, 10, seed=1)[3][0])
    assert not torch.equal(a[3][0], b[3][0])
    with pytest.raises(ValueError, match="unknown task 'sort'"):
        TaskDataset("sort", 64, 1, seed=0)


def _fake_result(label: str, seed: int, ppls: list[float], tmp: Path) -> None:
    rows = [
        {
            "length": 64 * m,
            "mode": "nonoverlap",
            "stride": None,
            "tokens": 4096,
            "loss": math.log(p),
            "ppl": p,
            "bpb": math.log2(p),
            "error": None,
            "multiple": m,
            "ratio": p / ppls[0],
            "loss_by_position": None,
        }
        for m, p in zip([1, 2, 4], ppls, strict=True)
    ]
    folder = tmp / f"{label}-s{seed}" / "eval"
    folder.mkdir(parents=True)
    result = {
        "label": label,
        "train_len": 64,
        "seed": seed,
        "perplexity": rows,
        "loss_by_position": {"256": [1.0] * 256},
    }
    (folder / "results.json").write_text(json.dumps(result))


def test_report_builds_the_expected_table(tmp_path: Path) -> None:
    _fake_result("alibi", 0, [10.0, 10.0, 10.0], tmp_path)
    _fake_result("alibi", 1, [12.0, 12.0, 13.0], tmp_path)
    _fake_result("sinusoidal", 0, [10.0, 40.0, 200.0], tmp_path)
    markdown = build_report(find_results([tmp_path]), tmp_path / "report")
    lines = markdown.splitlines()
    assert "| length | ×L | alibi (n=2 · ? steps · ? tokens) | sinusoidal (n=1 · ? steps · ? tokens) |" in lines

    # No loss per document recorded: over seeds only (ᵗ), exp of the mean log and of its 95% t interval over two seeds
    # (t = 12.706 at 1 degree of freedom: 12.706 · s / √2); ◆ the best at each length; a one-seed column shows its
    # value alone, and one shared seed is no test (no word).
    def over_seeds(a: float, b: float, digits: int) -> str:
        mean, half = (math.log(a) + math.log(b)) / 2, 12.706205 * abs(math.log(a / b)) / 2
        return f"{math.exp(mean):.{digits}f} [{math.exp(mean - half):.{digits}f}, {math.exp(mean + half):.{digits}f}]ᵗ"

    assert f"| 64 | 1 | {over_seeds(10, 12, 2)} | 10.00ᵗ ◆ |" in lines
    assert f"| 256 | 4 | {over_seeds(10, 13, 2)} ◆ | 200.00ᵗ |" in lines
    assert f"| 256 | 4 | {over_seeds(1.0, 13 / 12, 3)} ? | 20.000ᵗ |" in lines  # ratios (1, 13/12), 20: against 1
    assert (tmp_path / "report" / "report.md").exists()
    assert (tmp_path / "report" / "ppl_vs_length_L64_nonoverlap.png").stat().st_size > 0


def test_report_without_results_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"no results\.json found"):
        build_report(find_results([tmp_path]), tmp_path)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("run")
    train(compose_train("+encoding=alibi", *FAST), run_dir)
    return run_dir


def _evaluate(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "posenc.evaluate", *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_standalone_evaluate_writes_results(trained_run: Path, tmp_path: Path) -> None:
    result = _evaluate(
        str(trained_run),
        "eval.multiples=[1,2]",
        "eval.mode=sliding",
        "eval.stride=8",
        "eval.max_tokens=512",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    saved = json.loads((trained_run / "eval_sliding_s8_multiples1-2_max_tokens512" / "results.json").read_text())
    assert saved["label"] == "alibi" and [r["length"] for r in saved["perplexity"]] == [16, 32]
    assert saved["precision"] == "32-true"  # trained on CPU in fp32: evaluated in it
    assert (trained_run / "eval_sliding_s8_multiples1-2_max_tokens512" / "ppl_vs_length.png").exists()
    assert list(tmp_path.iterdir()) == []  # nothing written to the working directory
    mask = os.umask(0)
    os.umask(mask)
    folder = trained_run / "eval_sliding_s8_multiples1-2_max_tokens512"
    assert folder.stat().st_mode & 0o777 == 0o777 & ~mask  # as mkdir makes it: collaborators read it as before


def test_lengths_the_sample_cannot_fill_are_said_in_results_and_on_the_console(
    trained_run: Path, tmp_path: Path
) -> None:
    result = _evaluate(str(trained_run), "eval.multiples=[1,100000]", "eval.max_tokens=256", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    saved = json.loads((trained_run / "eval_multiples1-100000" / "results.json").read_text())
    rows = {row["length"]: row for row in saved["perplexity"]}
    assert rows[16]["error"] is None and rows[1_600_000]["ppl"] is None
    assert rows[1_600_000]["error"].startswith("not evaluated: the sample holds")
    assert "1600000" in result.stdout and "raise eval.max_tokens" in result.stdout


def test_ctrl_c_during_an_evaluation_ends_in_one_line_and_keeps_the_folder(trained_run: Path, tmp_path: Path) -> None:
    before = (trained_run / "eval" / "results.json").read_bytes()
    evaluation = subprocess.Popen(
        [sys.executable, "-m", "posenc.evaluate", str(trained_run)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A suite started in the background (`pytest &`, nohup) hands its children SIGINT ignored, and Python then
        # never turns Ctrl-C into KeyboardInterrupt: give the child the default, as a terminal would.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert evaluation.stdout is not None
    started = evaluation.stdout.readline()
    assert started.startswith(f"evaluating {trained_run}"), started  # said at once, before the work
    evaluation.send_signal(signal.SIGINT)
    _, stderr = evaluation.communicate(timeout=120)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert evaluation.returncode == 1 and "Traceback" not in stderr, stderr
    assert len(lines) == 1 and lines[0].startswith("interrupted"), stderr
    assert f"{trained_run / 'eval'} is as it was" in lines[0] or "nothing was written" in lines[0]
    assert (trained_run / "eval" / "results.json").read_bytes() == before


def test_a_bf16_mixed_run_is_evaluated_in_bf16_mixed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The in-length figure must come from the precision training used, at the end of training and later from the
    # checkpoint; fp32 evaluation of a bf16-trained run would also refuse backends that need half precision.
    import posenc.model

    seen: list[torch.dtype] = []
    forward = posenc.model.Attention.forward

    def recording(self, x, pos, cache=None):
        if not torch.is_grad_enabled():
            seen.append(self.qkv(x).dtype)
        return forward(self, x, pos, cache)

    monkeypatch.setattr(posenc.model.Attention, "forward", recording)
    run_dir = tmp_path / "run"
    train(compose_train("+encoding=alibi", *FAST, "trainer.precision=bf16-mixed"), run_dir)
    results = json.loads((run_dir / "eval" / "results.json").read_text())
    assert results["precision"] == "bf16-mixed" and seen and set(seen) == {torch.bfloat16}
    from posenc.runs.checkpoints import load_module

    module, _ = load_module(run_dir / "checkpoints" / "last.ckpt", "cpu", None)
    assert module.hparams.precision == "bf16-mixed"


def test_evaluate_refuses_a_checkpoint_config_mismatch(trained_run: Path, tmp_path: Path) -> None:
    result = _evaluate(str(trained_run), "+encoding=rope", cwd=tmp_path)
    assert result.returncode != 0 and "checkpoint/config mismatch in 'encoding'" in result.stderr
    # A run directory whose config disagrees with the checkpoint inside it (a checkpoint copied across runs).
    other = tmp_path / "other"
    (other / ".hydra").mkdir(parents=True)
    (other / "checkpoints").mkdir()
    (other / "checkpoints" / "last.ckpt").write_bytes((trained_run / "checkpoints" / "last.ckpt").read_bytes())
    (other / ".hydra" / "config.yaml").write_text("encoding:\n  name: t5\nmodel:\n  dim: 128\n")
    result = _evaluate(str(other), cwd=tmp_path)
    assert result.returncode != 0 and "checkpoint/config mismatch in 'encoding'" in result.stderr


def test_evaluate_usage_errors(tmp_path: Path) -> None:
    assert "usage: python -m posenc.evaluate" in _evaluate(cwd=tmp_path).stderr
    assert "neither a run directory nor a checkpoint" in _evaluate(str(tmp_path / "nope"), cwd=tmp_path).stderr


def test_task_training_is_scored_on_the_task(tmp_path: Path) -> None:
    summary = train(compose_train("+encoding=rope", "data=passkey", *FAST), tmp_path)
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert "perplexity" not in results
    assert sorted({row["length"] for row in results["passkey"]}) == [16, 32]
    figures = {key for key in summary["eval"] if not key.startswith("effective_length_")}
    assert figures == {"passkey_acc@1x", "passkey_acc@2x", "passkey_byte_acc@1x", "passkey_byte_acc@2x"}
    effective = set(summary["eval"]) - figures  # a metric whose in-length figure is 0 has no effective length
    rules = {f"effective_length_{rule}/{metric}" for rule in ("absolute", "relative") for metric in ("passkey",
             "passkey_token_accuracy")}  # fmt: skip
    assert effective <= rules
    assert set(results["effective_length"]["relative"]) == {"passkey", "passkey_token_accuracy"}
    assert set(results["effective_length"]["absolute"]) == {"passkey", "passkey_token_accuracy"}


def test_report_task_tables_by_length_and_depth(tmp_path: Path) -> None:
    for label, near, far in (("alibi", 1.0, 0.0), ("kerple_log", 1.0, 1.0)):
        rows = [
            {
                "task": "passkey",
                "length": length,
                "depth": depth,
                "samples": 4,
                "accuracy": near if depth == 1.0 or length == 64 else far,
            }
            for length in (64, 256)
            for depth in (0.0, 1.0)
        ]
        folder = tmp_path / label / "eval"
        folder.mkdir(parents=True)
        (folder / "results.json").write_text(json.dumps({"label": label, "train_len": 64, "seed": 0, "passkey": rows}))
    markdown = build_report(find_results([tmp_path]), tmp_path / "report")
    lines = markdown.splitlines()
    # one seed each: its accuracy and the Wilson interval of its keys (4 per depth, 8 per length), no marks
    assert "| 64 | 1 | 1.00 [0.68, 1.00] | 1.00 [0.68, 1.00] |" in lines
    assert "| 256 | 4 | 0.50 [0.22, 0.78] | 1.00 [0.68, 1.00] |" in lines  # alibi: the far key lost, the near found
    assert "| 0 | 0.00 [0.00, 0.49] | 1.00 [0.51, 1.00] |" in lines  # by depth at 256: 0 and 4 of 4
    assert (tmp_path / "report" / "passkey_accuracy_L64.png").exists()
