"""What a researcher reads: axes that cannot exaggerate, loss by position for every length, task tables with
per-byte accuracy and chance, the two 1× perplexities explained."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from posenc.evaluate.plots import line_figure
from posenc.evaluate.runner import print_results, write_outputs
from posenc.report import build_report, find_results


def _labels(ax) -> list[str]:  # ax: a matplotlib Axes
    ax.figure.canvas.draw()
    low, high = ax.get_ylim()
    ticks = [t for t in ax.get_yticklabels() if low <= t.get_position()[1] <= high and t.get_text()]
    return [t.get_text() for t in ticks]


def test_ratio_axis_keeps_one_in_view_with_a_minimum_span_and_distinct_labels() -> None:
    series = {"alibi": ([64, 128, 256], [1.001, 1.002, 1.003], None)}
    _, ax = line_figure(series, "ratio", "length", "ratio", logy=True, include=(1.0,), min_span=1.1)
    low, high = ax.get_ylim()
    assert low < 1.0 < high and high / low >= 1.1
    labels = _labels(ax)
    assert len(labels) >= 3 and len(set(labels)) == len(labels), labels


def test_perplexity_axis_does_not_turn_a_small_change_into_a_peak() -> None:
    series = {"rope": ([64, 128, 256], [10.00, 10.02, 10.00], None)}
    _, ax = line_figure(series, "ppl", "length", "perplexity", logy=True, min_span=1.25)
    low, high = ax.get_ylim()
    assert high / low >= 1.25
    labels = _labels(ax)
    assert len(labels) >= 2 and len(set(labels)) == len(labels), labels


def test_accuracy_axis_is_zero_to_one_even_when_every_value_is_zero() -> None:
    _, ax = line_figure({"nope": ([64, 128], [0.0, 0.0], None)}, "acc", "length", "accuracy", ylim=(-0.02, 1.02))
    assert ax.get_ylim() == pytest.approx((-0.02, 1.02))


def _text_results(train_len: int = 16) -> dict:
    rows = [
        {
            "length": train_len * m,
            "mode": "nonoverlap",
            "stride": None,
            "tokens": 256,
            "loss": 2.0,
            "ppl": math.exp(2.0),
            "bpb": 2.0 / math.log(2),
            "error": None,
            "multiple": m,
            "ratio": 1.0,
            "loss_by_position": None,
        }
        for m in (1, 2)
    ]
    return {
        "label": "alibi",
        "train_len": train_len,
        "config": {"data": {"val_windows": 4}},
        "eval": {"split": "validation"},
        "perplexity": rows,
        "loss_by_position": {str(train_len): [2.0] * train_len, str(2 * train_len): [2.1] * (2 * train_len)},
        "summary": {},
    }


def test_loss_by_position_csv_holds_every_length(tmp_path: Path) -> None:
    write_outputs(_text_results(), tmp_path, plots=False)
    with (tmp_path / "loss_by_position.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert {int(row["length"]) for row in rows} == {16, 32} and len(rows) == 16 + 32


def test_the_two_in_length_perplexities_are_told_apart(capsys: pytest.CaptureFixture) -> None:
    print_results(_text_results())
    out = capsys.readouterr().out
    assert "training's val/ppl scored the first 64 of the split" in out
    assert "scores 256 tokens, the first tokens of the validation split" in out  # a result without its documents
    documents = {"sample": "documents", "documents": list(range(39)), "tokens": [1] * 39}
    print_results({**_text_results(), "documents": documents})
    assert "scores 256 tokens, a piece of each of the 39 documents of the validation split" in capsys.readouterr().out


def _task_result(folder: Path, label: str, trained_task: str | None, task: str, accuracy: float) -> None:
    rows = [
        {"task": task, "length": n, "samples": 4, "accuracy": accuracy, "token_accuracy": 0.3, "depth": 0.5}
        for n in (64, 128)
    ]
    result = {"label": label, "train_len": 64, "seed": 0, task: rows, "trained_task": trained_task}
    result["data"] = {"task": trained_task} if trained_task else {"corpus": "stdlib", "fingerprint": "fp"}
    (folder / "eval").mkdir(parents=True)
    (folder / "eval" / "results.json").write_text(json.dumps(result))


def test_task_tables_show_per_byte_accuracy_chance_and_untrained_models(tmp_path: Path) -> None:
    _task_result(tmp_path / "a", "alibi", "passkey", "passkey", 0.5)
    _task_result(tmp_path / "b", "rope", None, "passkey", 0.0)
    _task_result(tmp_path / "c", "alibi", "copy", "copy", 0.25)
    markdown = build_report(find_results([tmp_path]), tmp_path / "report", make_plots=True)
    passkey, copy = markdown.split("## copy accuracy")
    assert "Per-byte accuracy (mean over key depths) (chance: 0.10" in passkey
    assert "| 64 | 1 | 0.30 | 0.30 |" in passkey  # per byte: no counts to give an interval, and no marks
    assert "Not trained on passkey: rope" in passkey
    assert "mean over key depths" not in copy.split("## Plots")[0] and "(chance: 0.04" in copy
    assert (tmp_path / "report" / "passkey_accuracy_per_byte_L64.png").exists()


@pytest.mark.parametrize("figure", ["learned_bias", "drift_curve"])
def test_single_panel_figures_show_their_whole_title_and_distances_from_zero(
    figure: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from posenc.report import drift

    kept = []
    monkeypatch.setattr(drift, "_save", lambda fig, path: kept.append(fig) or path)
    if figure == "learned_bias":
        curve = {"distances": list(range(200)), "by_head": [[-0.01 * d for d in range(200)]], "query_position": 199}
        drift._bias_figure({"t5": curve}, 64, tmp_path / "bias.png")
    else:
        drift._curve_figure({"t5": (list(range(0, 600, 10)), [0.01 * (i + 1) for i in range(60)], 3)}, 64, tmp_path)
    (fig,) = kept
    fig.canvas.draw()
    title, frame = fig._suptitle.get_window_extent(), fig.bbox
    assert frame.x0 <= title.x0 and title.x1 <= frame.x1 and title.y1 <= frame.y1  # nothing of it cut off
    (ax,) = [ax for ax in fig.axes if ax.get_visible()]
    assert ax.get_xlim()[0] == 0  # no width spent on negative distances or steps
    assert not any(tick < 0 for tick in ax.get_xticks() if ax.get_xlim()[0] <= tick <= ax.get_xlim()[1])


def test_a_long_conditions_note_under_the_cost_chart_makes_the_figure_taller_not_the_axes_vanish() -> None:
    # A sweep of many columns in many conditions once raised "bottom cannot be >= top" and lost the whole report.
    import matplotlib.pyplot as plt

    from posenc.report.cost import NOTE_LINES, _note_below

    fig, _ = plt.subplots(figsize=(8, 5))
    _note_below(fig, "; ".join(f"column {i} · lr=0.004 · scheme_lr_multiplier=100 {i / 10:.2f}" for i in range(200)))
    width, height = fig.get_size_inches()
    assert width == 8 and height > 5
    assert fig.subplotpars.bottom < fig.subplotpars.top
    (text,) = fig.texts
    assert text.get_text().count("\n") == NOTE_LINES - 1 and "the rest in the report's cost section" in text.get_text()
    plt.close(fig)
