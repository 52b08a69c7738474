"""The contract every positional scheme implements.

A scheme *declares* what it does to a decoder and the backbone composes it; nothing outside
`posenc/encodings/` ever tests a scheme's name. Four words make up the contract:

- ``embed(x, pos)``: absolute schemes add position information to the token embeddings once, at the input.
- ``rotate(q, k, q_pos, k_pos)``: rotary schemes transform queries and keys inside every attention layer.
- ``bias(q_pos, k_pos)``: the dense additive attention bias, computed the obvious way. It is the *reference*
  that every fast path is tested against, never the fast path itself.
- ``score_mod()``: the same bias as a FlexAttention score modification, so no (L × L) tensor is ever built.

Schemes whose bias depends on the *content* of queries and keys (CoPE, DAPE, data-dependent ALiBi) cannot be a
position table at all; they declare ``adds_content_bias`` and offer a fifth word:

- ``content_bias(q, k, q_pos, k_pos)``: the fp32 bias (B, H, Lq, Lk) computed from the (already rotated) queries
  and keys. Row i may read only q_i and the keys at positions ≤ q_pos[i], never a key's position index in the
  tensor: a KV-cached decoder calls attention with new queries over every cached key (Lq ≠ Lk, ``k_pos`` a
  prefix containing ``q_pos``), and must get exactly the rows the full computation gives. Backends that work from
  positions alone (FlexAttention's score_mod) refuse such a scheme; eager and sdpa add it chunk by chunk.

A content bias that varies along each softmax row only through a per-key term, content_bias[..., i, j] = r_i +
t_j on the keys row i sees (data-dependent ALiBi: the query's cumulative log-gate minus the key's), may also say so:

- ``key_bias(k, k_pos)``: t (B, H, Lk) in fp32, or ``None``. Softmax ignores r_i, so a backend may fold t into one
  extra channel of q·kᵀ (a 1 in every query, t / scale in every key) and run a fused kernel with no (Lq × Lk)
  tensor at all. ``content_bias`` stays the reference the folded path is tested against.

A content bias that reads the attention's own scaled scores (CoPE's gates, DAPE's MLP input) declares
``reads_scores``: a backend that has computed q·kᵀ/√D passes them as ``scores`` rather than have the scheme compute
them a second time.

Every backend scales the scores by 1/√(width of the q it receives). A scheme whose ``rotate`` returns q and k wider
than the head (``qk_width``: PoPE's polar form, twice the head) sets the temperature it intends inside ``rotate``
(PoPE multiplies q by √2, so the backends' 1/√(2D) is its paper's 1/√D); v keeps the head width, and a backend
whose kernel needs q, k and v of one width refuses such a scheme.

Schemes that read the layer's *input* x (B, L, dim), the normed residual stream the attention projects q, k and v
from, rather than only q and k (FoX's forget gate, PaTH's Householder vectors), declare ``reads_layer_input`` and
offer:

- ``token_features(x)``: per-token features (B, L, F) in fp32, one row per position. The attention layer computes
  them beside q, k and v and passes the keys' rows to the backend (``features``, Lk rows: the queries' own are its
  last Lq); a KV cache stores them beside the keys, so new queries over cached keys see every key's features and get
  exactly the full computation's rows. Every word that reads content (``content_bias``, ``key_bias``,
  ``attention_weights``, ``attend``) takes them as ``features``; a function of several positions' features (a
  causal convolution) is computed there, over the keys, not in ``token_features``.

Schemes whose attention is not softmax(q·kᵀ/√D + bias) at all, by how scores are formed (PaTH's products of
Householder transformations between key and query) or how they are normalised (stick-breaking: weights from a stick
broken key by key, not a normalised exponential), declare ``supplies_attention``: there is no score a bias could be
added to, and a backend that computes a softmax would compute another attention. They offer two words, both taking
the keys' ``features`` (``None`` for a scheme that does not read the layer's input, and ignored by one whose
attention reads only q and k):

- ``attention_weights(q, k, q_pos, k_pos, features)``: the dense fp32 weights (B, H, Lq, Lk) of the (already
  rotated) queries over the keys, with which the output is weights · v, computed the obvious way. It is the
  reference, and what the eager backend, attention maps and attention statistics read. Each row is a distribution
  over the keys at positions ≤ q_pos[i] and follows the query-suffix rule of ``content_bias`` (cached decoding must
  get the full computation's rows).
- ``attend(q, k, v, q_pos, k_pos, features)``: the same output (B, H, Lq, D) on the scheme's fast path, without an
  (Lq × Lk) tensor: memory bounded per block of rows, values and gradients equal to the reference's, over a query
  suffix too.

The ``scheme`` backend runs ``attend``, ``auto`` picks it, and cached decoding falls back to it; every backend that
computes softmax(q·kᵀ/√D + bias) (``sdpa``, ``flex``, ``flex_learnable``) refuses such a scheme in one line
(``posenc.attention.refuse_supplied_attention``). One whose attention is stick-breaking's, a stick broken from the
nearest earlier key outwards with β_ij = σ(q_i·k_j/√D), may say so, and ``triton`` then runs it in a fused kernel:

- ``stick_form()``: a ``StickForm`` (where the stick's remainder goes, and what the heads' output passes through
  after), or ``None`` (the default). ``attention_weights`` stays the reference the kernel is tested against.

Schemes whose bias depends only on the distance ``i - j`` also offer ``distance_bias(num_distances)``, the
bias as an (H, D) table indexed by distance: an O(H·L) form fast backends use (and differentiate) instead of
the O(L²) matrix. Offering it is the declaration (``distance_only``): every fast path then reads the table in place
of ``score_mod`` and ``bias`` (``posenc/attention/tables.py``), which stay the reference the table is tested against.

Schemes with a *learnable* bias may also say how its parameters can be differentiated without a per-score
gradient (``bias_gradient_forms``): FlexAttention differentiates a score_mod that reads a trainable tensor with
one atomic add per score, which makes its backward hundreds of times slower than the forward
(``docs/learnable-bias-gradient.md``). Two exact forms avoid that, one per identity of that document:

- ``DerivativeForm`` (Identity 1): ∂b_h(i, j)/∂θ_h = scale_h · f_h(i, j) with f ≥ 0, so the gradient of θ is one
  extra attention forward with the scores shifted by log f. For smooth parametric biases (KERPLE).
- ``TableForm`` (Identity 2): b_h(d) = table[h, index[min(d, horizon)]], constant from distance ``horizon`` on, so
  a band of ``horizon`` diagonals of dS gives every entry's gradient and the last one is minus their sum (every
  row of dS sums to zero). For bucketed tables (T5).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from posenc.encodings.forms import BiasGradientForm, LengthScaled, ScoreMod, StickForm


class PositionalEncoding(nn.Module):
    """Base class: the identity scheme (no position information at all).

    Subclasses override only the words they use. Class attributes let backbones and backends plan without
    calling anything:

    - ``name``: the registry key.
    - ``absolute``: ``embed`` does something, so the scheme acts once on the input, not per layer.
    - ``adds_bias``: ``bias``/``score_mod`` are not ``None``.
    - ``rotates``: ``rotate`` is not the identity.
    - ``shift_invariant``: a scheme acting in attention whose scores depend on positions only through m − n, so a
      window scores the same wherever it starts; False where ``rotate`` is not a rotation (FoPE's mixed waves).
    - ``adds_content_bias``: ``content_bias`` is not ``None`` (a bias that reads q and k, not only positions).
    - ``reads_layer_input``: ``token_features`` is not ``None`` (per-token features read from the layer's input x).
    - ``supplies_attention``: ``attention_weights``/``attend`` are the attention itself, in place of
      softmax(q·kᵀ/√D + bias); there is no score to bias.
    - ``own_sink``: for such a scheme, what in its attention already takes the attention no key takes, in words (said
      when ``model.sink`` is refused with it, ``posenc/attention/sink.py``); empty when nothing does.
    - ``score_mod_differentiable``: FlexAttention may differentiate ``score_mod`` with respect to its parameters.
    - ``score_mod_reads_table``: ``score_mod`` gathers from a table at a per-score index (smaller kernel tiles).
    - ``max_positions``: ``None`` when any length is accepted; a number when the scheme cannot go further.
    - ``qk_width``: ``rotate`` returns q and k of ``qk_width`` × ``head_dim`` channels (v keeps ``head_dim``).
    - ``scales_with_length``: ``rotate`` multiplies q by a function of the number of keys each query sees (SSMax's
      s · log n), so an evaluation-time length scaling (``eval.attention_scale``) would apply twice.
    - ``length_settings``: {constructor argument: ``LengthScaled``} of the settings its paper chose for the length
      it trained at (T5's buckets, FIRE's threshold); a run resolves each one it is not given from its own training
      length (``posenc/encodings/length.py``).
    """

    name: ClassVar[str] = "base"
    absolute: ClassVar[bool] = False
    adds_bias: ClassVar[bool] = False
    rotates: ClassVar[bool] = False
    shift_invariant: ClassVar[bool] = True
    adds_content_bias: ClassVar[bool] = False
    reads_scores: ClassVar[bool] = False  # content_bias reads q·kᵀ/√D, which a backend may pass it (``scores``)
    reads_layer_input: ClassVar[bool] = False
    supplies_attention: ClassVar[bool] = False
    own_sink: ClassVar[str] = ""
    # FlexAttention can differentiate the score_mod's trainable tensors on a GPU. Inductor lowers a score_mod's
    # gradient only for trainable tensors read by index, each indexed once per score (its joint-graph check), and
    # adds into them atomically once per score. A scheme whose score_mod it cannot lower says False (FIRE's MLP: the
    # kernel lane shows the refusal on every GPU), and backends then train its bias another way.
    score_mod_differentiable: ClassVar[bool] = True
    # The score_mod reads a tensor at an index computed per score (a table by distance or bucket). FlexAttention's
    # kernels then lay the gathered values out beside their tiles, which with torch's default tiles overflows a GPU's
    # shared memory; backends give such schemes smaller tiles (``attention/flex.py``, ``kernel_options``).
    score_mod_reads_table: ClassVar[bool] = False
    qk_width: ClassVar[int] = 1
    scales_with_length: ClassVar[bool] = False
    length_settings: ClassVar[Mapping[str, LengthScaled]] = {}

    def __init__(self, num_heads: int, head_dim: int) -> None:
        super().__init__()
        if num_heads < 1 or head_dim < 1:
            raise ValueError(f"num_heads and head_dim must be positive, got {num_heads=} {head_dim=}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.max_positions: int | None = None

    @classmethod
    def label_of(cls, options: Mapping[str, Any]) -> str:
        """The readable name of this scheme built with ``options`` (a config's, before building it).

        Its name, unless a variant of it must read apart wherever runs are named and compared: two forms of one
        scheme in one sweep would otherwise share a run directory, a report column and a tuned setting.
        """
        return cls.name

    @property
    def label(self) -> str:
        """Readable name used in run names, W&B tags and reports."""
        return self.label_of({})

    @property
    def members(self) -> list[PositionalEncoding]:
        """The single schemes this one is made of (itself, unless it is a stack)."""
        return [self]

    @property
    def learnable_bias(self) -> bool:
        """True when the bias has trainable parameters, which changes how fast backends differentiate it."""
        return (self.adds_bias or self.adds_content_bias) and any(p.requires_grad for p in self.parameters())

    @property
    def distance_only(self) -> bool:
        """True when the bias is a function of ``i - j`` alone, so ``distance_bias`` describes it fully."""
        return type(self).distance_bias is not PositionalEncoding.distance_bias

    def bias_key(self) -> Hashable | None:
        """Everything ``bias`` depends on besides the positions, as a hashable value; ``None`` when it must be rebuilt.

        Equal keys mean equal biases, so a backend may build the dense bias once and reuse it for every layer whose
        scheme has the same key and for every window of the same positions. The key holds the values of every tensor
        and every plain setting of the scheme and its submodules: an optimiser step, ``constrain_``, a loaded
        checkpoint or a new setting changes the key, so a reused bias never goes stale, and two different schemes
        (or two layers with different parameters) never share one. There is no key for a content-dependent bias (it
        reads q and k), nor for a learnable one while autograd records (each layer's bias must carry its own
        gradient); under ``no_grad`` a learnable bias is a constant like any other.
        """
        if self.adds_content_bias or not self.adds_bias:
            return None
        if self.learnable_bias and torch.is_grad_enabled():
            return None
        parts = []
        for module in self.modules():
            plain = (bool, int, float, str, type(None))
            settings = tuple(sorted((k, v) for k, v in vars(module).items() if isinstance(v, plain)))
            tensors = tuple(
                (name, str(t.dtype), tuple(t.shape), t.detach().reshape(-1).cpu().view(torch.uint8).numpy().tobytes())
                for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
                if t is not None
            )
            parts.append((type(module), settings, tensors))
        return tuple(parts)

    def embed(self, x: Tensor, pos: Tensor) -> Tensor:
        """Return ``x`` (B, L, dim) with absolute position information for positions ``pos`` (L,) added."""
        return x

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        """Transform queries (B, H, Lq, D) and keys (B, H, Lk, D) at positions ``q_pos`` (Lq,), ``k_pos`` (Lk,)."""
        return q, k

    def bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
        """Dense fp32 bias (H, Lq, Lk) added to the scaled scores before the causal mask, or ``None``.

        Only entries with ``k_pos <= q_pos`` need to be meaningful: the causal mask removes the rest.
        """
        return None

    def content_bias(
        self,
        q: Tensor,
        k: Tensor,
        q_pos: Tensor,
        k_pos: Tensor,
        scores: Tensor | None = None,
        features: Tensor | None = None,
    ) -> Tensor | None:
        """fp32 bias (B, H, Lq, Lk) from queries (B, H, Lq, D) and keys (B, H, Lk, D), or ``None``.

        ``scores``, when a backend passes them, are the attention's own fp32 scaled scores q·kᵀ/√D of these q and
        k: a scheme that ``reads_scores`` uses them instead of computing them again. ``features`` (B, Lk, F) are the
        keys' ``token_features`` for a scheme that ``reads_layer_input``.

        Keys come in increasing position order. Row i may depend only on q_i and the keys with ``k_pos <= q_pos[i]``
        (see the module docstring: a query suffix over cached keys must get the full computation's rows); entries
        with ``k_pos > q_pos`` are masked by the backend and may hold anything finite.
        """
        return None

    def key_bias(self, k: Tensor, k_pos: Tensor, features: Tensor | None = None) -> Tensor | None:
        """The per-key term t (B, H, Lk) fp32 of a content bias r_i + t_j (see the module docstring), or ``None``.

        ``None`` (the default) when the content bias is not of that form; when it is, ``content_bias − t_j`` must be
        constant along j over each row's causal keys, which ``tests/test_zoo.py`` checks for every scheme.
        """
        return None

    def token_features(self, x: Tensor) -> Tensor | None:
        """fp32 features (B, L, F) of each position from the layer's input x (B, L, dim), or ``None`` (the default).

        Row t may depend on x_t alone: the features of a cached key never change when tokens follow it.
        """
        return None

    def require_features(self, features: Tensor | None) -> Tensor:
        """``features`` when given; one clear error when a backend or caller forgot to pass them."""
        if features is None:
            raise ValueError(
                f"{self.label} reads the layer's input: pass features=encoding.token_features(x) with the keys' rows"
            )
        return features

    def attention_weights(
        self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, features: Tensor | None = None
    ) -> Tensor:
        """Dense fp32 causal weights (B, H, Lq, Lk) that multiply v, for a scheme that ``supplies_attention``.

        Row i sums to 1 over the keys with ``k_pos <= q_pos[i]`` and is 0 elsewhere; it may read only q_i, those keys
        and their ``features`` (the query-suffix contract of ``content_bias``). The reference ``attend`` is tested
        against.
        """
        raise NotImplementedError(f"{self.label} does not supply its own attention")

    def weights_output(self, weights: Tensor, v: Tensor) -> Tensor:
        """The fp32 output (B, H, Lq, D) of dense ``attention_weights`` (B, H, Lq, Lk) over fp32 values (B, H, Lk, D).

        ``weights · v`` (the default): what ``eager`` computes for a scheme that ``supplies_attention``. A scheme whose
        weights leave part of each row to something other than a value (stick-breaking's remainder on a learned
        vector) or that transforms the heads' output overrides it, and its ``attend`` returns the same.
        """
        return torch.einsum("bhqk,bhkd->bhqd", weights, v)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, features: Tensor | None = None
    ) -> Tensor:
        """``weights_output(attention_weights, v)`` (B, H, Lq, D) in q's dtype on the fast path, no (Lq × Lk) tensor.

        Its sums stay in fp32 and its memory bounded per block of query rows; values and gradients equal the
        reference's.
        """
        raise NotImplementedError(f"{self.label} does not supply its own attention")

    def stick_form(self) -> StickForm | None:
        """How a fused stick-breaking kernel computes ``attend`` (module docstring), or ``None``: no such kernel can."""
        return None

    def set_context_scaling(self, method: str, factor: float, original_length: int) -> bool:
        """Stretch the scheme at evaluation to ``factor`` × ``original_length`` positions (RoPE's PI, NTK, YaRN).

        Returns whether the scheme has anything to stretch; setting it again replaces the previous setting.
        """
        return False

    def score_mod(self, detached: bool = False, num_distances: int | None = None) -> ScoreMod | None:
        """The bias as a FlexAttention score_mod over (q_idx, kv_idx), or ``None`` when there is no bias.

        It must equal ``bias`` for positions ``q_idx``, ``kv_idx`` and keep its arithmetic in fp32. With
        ``detached=True`` it reads its parameters detached: the same values, but FlexAttention then treats the bias
        as a constant, which a backend wants when it differentiates the parameters by ``bias_gradient_forms``.
        ``num_distances``, when a backend knows it (the window's length), bounds the causal distances the kernel asks
        for: a scheme whose per-score formula is costly may then read a table of that many entries instead, built
        once per call in O(H · L), as long as the result equals ``bias``.
        """
        if self.adds_bias:
            raise NotImplementedError(f"{self.name} adds a bias but offers no score_mod")
        return None

    def distance_bias(self, num_distances: int) -> Tensor:
        """fp32 bias (H, num_distances) for distances ``0 .. num_distances-1`` (only for distance-only schemes)."""
        raise NotImplementedError(f"{self.name}'s bias is not a function of distance alone")

    def bias_gradient_forms(self) -> list[BiasGradientForm] | None:
        """How to differentiate the bias's parameters without a gradient per score (see the module docstring).

        ``[]`` when there is nothing to differentiate; ``None`` when the scheme has a learnable bias but declares no
        such form (backends then differentiate the score_mod directly, correct but slow).
        """
        return None if self.learnable_bias else []

    def coverage(self, train_length: int) -> list[dict[str, Any]]:
        """The learnable positional parameters that training at ``train_length`` cannot reach, one entry each.

        Each entry is ``{"parameter", "note", "unreached", "of"}``: the note one line a user reads before the first
        step (what is unreached and what reads it). ``[]`` when training reaches every parameter (the default: a
        scheme without parameters, or one whose every parameter shapes the bias at every trained distance).
        """
        return []

    def learned_settings(self) -> dict[str, float]:
        """What settings that follow L trained to, for the record: a verdict may move with them (FIRE's threshold)."""
        return {}

    def constrain_(self) -> None:
        """Project parameters back into their valid range after an optimiser step (KERPLE's positivity)."""

    def check_length(self, length: int) -> None:
        """Fail clearly when asked for more positions than the scheme can represent."""
        if self.max_positions is not None and length > self.max_positions:
            raise ValueError(
                f"{self.label} supports at most {self.max_positions} positions but got a sequence of {length}; "
                "it cannot extrapolate: evaluate at or below its max_positions, or train it with a larger one"
            )

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, head_dim={self.head_dim}"


def distances(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """Causal distance ``i - j`` (Lq, Lk) as fp32, the quantity every relative bias is a function of."""
    return (q_pos[:, None] - k_pos[None, :]).to(torch.float32)
