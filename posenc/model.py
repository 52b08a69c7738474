"""The one decoder backbone every scheme shares. It asks the scheme; it never names one.

Positions reach the model in exactly two places, both through the scheme contract:
the input (``embed``, for absolute schemes, applied once) and every attention layer (``rotate`` on q and k, then
the bias through the attention backend). Each layer holds its own scheme instance, so learnable biases are per
layer (as in KERPLE's and T5's code) and a per-layer schedule (``["rope", "rope", "rope", "nope"]``) is nothing
more than building a different instance for some layers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from posenc import decoding, probe
from posenc.attention import decoding_backend, get_backend
from posenc.attention.sink import Sink, SinkColumns, refuse_sink
from posenc.attention.window import check_window
from posenc.encodings.base import PositionalEncoding
from posenc.layout import EncodingSpec, build_layers, encoding_label

INITS = ("gpt2", "pytorch")  # the backbone's initialisation: GPT-2's (std 0.02) or every module's PyTorch default


class Attention(nn.Module):
    """Causal multi-head self-attention; the scheme rotates q, k and the backend applies its bias (and the sink).

    ``window``: a local layer's (its queries see the last ``window`` positions, ``posenc/attention/window.py``);
    ``None`` for a global layer.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        encoding: PositionalEncoding,
        backend: str,
        sink: Sink | None = None,
        window: int | None = None,
    ) -> None:
        super().__init__()
        check_window(window)
        self.window = window
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.encoding = encoding
        self.sink = sink
        self.backend_name = backend
        self.backend = get_backend(backend)

    def project(
        self, x: Tensor, pos: Tensor, cache: decoding.LayerCache | None = None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None, SinkColumns | None]:
        """Rotated q (B, H, Lq, D), rotated k and v (B, H, Lk, D) over every visible position, and those positions.

        Then the keys' features (B, Lk, F) when the scheme reads the layer's input (``None`` otherwise), and the
        sink's columns (``None`` without one). Sink tokens are rotated with the keys, in front of them (at the
        window's first position), and handed over apart: the window's keys and positions stay its own.
        """
        q, k, v = rearrange(self.qkv(x), "b l (three h d) -> three b h l d", three=3, h=self.heads)
        features = self.encoding.token_features(x)
        k_pos, origin = pos, pos[:1]
        if cache is not None:  # keys are cached unrotated and rotated with the new queries (see posenc/decoding.py)
            k, v, k_pos, features = cache.extend(k, v, pos, features, self.window)
            origin = cache.origin
        if self.sink is None:
            q, k = self.encoding.rotate(q, k, pos, k_pos)
            return q, k, v, k_pos, features, None
        k, v, rotated_pos = self.sink.in_front(k, v, k_pos, origin)
        q, k = self.encoding.rotate(q, k, pos, rotated_pos)
        columns, k, v = self.sink.columns(k, v, rotated_pos)
        return q, k, v, k_pos, features, columns

    def forward(self, x: Tensor, pos: Tensor, cache: decoding.LayerCache | None = None) -> Tensor:
        q, k, v, k_pos, features, sink = self.project(x, pos, cache)
        backend = self.backend if cache is None else get_backend(decoding_backend(self.backend_name, self.encoding))
        out = backend(q, k, v, self.encoding, pos, k_pos, features=features, sink=sink, window=self.window)
        return self.proj(rearrange(out, "b h l d -> b l (h d)"))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(
        self,
        dim: int,
        heads: int,
        encoding: PositionalEncoding,
        backend: str,
        mlp_ratio: int,
        dropout: float,
        sink: Sink | None = None,
        window: int | None = None,
    ) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(dim)
        self.attn = Attention(dim, heads, encoding, backend, sink, window)
        self.mlp_norm = nn.RMSNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim, bias=False), nn.GELU(), nn.Linear(mlp_ratio * dim, dim, bias=False)
        )
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, pos: Tensor, cache: decoding.LayerCache | None = None) -> Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), pos, cache))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class Decoder(nn.Module):
    """Decoder-only transformer: tokens (B, L) → logits (B, L, vocab_size).

    ``encoding`` is a scheme name (``"alibi"``), a stack (``"rope+alibi"``), a per-layer schedule cycled over
    the layers (``["rope", "rope", "rope", "nope"]``: layer i gets entry i mod 4), a config mapping
    ``{"name": ..., **options}`` (flat options for one scheme; keyed by member name for stacks and schedules),
    or a built ``PositionalEncoding`` shared by every layer. ``context_scaling`` (``{method, factor,
    original_length}``) stretches its rotary schemes for training at a longer length (``_scale_context``). ``sink``
    gives every layer's attention a sink, whatever its scheme (``posenc/attention/sink.py``): ``none``, ``zero``,
    ``learned`` or ``tokens`` (``sink_tokens`` of them).
    """

    def __init__(
        self,
        encoding: EncodingSpec,
        vocab_size: int,
        dim: int = 128,
        depth: int = 4,
        heads: int = 4,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        attention: str = "auto",
        tie_embeddings: bool = True,
        init: str = "gpt2",
        context_scaling: Mapping[str, Any] | None = None,
        sink: str = "none",
        sink_tokens: int = 1,
    ) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim={dim} must be divisible by heads={heads}")
        if init not in INITS:
            raise ValueError(f"model init must be one of {', '.join(INITS)}, got {init!r}")
        if init == "pytorch" and tie_embeddings:
            raise ValueError(
                "model init=pytorch keeps embeddings at N(0, 1), which as a tied output head gives logits of std "
                f"≈ √dim = {math.sqrt(dim):.0f} at the start: set model.tie_embeddings=false with it"
            )
        head_dim = dim // heads
        self.label = encoding_label(encoding)
        self.input_encoding, layer_encodings, windows = build_layers(encoding, depth, heads, head_dim)
        self.token_embedding = nn.Embedding(vocab_size, dim)
        for layer_encoding in dict.fromkeys(layer_encodings):
            refuse_sink(layer_encoding, sink)
        if sink_tokens != 1 and sink != "tokens":
            raise ValueError(
                f"model.sink_tokens={sink_tokens} counts sink tokens, and model.sink={sink}: set sink=tokens"
            )
        self.sink = sink
        self.blocks = nn.ModuleList(
            Block(
                dim,
                heads,
                layer_encodings[i],
                attention,
                mlp_ratio,
                dropout,
                self._sink(heads, head_dim, sink_tokens),
                windows[i],
            )
            for i in range(depth)
        )
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        if init == "gpt2":
            self._init_gpt2(depth, tie_embeddings)
        if tie_embeddings:
            self.head.weight = self.token_embedding.weight
        self.context_scaling = self._scale_context(context_scaling) if context_scaling else None

    def _sink(self, heads: int, head_dim: int, tokens: int) -> Sink | None:
        """One layer's sink (each layer its own logits or tokens), or ``None`` for ``sink=none``."""
        return None if self.sink == "none" else Sink(self.sink, heads, head_dim, tokens)

    def _init_gpt2(self, depth: int, tie_embeddings: bool) -> None:
        """GPT-2's initialisation of the backbone: std 0.02, residual projections scaled by 1/√(2·depth).

        The scaling keeps the residual stream's variance from growing with depth; schemes initialise their own
        parameters either way. ``init="pytorch"`` skips this and keeps every module's own default (embeddings
        N(0, 1), linear layers uniform in ±1/√fan_in). The choice changes how fast an induction circuit forms: on
        MQAR (64 tokens, 4 pairs, 2 layers × 128, RoPE, lr 3e-3, batch 32, seed 0) the GPT-2 initialisation held
        0.23 accuracy after 1,500 steps, under the keyless floor of 0.25, while PyTorch's defaults with an untied
        head reached 0.89 at step 700 and 1.00 at 1,500 (README, "Associative recall by length").
        """
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        for block in self.blocks:
            nn.init.normal_(block.attn.qkv.weight, std=0.02)
            nn.init.normal_(block.mlp[0].weight, std=0.02)
            for proj in (block.attn.proj, block.mlp[-1]):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * depth))
        if not tie_embeddings:
            nn.init.normal_(self.head.weight, std=0.02)

    def _scale_context(self, scaling: Mapping[str, Any]) -> dict[str, Any]:
        """Stretch the schemes that can be (RoPE) for training, as ``eval.rope_scaling`` does for an evaluation.

        Position interpolation (Chen et al., 2023, §3) and YaRN (Peng et al., 2024, §4) fine-tune with the scaling
        already applied. Built into the model, it holds in training, in the checkpoint's rebuilt model and in every
        later evaluation alike.
        """
        missing = [key for key in ("method", "factor", "original_length") if scaling.get(key) is None]
        if missing:
            raise ValueError(
                f"model.context_scaling={dict(scaling)} lacks {', '.join(missing)}: give all three, e.g. "
                "model.context_scaling={method:yarn,factor:4,original_length:64}"
            )
        method, factor, original_length = (
            str(scaling["method"]),
            float(scaling["factor"]),
            int(scaling["original_length"]),
        )
        encodings = {id(e): e for e in [self.input_encoding, *self.layer_encodings] if e is not None}.values()
        if not any([encoding.set_context_scaling(method, factor, original_length) for encoding in encodings]):
            raise ValueError(
                f"model.context_scaling needs a scheme that can be stretched (RoPE); {self.label} has none"
            )
        return {"method": method, "factor": factor, "original_length": original_length}

    @property
    def layer_windows(self) -> list[int | None]:
        """Each layer's window (``None``: global), in order."""
        return [block.attn.window for block in self.blocks]

    @property
    def layer_encodings(self) -> list[PositionalEncoding]:
        """The scheme each layer uses, in order (for inspection and tests)."""
        return [block.attn.encoding for block in self.blocks]

    def scheme_parameters(self) -> dict[str, nn.Parameter]:
        """{name in the state dict: parameter} of every trainable parameter of a positional scheme, each once.

        Found by structure (any ``PositionalEncoding`` submodule: the input's and every layer's), never by a scheme's
        name: what the optimiser treats apart (no weight decay, its own learning rate) and what a run watches move.
        """
        owned = {id(p) for m in self.modules() if isinstance(m, PositionalEncoding) for p in m.parameters()}
        return {name: p for name, p in self.named_parameters() if id(p) in owned and p.requires_grad}

    @property
    def scheme_names(self) -> list[str]:
        """Names of every single scheme the model uses, once each (for tags and filters)."""
        encodings = [e for e in [self.input_encoding, *self.layer_encodings] if e is not None]
        return list(dict.fromkeys(member.name for e in encodings for member in e.members))

    @property
    def max_positions(self) -> int | None:
        limits = [e.max_positions for e in [self.input_encoding, *self.layer_encodings] if e is not None]
        finite = [limit for limit in limits if limit is not None]
        return min(finite) if finite else None

    def check_length(self, length: int) -> None:
        """Raise a clear error when any scheme in the model cannot handle ``length`` positions."""
        for encoding in {id(e): e for e in [self.input_encoding, *self.layer_encodings] if e is not None}.values():
            encoding.check_length(length)

    def constrain_(self) -> None:
        """Project scheme parameters back into range (called after each optimiser step)."""
        for module in self.modules():
            if isinstance(module, PositionalEncoding) and module is not self:
                module.constrain_()

    def forward(self, tokens: Tensor, offset: int = 0, cache: decoding.KVCache | None = None) -> Tensor:
        """Logits (B, L, V); with a ``cache``, ``tokens`` continue the cached ones (positions from ``cache.length``)."""
        length = tokens.shape[1]
        if cache is not None:
            offset = cache.length
        self.check_length(offset + length)
        pos = torch.arange(offset, offset + length, device=tokens.device)
        x = self.token_embedding(tokens)
        if self.input_encoding is not None:
            x = self.input_encoding.embed(x, pos)
        for index, block in enumerate(self.blocks):
            x = block(x, pos) if cache is None else block(x, pos, cache.layers[index])
        return self.head(self.norm(x))

    def loss(self, tokens: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy in nats, computed in fp32."""
        logits = self(tokens)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def generate(
        self,
        tokens: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """``tokens`` (B, L) continued by ``max_new_tokens`` tokens with a KV cache (temperature 0: greedy)."""
        return decoding.generate(self, tokens, max_new_tokens, temperature, top_k, generator)

    def attention_maps(self, tokens: Tensor, layer: int) -> Tensor:
        """Layer ``layer``'s attention probabilities (B, H, L, L) for short ``tokens`` (B, L), from the reference."""
        return probe.attention_maps(self, tokens, layer)
