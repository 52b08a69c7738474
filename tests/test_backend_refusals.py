"""A backend that cannot honour a scheme says so before a run's first step, in the line it would raise mid-run.

Each backend lists the checks by which it turns a scheme down from its declarations; the backend runs them on every
call, and a run asks them while it checks its config. The two must agree for every scheme of the registry.
"""

from __future__ import annotations

import pytest
import torch
from conftest import HEAD_DIM, HEADS, SCHEMES, layer_features, make
from helpers import compose_train

from posenc.attention import get_backend, scheme_refusal
from posenc.config import to_container
from posenc.runs import RunError
from posenc.runs.checks import check_model

BACKENDS = ("sdpa", "flex", "flex_learnable", "triton", "eager", "scheme", "auto")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", SCHEMES)
def test_a_refusal_asked_up_front_is_the_one_the_call_raises(name: str, backend: str) -> None:
    encoding = make(name)
    refusal = scheme_refusal(backend, encoding)
    if refusal is None:
        return  # accepted by declaration: whether the call runs is the backends' own tests' business
    assert "\n" not in refusal and "use attention=" in refusal.lower()
    length = 8
    q, k = (torch.randn(1, HEADS, length, HEAD_DIM * encoding.qk_width) for _ in range(2))
    v = torch.randn(1, HEADS, length, HEAD_DIM)
    pos = torch.arange(length)
    with torch.no_grad(), pytest.raises(ValueError) as raised:
        get_backend(backend)(q, k, v, encoding, pos, pos, features=layer_features(encoding, 1, length))
    assert str(raised.value) == refusal


def test_backends_that_pick_or_reference_refuse_nothing() -> None:
    assert all(scheme_refusal(backend, make(name)) is None for backend in ("eager", "auto") for name in SCHEMES)


@pytest.mark.parametrize(
    ("encoding", "attention", "expected"),
    [
        ("stick_breaking", "sdpa", "attention=sdpa runs softmax"),
        ("cope", "flex", "attention=flex cannot apply cope's content-dependent bias"),
        ("pope", "triton", "attention=triton needs q, k and v of one head width"),
    ],
)
def test_a_run_refuses_before_its_first_step(encoding: str, attention: str, expected: str) -> None:
    config = to_container(compose_train(f"+encoding={encoding}", f"attention={attention}"))
    with pytest.raises(RunError, match=f"^invalid attention setting: {expected}"):
        check_model(config)
