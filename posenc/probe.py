"""Look inside attention: every layer's rotated queries and keys, and the probabilities the reference computes.

Hooks on each layer's attention read its input during an ordinary forward and recompute q and k through the
layer's own ``project`` (the same rotation the layer applies); probabilities come from the dense reference
(``attention_weights``: rotate, bias through the contract, causal softmax; or the dense weights of a scheme that
supplies its own attention), so they are what every backend is tested to compute, whatever backend the model runs.
Compiled blocks run uncompiled here (``eager_modules``), so the hooks fire, while the attention inside keeps its
compiled kernels. A layer's sink (``posenc/attention/sink.py``) comes with its q and k: the probabilities then hold
its columns in front of the keys, and a map shows the keys' part (each row summing to 1 minus what the sink took).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from posenc.attention.eager import attention_weights
from posenc.attention.sink import SinkColumns
from posenc.encodings.base import PositionalEncoding
from posenc.runtime import eager_modules

# visit(layer index, rotated q (B, H, L, D), rotated k (B, H, L, D), the layer's scheme, positions (L,), the keys'
# features (B, L, F) for a scheme that reads the layer's input, else None, the layer's sink columns, else None, and
# its window: a local layer's, else None)
Visit = Callable[[int, Tensor, Tensor, PositionalEncoding, Tensor, Tensor | None, SinkColumns | None, int | None], None]

MAX_MAP_ELEMENTS = 1 << 26  # one layer's (B, H, L, L) maps: 256 MiB of fp32


@torch.no_grad()
def visit_layers(model: nn.Module, tokens: Tensor, visit: Visit) -> Tensor:
    """Run ``model(tokens)`` (a ``Decoder``) and call ``visit`` with each layer's rotated q and k; return logits."""
    handles = []
    for index, block in enumerate(model.blocks):

        def hook(attention: nn.Module, args: tuple, index: int = index) -> None:
            x, pos = args[0], args[1]
            q, k, _, k_pos, features, sink = attention.project(x, pos)
            visit(index, q, k, attention.encoding, k_pos, features, sink, attention.window)

        handles.append(block.attn.register_forward_pre_hook(hook))
    try:
        with eager_modules(model):
            return model(tokens)
    finally:
        for handle in handles:
            handle.remove()


def attention_maps(model: nn.Module, tokens: Tensor, layer: int) -> Tensor:
    """Layer ``layer``'s attention probabilities (B, H, L, L), fp32, for inputs short enough to hold them.

    With a sink, the keys' columns: each row sums to 1 minus what the sink took.
    """
    depth = len(model.blocks)
    if not -depth <= layer < depth:
        raise ValueError(f"layer {layer} does not exist: the model has {depth} layers (0..{depth - 1})")
    batch, length = tokens.shape
    heads = model.blocks[layer].attn.heads
    if batch * heads * length * length > MAX_MAP_ELEMENTS:
        raise ValueError(
            f"attention maps of {batch}×{heads}×{length}×{length} are too large to return: pass a shorter or smaller "
            "batch, or use attention statistics (eval.attention_stats=true), which never hold a whole map"
        )
    wanted = layer % depth
    maps: list[Tensor] = []

    def keep(
        index: int,
        q: Tensor,
        k: Tensor,
        encoding: PositionalEncoding,
        pos: Tensor,
        features: Tensor | None,
        sink: SinkColumns | None,
        window: int | None,
    ) -> None:
        if index == wanted:
            weights = attention_weights(q, k, encoding, pos, pos, features, sink, window)
            maps.append(weights if sink is None else weights[..., sink.width :])

    was_training = model.training
    model.eval()
    try:
        visit_layers(model, tokens, keep)
    finally:
        model.train(was_training)
    return maps[0]
