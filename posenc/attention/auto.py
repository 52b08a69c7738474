"""``auto``: the fastest backend that honours the scheme on the device at hand, chosen per call.

- no bias, any device → ``sdpa`` (flash / cuDNN on GPU);
- a bias on CUDA → ``flex`` (score_mod fused in the kernel, O(L) memory);
- a bias on CPU → ``sdpa`` with the bias as a chunked mask (FlexAttention has no CPU backward).
"""

from __future__ import annotations

from torch import Tensor

from posenc.attention import get_backend, register_backend
from posenc.encodings.base import PositionalEncoding


def choose(encoding: PositionalEncoding, is_cuda: bool) -> str:
    """Name of the backend ``auto`` uses for this scheme on this kind of device."""
    if encoding.adds_bias and is_cuda:
        return "flex"
    return "sdpa"


@register_backend("auto")
def auto_attention(
    q: Tensor, k: Tensor, v: Tensor, encoding: PositionalEncoding, q_pos: Tensor, k_pos: Tensor
) -> Tensor:
    return get_backend(choose(encoding, q.is_cuda))(q, k, v, encoding, q_pos, k_pos)
