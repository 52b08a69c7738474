"""Settings in units of the training length, and the coverage line a run prints before its first step."""

from __future__ import annotations

import inspect

import pytest
import torch
from helpers import compose_train

from posenc.config import to_container
from posenc.encodings import available, build, scheme_class
from posenc.encodings.forms import LengthScaled
from posenc.encodings.length import coverage, coverage_lines, scale_to_length
from posenc.model import Decoder
from posenc.runs import DONE_FILE, resolve_length_settings, write_json
from posenc.training.sweep import job_state


@pytest.mark.parametrize("name", [n for n in available() if scheme_class(n).length_settings])
def test_every_length_setting_is_a_constructor_argument(name: str) -> None:
    accepted = inspect.signature(scheme_class(name).__init__).parameters
    for setting, rule in scheme_class(name).length_settings.items():
        assert setting in accepted, f"{name} declares {setting} but does not take it"
        assert isinstance(rule, LengthScaled) and rule.paper


def test_t5_keeps_its_papers_ratios_and_every_bucket_trains() -> None:
    spec, record = scale_to_length({"name": "t5", "num_buckets": None}, 512)
    assert (spec["num_buckets"], spec["max_distance"]) == (32, 128)  # the paper's own setting at its own length
    spec, record = scale_to_length({"name": "t5"}, 64)
    assert (spec["num_buckets"], spec["max_distance"]) == (4, 16)
    assert record["num_buckets"]["rule"].startswith("L/16")
    t5 = build("t5", num_heads=2, head_dim=8, **{k: v for k, v in spec.items() if k != "name"})
    assert t5.coverage(64) == []
    reached = set(t5.bucket(torch.arange(64)).tolist())
    assert reached == set(range(4))


def test_unscaled_t5_names_the_buckets_training_never_reaches() -> None:
    model = Decoder(encoding={"name": "t5", "num_buckets": 32, "max_distance": 128}, vocab_size=257, dim=16, depth=2,
                    heads=2)  # fmt: skip
    record = coverage(model, 64)
    assert len(record["gaps"]) == 1  # one line for the scheme, not one per layer
    (line,) = coverage_lines(record)
    assert "buckets 27–31 of 32" in line and "past distance 63" in line
    assert record["gaps"][0]["unreached"] == 5


def test_fire_threshold_and_learned_rows_past_the_length_are_said() -> None:
    fire = build("fire", num_heads=2, head_dim=8, init_threshold=512)
    assert "threshold starts at 512" in fire.coverage(64)[0]["note"]
    assert build("fire", num_heads=2, head_dim=8, init_threshold=16).coverage(64) == []
    learned = build("learned", num_heads=2, head_dim=8, max_positions=128)
    assert learned.coverage(64)[0]["unreached"] == 64
    assert build("cope", num_heads=2, head_dim=8, num_positions=200).coverage(64)[0]["unreached"] == 135


def test_given_and_inherited_settings_win_over_the_rule() -> None:
    spec, record = scale_to_length({"name": "t5", "num_buckets": 8, "max_distance": None}, 256)
    assert spec["num_buckets"] == 8 and record["num_buckets"]["rule"] == "given"
    assert spec["max_distance"] == 64
    parent = {"name": ["rope", "t5"], "t5": {"num_buckets": 4, "max_distance": 16}}
    spec, record = scale_to_length({"name": ["rope", "t5"]}, 256, inherited=parent)
    assert spec["t5"] == {"num_buckets": 4, "max_distance": 16}  # a fine-tuned table keeps its parent's shape
    assert record["t5.num_buckets"]["rule"] == "inherited"
    spec, _ = scale_to_length({"name": "rope+ssmax", "rope": {"base": 500}}, 100)
    assert spec["ssmax"] == {"train_length": 100} and spec["rope"] == {"base": 500}


def test_a_relaunched_sweep_accepts_the_settings_its_jobs_resolved(tmp_path) -> None:
    launched = to_container(compose_train("+encoding=t5"))
    finished = resolve_length_settings(launched)
    write_json(tmp_path / DONE_FILE, {"config": finished, "steps": 3})
    assert job_state(tmp_path, launched).finished
