"""Stability recorded in every run: the spike rule on hand-built series, the largest attention logit against a direct
computation, the record in run.json and in a diverged run's failed.json, a resume, and no host reads between logs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import FAST, HostReads, compose_train

import posenc.model
import posenc.training.stability as stability
from posenc.model import Decoder
from posenc.runs import FAILED_FILE, RunError
from posenc.train import train
from posenc.training.stability import SPIKE_WINDOW, StabilityMonitor, max_attention_logit, spikes


def _steady(steps: int) -> torch.Tensor:
    """1 ± 0.01 in turn: over any 128 steps the mean is 1 and the standard deviation 0.01, so 6σ above is 1.06."""
    return 1 + 0.01 * torch.tensor([(-1.0) ** t for t in range(steps)])


def test_a_spike_is_six_deviations_above_the_128_steps_before() -> None:
    series = _steady(300)
    series[60] = 50.0  # fewer than 128 steps before it: never judged
    series[200], series[250] = 1.07, 1.05  # above 1.06, below it
    found = spikes(series)
    assert found.tolist() == [200]
    series[60] = 1.0
    assert spikes(series[:200]).tolist() == []  # nothing before the spike is one
    # Counted piece by piece, as a run counts at each logging step, the spikes are the same.
    pieces = [spikes(series[:end], start=begin) for begin, end in ((0, 150), (150, 201), (201, 300))]
    assert torch.cat(pieces).tolist() == found.tolist()


def test_a_spike_stays_in_the_window_of_the_steps_after_it() -> None:
    series = _steady(SPIKE_WINDOW + 2)
    series[SPIKE_WINDOW], series[SPIKE_WINDOW + 1] = 1.5, 1.2
    # Step 129's window holds the spike: mean ≈ 1.004, deviation ≈ 0.045, so 6σ above is ≈ 1.275 and 1.2 is no spike
    # (it would be one against the steady 1.06).
    assert spikes(series).tolist() == [SPIKE_WINDOW]


def test_the_largest_attention_logit_is_the_largest_scaled_product_of_query_and_key() -> None:
    torch.manual_seed(0)
    model = Decoder("nope", vocab_size=30, dim=32, depth=2, heads=4, attention="sdpa").eval()
    tokens = torch.randint(0, 30, (1, 12))
    inputs = []
    hooks = [block.attn.register_forward_pre_hook(lambda m, args: inputs.append(args[0])) for block in model.blocks]
    with torch.no_grad():
        model(tokens)
    for hook in hooks:
        hook.remove()
    expected = -math.inf
    for block, x in zip(model.blocks, inputs, strict=True):  # NoPE: no rotation, the projections alone
        q, k, _ = block.attn.qkv(x).view(1, 12, 3, 4, 8).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(~torch.ones(12, 12).tril().bool(), -math.inf)
        expected = max(expected, scores.max().item())
    assert max_attention_logit(model, tokens) == pytest.approx(expected, rel=1e-5)


def _stub(step: int, log_every: int = 10**6) -> SimpleNamespace:
    return SimpleNamespace(global_step=step, log_every_n_steps=log_every)


BATCH = (torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))


def _fed(monitor: StabilityMonitor, losses: torch.Tensor, norms: torch.Tensor) -> StabilityMonitor:
    module = SimpleNamespace(device=torch.device("cpu"))
    monitor.setup(None, module, "fit")
    for step, (loss, norm) in enumerate(zip(losses, norms, strict=True), start=1):
        module.grad_norm = norm
        monitor.on_train_batch_end(_stub(step), module, {"loss": loss}, BATCH, 0)
    return monitor


def test_the_record_counts_spikes_and_takes_the_norms_percentiles() -> None:
    losses, norms = _steady(200), _steady(200) * 2
    losses[150], norms[180] = 3.0, 9.0
    record = _fed(StabilityMonitor(200), losses, norms).record()
    assert record["steps"] == 200 and "6 standard deviations above the mean of the 128 steps" in record["rule"]
    assert record["initial_loss"] == pytest.approx(float(losses[0]))
    assert (record["loss_spikes"], record["loss_spike_steps"]) == (1, [151])  # steps count from 1
    assert (record["grad_norm_spikes"], record["grad_norm_spike_steps"]) == (1, [181])
    norm = record["grad_norm"]
    assert norm["p50"] <= norm["p90"] <= norm["p99"] <= norm["max"] == pytest.approx(9.0)
    assert norm["p50"] == pytest.approx(float(torch.quantile(norms.double(), 0.5)))


def test_a_resumed_monitor_counts_over_every_step() -> None:
    losses, norms = _steady(200), _steady(200)
    losses[190] = 3.0
    first = _fed(StabilityMonitor(200), losses[:140], norms[:140])
    resumed = StabilityMonitor(200)
    resumed.load_state_dict(first.state_dict())
    module = SimpleNamespace(device=torch.device("cpu"))
    resumed.setup(None, module, "fit")
    for step in range(141, 201):
        module.grad_norm = norms[step - 1]
        resumed.on_train_batch_end(_stub(step), module, {"loss": losses[step - 1]}, BATCH, 0)
    assert resumed.record() == _fed(StabilityMonitor(200), losses, norms).record()


def test_a_step_between_logs_reads_nothing_back_to_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monitor = StabilityMonitor(10)
    module = SimpleNamespace(device=torch.device("cpu"), grad_norm=torch.tensor(1.0))
    monitor.setup(None, module, "fit")
    reads = HostReads(monkeypatch)
    for step in (1, 2, 3):
        monitor.on_train_batch_end(_stub(step, log_every=5), module, {"loss": torch.tensor(2.0)}, BATCH, 0)
    assert reads.calls == []


def test_a_run_records_its_stability(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stability, "LOGIT_EVERY", 4)
    overrides = [*FAST, "data=copy", "trainer.max_steps=6", "trainer.log_every_n_steps=1", "eval.at_end=false"]
    train(compose_train("+encoding=alibi", *overrides), tmp_path)
    record = json.loads((tmp_path / "run.json").read_text())["stability"]
    assert record["steps"] == 6 and record["loss_spikes"] == 0  # no step has 128 before it
    assert 0 < record["grad_norm"]["p50"] <= record["grad_norm"]["max"]
    logit = record["max_attention_logit"]
    assert logit["samples"] == 2 and logit["at_step"] in (4, 6)  # every fourth step, and the last
    assert math.isfinite(logit["max"]) and logit["max"] >= logit["last"]


def test_a_diverged_run_is_kept_as_diverged_with_its_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loss = posenc.model.Decoder.loss
    calls = []

    def poisoned(self, inputs, targets):
        calls.append(self.training)
        value = loss(self, inputs, targets)
        return value * float("nan") if sum(calls) >= 4 else value

    monkeypatch.setattr(posenc.model.Decoder, "loss", poisoned)
    overrides = [*FAST, "data=copy", "trainer.max_steps=6", "trainer.val_check_interval=100"]
    with pytest.raises(RunError, match="training diverged"):
        train(compose_train("+encoding=alibi", *overrides), tmp_path)
    failed = json.loads((tmp_path / FAILED_FILE).read_text())
    assert failed["diverged"] is True and failed["label"] == "alibi" and failed["step"] == 3
    assert failed["stability"]["steps"] == 4 and failed["stability"]["grad_norm"]["max"] > 0
