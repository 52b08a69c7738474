"""Attention statistics: known values, chunking that changes nothing, and agreement with the layers' own maps."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import SCHEMES, layer_features, make

from posenc.evaluate.attention_stats import STATS, attention_statistics, layer_sums, mean_by_length
from posenc.model import Decoder

VOCAB = 30


def test_uniform_attention_has_the_textbook_values() -> None:
    # q = 0 and no bias: query i spreads evenly over its i + 1 keys, so distance i/2, entropy log(i+1), sink 1/(i+1).
    length, heads = 9, 2
    q, k = torch.zeros(1, heads, length, 4), torch.randn(1, heads, length, 4)
    sums = layer_sums(q, k, make("nope", heads=heads, head_dim=4), torch.arange(length), max_scores=1 << 20)
    queries = range(1, length)
    expected = {
        "distance": sum(i / 2 for i in queries),
        "entropy": sum(math.log(i + 1) for i in queries),
        "sink": sum(1 / (i + 1) for i in queries),
        "explicit": 0.0,  # no sink of the model's own
    }
    for name in STATS:
        torch.testing.assert_close(sums[name], torch.full((heads,), expected[name], dtype=torch.float64))
    assert sums["queries"].tolist() == [length - 1] * heads


@pytest.mark.parametrize("name", ["alibi", "t5", "xpos", "fox", "path"])
def test_chunks_of_one_query_give_the_same_sums(name: str) -> None:
    q, k = torch.randn(2, 4, 33, 8), torch.randn(2, 4, 33, 8)
    encoding, pos = make(name), torch.arange(100, 133)
    features = layer_features(encoding, 2, 33)  # each chunk sees the features of the keys it sees
    whole = layer_sums(q, k, encoding, pos, max_scores=1 << 20, features=features)
    chunked = layer_sums(q, k, encoding, pos, max_scores=1, features=features)  # one query row per chunk
    for key in whole:
        torch.testing.assert_close(chunked[key], whole[key], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", [*SCHEMES, "rope+alibi", ["rope", "nope"]], ids=str)
def test_statistics_are_those_of_the_layers_attention_maps(name) -> None:
    encoding = {"name": "learned", "max_positions": 64} if name == "learned" else name
    model = Decoder(encoding=encoding, vocab_size=VOCAB, dim=32, depth=2, heads=4, attention="auto").eval()
    windows = torch.randint(0, VOCAB, (3, 20))
    rows = attention_statistics(model, windows, tokens_per_batch=40, max_scores=64)  # two batches, many chunks
    assert [(r["layer"], r["head"]) for r in rows] == [(layer, head) for layer in range(2) for head in range(4)]
    distance = (torch.arange(20)[:, None] - torch.arange(20)[None, :]).clamp(min=0).float()
    for layer in range(2):
        maps = model.attention_maps(windows, layer)[:, :, 1:]  # (B, H, L-1, L): every query but the first
        expected = {
            "distance": (maps * distance[1:]).sum(-1).mean(dim=(0, 2)),
            "entropy": torch.special.entr(maps).sum(-1).mean(dim=(0, 2)),
            "sink": maps[..., 0].mean(dim=(0, 2)),
            "explicit": torch.zeros(4),  # no sink of the model's own (tests/test_sinks.py: with one)
        }
        for stat in STATS:
            got = torch.tensor([r[stat] for r in rows if r["layer"] == layer])
            torch.testing.assert_close(got, expected[stat].double().float(), atol=1e-5, rtol=1e-5)


def test_mean_by_length_averages_heads_and_layers() -> None:
    rows = [{"length": n, "layer": layer, "head": 0, "sink": n * 10 + layer} for n in (2, 1) for layer in (0, 1)]
    assert mean_by_length(rows, "sink") == ([1, 2], [10.5, 20.5])
    assert mean_by_length(rows, "sink", layer=1) == ([1, 2], [11.0, 21.0])


def test_a_run_evaluated_under_two_protocols_counts_once_in_the_report() -> None:
    # Both protocols measure the statistics on the same windows: the report keeps the nonoverlapping evaluation's,
    # and the columns split by scheme only, not by protocol.
    from posenc.report.attention import attention_groups

    def result(run: str, mode: str, sink: float) -> dict:
        stats = [{"length": 64, "layer": 0, "head": 0, "sink": sink, "distance": 1.0, "entropy": 1.0, "explicit": 0}]
        return {
            "label": "alibi",
            "train_len": 64,
            "seed": int(run[-1]),
            "run_name": run,
            "data": {"corpus": "stdlib"},
            "eval": {"mode": mode},
            "attention_stats": stats,
            "_source": f"/runs/{run}/eval_{mode}/results.json",
        }

    results = [
        result(f"alibi-L64-s{s}", mode, 0.1 if mode == "nonoverlap" else 0.9)
        for s in (0, 1)
        for mode in ("sliding", "nonoverlap")
    ]
    groups = attention_groups(results)
    [(key, columns)] = groups.items()
    assert key == (64, "stdlib") and len(columns) == 1
    [runs] = columns.values()
    assert sorted(run["seed"] for run in runs) == [0, 1] and {run["eval"]["mode"] for run in runs} == {"nonoverlap"}
