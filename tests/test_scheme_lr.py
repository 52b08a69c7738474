"""The positional schemes' own learning rate: an optimizer group at lr × optim.scheme_lr_multiplier."""

from __future__ import annotations

import pytest
from helpers import FAST, compose_train

from posenc.config import to_container
from posenc.runs import RunError, validate
from posenc.training.lit import LitDecoder, warmup_cosine


def _optimizer(*overrides: str):
    config = to_container(compose_train(*FAST, *overrides))
    module = LitDecoder(config, vocab_size=256)
    configured = module.configure_optimizers()
    return module, configured["optimizer"], configured["lr_scheduler"]["scheduler"], config["optim"]


def test_scheme_parameters_get_their_own_group_at_lr_times_the_multiplier_under_the_schedule() -> None:
    module, optimizer, schedule, optim = _optimizer("+encoding=kerple_log", "optim.scheme_lr_multiplier=10")
    assert len(optimizer.param_groups) == 3
    scheme_group = optimizer.param_groups[2]
    assert {id(p) for p in scheme_group["params"]} == {id(p) for p in module.model.scheme_parameters().values()}
    assert scheme_group["weight_decay"] == 0.0 and len(scheme_group["params"]) == 8  # r1, r2 of 4 layers
    others = {id(p) for group in optimizer.param_groups[:2] for p in group["params"]}
    assert not others & {id(p) for p in scheme_group["params"]}
    for step in range(5):
        factor = warmup_cosine(step, optim["warmup_steps"], 3, optim["min_lr_ratio"])
        assert optimizer.param_groups[0]["lr"] == pytest.approx(optim["lr"] * factor)
        assert scheme_group["lr"] == pytest.approx(optim["lr"] * 10 * factor)
        optimizer.step()
        schedule.step()


def test_the_default_multiplier_is_the_models_lr_and_fixed_schemes_keep_two_groups() -> None:
    _, optimizer, _, optim = _optimizer("+encoding=t5")
    assert optim["scheme_lr_multiplier"] == 1.0
    assert optimizer.param_groups[2]["lr"] == optimizer.param_groups[0]["lr"]
    _, fixed, _, _ = _optimizer("+encoding=alibi")
    assert len(fixed.param_groups) == 2


@pytest.mark.parametrize("value", [0, -1.0, True])
def test_a_multiplier_that_is_not_positive_is_refused(value: object) -> None:
    config = to_container(compose_train(*FAST, "+encoding=t5"))
    config["optim"]["scheme_lr_multiplier"] = value
    with pytest.raises(RunError, match=r"optim\.scheme_lr_multiplier=.* must be a positive number"):
        validate(config)
