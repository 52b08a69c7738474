"""``scheme``: the scheme's own attention, for a scheme that supplies one (``supplies_attention``).

Such a scheme changes how scores are formed (PaTH's Householder products) or normalised (stick-breaking), so no
softmax(q·kᵀ/√D + bias) kernel computes it; it offers a fast path of its own, ``attend`` (memory bounded per block of
rows, exact against its dense ``attention_weights``, which the ``eager`` backend runs). This backend calls it, over a
query suffix as well (cached decoding falls back to it), and refuses any other scheme in one line: every other scheme
runs on the backends that compute softmax(q·kᵀ/√D + bias). A sink is refused too: the scheme's attention has no softmax
row for its columns to join (the model refuses the pair before it is built, ``sink.refuse_sink``).
"""

from __future__ import annotations

from torch import Tensor

from posenc.attention import register_backend
from posenc.attention.sink import SinkColumns
from posenc.attention.window import refuse_window
from posenc.encodings.base import PositionalEncoding


@register_backend("scheme", query_suffix=True)
def scheme_attention(
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
    refuse_window("scheme", window, f"a global layer for {encoding.label}, whose attention is its own")
    if sink is not None:
        raise ValueError(f"attention=scheme runs {encoding.label}'s own attention, which has no softmax row for a sink")
    if not encoding.supplies_attention:
        raise ValueError(
            f"attention=scheme runs a scheme's own attention, and {encoding.label} supplies none (it is a bias or a "
            "rotation on softmax attention); use attention=auto, sdpa, flex or eager"
        )
    return encoding.attend(q, k, v, q_pos, k_pos, features)
