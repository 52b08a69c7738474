"""``auto``: the fastest backend that honours the scheme on the device at hand, chosen per call.

- no bias, any device → ``sdpa`` (flash / cuDNN on GPU; RoPE and xPos rotate q, k before it);
- a fixed bias on CUDA (ALiBi, or a learnable one whose parameters are frozen) → ``flex``: the score_mod fused in
  the kernel with a cached causal block mask, O(L) memory;
- a learnable bias on CUDA → ``flex_learnable``: the same forward, a constant-bias backward, and the parameters'
  gradients from the identities the scheme declares (``bias_gradient_forms``), avoiding FlexAttention's per-score
  atomics; a learnable scheme that declares none stays on ``flex`` (one atomic add per trainable value read, per
  score), unless it declares that FlexAttention cannot differentiate its score_mod (``score_mod_differentiable``:
  FIRE's MLP, which Inductor cannot lower): it then trains through ``sdpa`` with its dense bias in query chunks, and
  evaluates (no gradients) through ``flex``;
- a bias on CPU → ``sdpa`` with the bias as a chunked mask (FlexAttention has no CPU backward, and SDPA is the
  faster CPU path anyway);
- a content-dependent bias (CoPE, DAPE, data-dependent ALiBi, FoX), any device → ``sdpa`` with the bias computed
  per query chunk: a score_mod sees positions only, so ``flex`` and ``flex_learnable`` refuse it;
- a scheme that supplies its own attention (PaTH, stick-breaking), any device → ``scheme``: the scheme's own
  memory-bounded ``attend`` (no softmax kernel computes it; ``sdpa``, ``flex`` and ``flex_learnable`` refuse it, and
  ``triton`` every one but stick-breaking's, whose ``stick_form`` its fused kernel runs);
- a local (sliding-window) layer on CUDA: ``flex`` for a scheme without a bias or with a fixed one (its block mask
  skips the blocks outside the window, where SDPA would need a dense mask and leave its flash kernels); a learnable
  bias trains through ``sdpa``, since ``flex_learnable`` refuses a window and FlexAttention's own backward of a
  trainable score_mod failed compiled (torch 2.11, ``aot_eager``: KERPLE-log, global or local alike), and evaluates
  through ``flex``;
- a sink (``posenc/attention/sink.py``) on CUDA with no bias → ``flex``, which merges it through its row lse in one
  fused kernel (SDPA would take the sink as a wider key and leave its flash kernels); a biased scheme keeps the
  choices above, each of which takes a sink;
- a distance-only bias on a GPU class where a recorded measurement found ``triton`` (one fused kernel reading the
  distance table, its gradient reduced per distance inside the backward) faster than the choice above, for that kind
  of bias (``MEASURED_FASTER``) → ``triton``; likewise stick-breaking's fused kernel against ``scheme`` (the kind
  "stick"). None is recorded yet: their GPU speed has not been measured, so ``auto`` keeps the choices above on every
  GPU. A shape or mode the kernels refuse (``triton_fits``) keeps the choice without them.

The choice reads only what the scheme declares (``supplies_attention``, ``stick_form``, ``adds_content_bias``,
``adds_bias``, ``learnable_bias``, ``bias_gradient_forms``, ``score_mod_differentiable``, ``distance_only``), whether
there is a sink, whether gradients are being recorded, and for ``MEASURED_FASTER`` the GPU's compute capability. A run
records what it resolved to (``resolved``, in ``run.json``'s ``train_conditions``), as the benchmark does beside every
``auto`` row.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posenc.attention import get_backend, register_backend
from posenc.attention.flex_learnable import supports
from posenc.attention.sink import SinkColumns
from posenc.attention.tables import reads_table
from posenc.encodings.base import PositionalEncoding
from posenc.runtime import cuda_path

# GPU classes (compute capability) on which a GPU session measured ``attention=triton`` faster than ``auto``'s other
# choice, per kind of kernel (a "learnable" or "fixed" distance table, or "stick": stick-breaking's), in the same
# process and shape. An entry cites its measurement in docs/benchmarks.md; without one, auto keeps its other choice.
# Nothing is measured yet.
MEASURED_FASTER: dict[tuple[int, int], frozenset[str]] = {}


def kernel_kind(encoding: PositionalEncoding) -> str | None:
    """Which kernel ``triton`` would run: "stick", "learnable", "fixed", or ``None`` (none: it would refuse)."""
    if encoding.supplies_attention:
        return "stick" if encoding.stick_form() is not None and encoding.qk_width == 1 else None
    if not reads_table(encoding) or encoding.qk_width != 1:
        return None
    return "learnable" if encoding.learnable_bias else "fixed"


def choose(
    encoding: PositionalEncoding,
    is_cuda: bool,
    training: bool = True,
    capability: tuple[int, int] | None = None,
    sink: bool = False,
    local: bool = False,
) -> str:
    """Name of the backend ``auto`` uses for this scheme (with a sink or not, local layer or not) on this device."""
    measured = MEASURED_FASTER.get(capability, frozenset()) if capability is not None else frozenset()
    if is_cuda and kernel_kind(encoding) in measured:
        return "triton"
    if encoding.supplies_attention:
        return "scheme"
    if encoding.adds_content_bias or not is_cuda:
        return "sdpa"
    if not encoding.adds_bias:
        return "flex" if sink or local else "sdpa"
    if local and training and encoding.learnable_bias:
        return "sdpa"
    if encoding.learnable_bias and supports(encoding) and not local:
        return "flex_learnable"
    if training and encoding.learnable_bias and not encoding.score_mod_differentiable:
        return "sdpa"
    return "flex"


def resolved(
    backend: str,
    encodings: list[PositionalEncoding],
    device: torch.device,
    training: bool = True,
    sink: bool = False,
    windows: list[int | None] | None = None,
) -> dict:
    """{scheme label: the backend it runs on} for a model built with ``backend``: what a run records it trained with.

    ``windows``: each layer's (``Decoder.layer_windows``); a local layer's scheme is labelled ``local-<label>``.
    """
    cuda = device.type == "cuda"
    capability = torch.cuda.get_device_capability(device) if cuda and MEASURED_FASTER else None
    windows = windows or [None] * len(encodings)
    choices = {}
    for enc, window in zip(encodings, windows, strict=True):
        local = window is not None
        label = f"local-{enc.label}" if local else enc.label
        choices[label] = choose(enc, cuda, training, capability, sink, local) if backend == "auto" else backend
    return choices


def triton_fits(q: Tensor, k: Tensor, encoding: PositionalEncoding) -> bool:
    """Self-attention over one window at a head dim and dtype the kernels take, in a mode they take."""
    from posenc.attention.triton_stick import refuse_deterministic
    from posenc.attention.triton_table import check_shape

    try:
        check_shape(q.shape[-1], q.dtype)
        if kernel_kind(encoding) == "stick":
            refuse_deterministic(torch.is_grad_enabled())
    except ValueError:
        return False
    return q.shape[-2] == k.shape[-2]


@register_backend("auto")
def auto_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    encoding: PositionalEncoding,
    q_pos: Tensor,
    k_pos: Tensor,
    features: Tensor | None = None,
    sink: SinkColumns | None = None,
    window: int | None = None,
) -> Tensor:
    # The GPU class is asked only once a measurement is recorded for one: today's choice needs no device query.
    capability = torch.cuda.get_device_capability(q.device) if q.is_cuda and MEASURED_FASTER else None
    training, has_sink = torch.is_grad_enabled(), sink is not None
    local = window is not None
    backend = choose(encoding, cuda_path(q), training, capability, has_sink, local)
    if backend == "triton" and not triton_fits(q, k, encoding):  # a shape the kernels refuse: the choice without them
        backend = choose(encoding, cuda_path(q), training, sink=has_sink, local=local)
    return get_backend(backend)(q, k, v, encoding, q_pos, k_pos, features=features, sink=sink, window=window)
