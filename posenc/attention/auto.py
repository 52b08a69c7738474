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
  memory-bounded ``attend`` (no softmax kernel computes it; ``sdpa``, ``flex``, ``flex_learnable`` and ``triton``
  refuse it).

The choice reads only what the scheme declares (``supplies_attention``, ``adds_content_bias``, ``adds_bias``,
``learnable_bias``, ``bias_gradient_forms``, ``score_mod_differentiable``) and whether gradients are being recorded.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posenc.attention import get_backend, register_backend
from posenc.attention.flex_learnable import supports
from posenc.encodings.base import PositionalEncoding
from posenc.runtime import cuda_path


def choose(encoding: PositionalEncoding, is_cuda: bool, training: bool = True) -> str:
    """Name of the backend ``auto`` uses for this scheme on this kind of device, training or not."""
    if encoding.supplies_attention:
        return "scheme"
    if encoding.adds_content_bias or not encoding.adds_bias or not is_cuda:
        return "sdpa"
    if encoding.learnable_bias and supports(encoding):
        return "flex_learnable"
    if training and encoding.learnable_bias and not encoding.score_mod_differentiable:
        return "sdpa"
    return "flex"


@register_backend("auto")
def auto_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    encoding: PositionalEncoding,
    q_pos: Tensor,
    k_pos: Tensor,
    features: Tensor | None = None,
) -> Tensor:
    backend = choose(encoding, cuda_path(q), training=torch.is_grad_enabled())
    return get_backend(backend)(q, k, v, encoding, q_pos, k_pos, features=features)
