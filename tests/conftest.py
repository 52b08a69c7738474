"""Offline, isolated test environment: no W&B network, no HF hub, caches and outputs in tmp dirs."""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels can only run under Triton's interpreter, which must be chosen before triton is
# first imported (importing posenc does); nothing else here can use triton without a GPU, and torch reads the
# variable only on its GPU paths. With a GPU it stays unset, so tests/test_triton_table.py runs compiled kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["WANDB_MODE"] = "disabled"
os.environ["WANDB_SILENT"] = "true"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

from posenc.encodings import available, build

HEADS, HEAD_DIM = 4, 8


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ["POSENC_CACHE"] = str(tmp_path_factory.mktemp("posenc-cache"))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def cuda_branches(monkeypatch: pytest.MonkeyPatch):
    """The CUDA-only branches on CPU tensors, FlexAttention's dense backward allowed on CPU, a fresh dynamo."""
    import torch.nn.attention.flex_attention as flex_module

    import posenc.attention.flex as flex
    from posenc.runtime import forced_cuda_path

    monkeypatch.setattr(flex_module, "_validate_device", lambda *args, **kwargs: None)
    torch._dynamo.reset()
    with forced_cuda_path(), warnings.catch_warnings():
        # As on CUDA: FlexAttention run unfused (every score materialised) is an error, not a warning.
        warnings.filterwarnings("error", message=flex.FALLBACK_WARNING, category=UserWarning)
        yield
    torch._dynamo.reset()


@pytest.fixture
def flex_backward_on_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """FlexAttention uncompiled, with its dense backward allowed on CPU tensors, for the backends' CUDA branches."""
    import torch.nn.attention.flex_attention as flex_module

    import posenc.attention.flex as flex

    monkeypatch.setattr(flex_module, "_validate_device", lambda *args, **kwargs: None)
    monkeypatch.setattr(flex, "compiled_flex_attention", lambda: flex_module.flex_attention)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=flex.FALLBACK_WARNING)
        yield


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator:
    """A one-node SLURM cluster on this machine for the session (``posenc.cluster.local``); skipped without SLURM.

    Its daemons are stopped by their process ids at the end, after its jobs are cancelled; nothing that used the
    cluster may outlive it (a process still carrying its ``SLURM_CONF`` fails the session's teardown).
    """
    from posenc.cluster import local

    reason = local.unavailable()
    if reason:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="posenc-slurm-"))  # under /tmp: munged wants every parent open to all
    try:
        cluster = local.start(root)
        yield cluster
    finally:
        local.stop(root)
        left = local.processes(local.LocalCluster(root))
        shutil.rmtree(root, ignore_errors=True)
    assert not left, f"processes of the test cluster still running: {left}"


def make(name: str, heads: int = HEADS, head_dim: int = HEAD_DIM, **cfg):
    """Build a scheme for tests, giving learned tables room for the lengths tests use."""
    if name == "learned":
        cfg.setdefault("max_positions", 512)
    return build(name, num_heads=heads, head_dim=head_dim, **cfg)


def layer_features(enc, batch: int, length: int, requires_grad: bool = False):
    """What the attention layer passes a scheme that reads its input: ``token_features`` of a random input x (B, L,
    dim), or ``None`` for a scheme that reads only q and k. With ``requires_grad`` the features carry x's gradient."""
    if not enc.reads_layer_input:
        return None
    x = torch.randn(batch, length, enc.num_heads * enc.head_dim, requires_grad=requires_grad)
    return enc.token_features(x)


SCHEMES = available()
BIAS_SCHEMES = [n for n in SCHEMES if make(n).adds_bias]
# Position biases that are a function of i - j alone (FIRE's also depends on the query position past its threshold).
DISTANCE_BIAS_SCHEMES = [n for n in BIAS_SCHEMES if make(n).distance_only]
CONTENT_SCHEMES = [n for n in SCHEMES if make(n).adds_content_bias]
RELATIVE_SCHEMES = [n for n in SCHEMES if not make(n).absolute]
# Of those, the ones whose scores depend on m − n alone (every one but a scheme that says it is not).
SHIFT_INVARIANT = [n for n in RELATIVE_SCHEMES if make(n).shift_invariant]
# Schemes whose attention is their own (not softmax(q·kᵀ/√D + bias)): their attend against their dense weights.
SUPPLIED_SCHEMES = [n for n in SCHEMES if make(n).supplies_attention]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``-m gpu`` is the quick GPU check (≤ 5 min): its speed tests run only when asked (``-m "gpu and slow"``)."""
    if "slow" in (config.option.markexpr or ""):
        return
    speed = [item for item in items if item.get_closest_marker("gpu") and item.get_closest_marker("slow")]
    if speed:
        config.hook.pytest_deselected(items=speed)
        items[:] = [item for item in items if item not in speed]
