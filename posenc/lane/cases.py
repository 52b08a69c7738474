"""What the kernel lane compiles: one case per scheme, path (``flex`` or ``flex_learnable``), dtype and head dim.

The schemes come from the registry and what each declares (a position bias; learnable or not; gradient forms,
``flex_learnable.supports``; read from a distance table, ``tables.reads_table``), plus two stacks built by
declaration: every fixed bias together, and every bias with gradient forms together. Which shapes each scheme is
compiled at is decided here; how a case is compiled is ``posenc.lane.flex``'s.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from posenc.attention.flex_learnable import supports
from posenc.attention.tables import reads_table
from posenc.encodings import available, build
from posenc.encodings.base import PositionalEncoding

HEADS, LENGTH = 4, 1024  # one batch row: the kernels do not depend on B, and 1024 is a multiple of every tile
HEAD_DIMS = (64, 128)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class Case:
    """One path of one scheme at one dtype and head dim, in training (forward and backward) or evaluation."""

    scheme: str
    path: str
    dtype: str
    head_dim: int
    training: bool

    @property
    def refused(self) -> bool:
        """The scheme declares that FlexAttention cannot differentiate its score_mod: its backward must fail here."""
        if self.path != "flex" or not self.training:
            return False
        encoding = build(self.scheme, num_heads=HEADS, head_dim=self.head_dim)
        return encoding.learnable_bias and not encoding.score_mod_differentiable

    @property
    def label(self) -> str:
        return f"{self.scheme} {self.path} {'train' if self.training else 'eval'} {self.dtype} d{self.head_dim}"


@dataclass
class StageResult:
    """What compiling one stage of a case gave: ``ok``, or the first line of its error; the template kernels."""

    case: Case
    stage: str
    ok: bool
    error: str | None
    seconds: float
    kernels: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            **vars(self.case),
            "stage": self.stage,
            "ok": self.ok,
            "error": self.error,
            "seconds": round(self.seconds, 2),
            "kernels": self.kernels,
        }


def not_on_flex(encoding: PositionalEncoding) -> str | None:
    """Why no CUDA path of this scheme reaches FlexAttention, from what it declares; ``None`` when one does."""
    if encoding.supplies_attention:
        return "supplies its own attention, which no FlexAttention kernel computes (auto: scheme)"
    if encoding.adds_content_bias:
        return "its bias reads queries and keys, which a score_mod cannot (auto: sdpa)"
    if not encoding.adds_bias:
        return "no attention bias: SDPA's own kernels run it (auto: sdpa)"
    return None


def skipped() -> dict[str, str]:
    """{scheme: why the lane compiles nothing for it} over the registry: the schemes no FlexAttention path takes."""
    reasons = {name: not_on_flex(build(name, num_heads=HEADS, head_dim=64)) for name in available()}
    return {name: reason for name, reason in reasons.items() if reason}


def schemes() -> list[str]:
    """Registry schemes whose bias FlexAttention can apply, and the two stacks built by what the schemes declare."""
    single = [name for name in available() if not_on_flex(build(name, num_heads=HEADS, head_dim=64)) is None]
    built = {name: build(name, num_heads=HEADS, head_dim=64) for name in single}
    fixed = [name for name in single if not built[name].learnable_bias]
    with_forms = [name for name in single if built[name].learnable_bias and supports(built[name])]
    stacks = ["+".join(group) for group in (fixed, with_forms) if len(group) > 1]
    return single + stacks


def cases(names: list[str] | None = None) -> list[Case]:
    """Every case the lane compiles: per scheme, the paths training and evaluation can take on CUDA.

    Evaluation's forward is training's without the log-sum-exp written out (the same tiles and shared memory): it is
    compiled on its own only for a scheme that ``auto`` trains elsewhere (FIRE, through sdpa). Every learnable scheme's
    flex backward is compiled, ``auto``'s path or not (``attention=flex`` takes it), with its trainable buffers, so
    Inductor's checks on the score_mod's joint graph run for each; a scheme that declares FlexAttention cannot
    differentiate it must be refused there (checked at one dtype and head dim: the refusal depends on neither).

    A scheme read from its distance table (``tables.reads_table``) runs the same FlexAttention kernels as every other
    such scheme of its kind (a fixed table, or one that trains): only the small graph that computes the table is its
    own. The first scheme of each kind is compiled at every dtype and head dim, and the others at one, which compiles
    each one's table graph and each kernel at every shape, in half the lane's time.
    """
    out = []
    first_of_kind: dict[bool, str] = {}
    for name in names or schemes():
        encoding = build(name, num_heads=HEADS, head_dim=64)
        reason = not_on_flex(encoding)
        if reason is not None:
            raise ValueError(f"the lane has nothing to compile for {name}: it {reason}")
        every_shape = not reads_table(encoding) or first_of_kind.setdefault(encoding.learnable_bias, name) == name
        trains_on_flex = not encoding.learnable_bias or encoding.score_mod_differentiable
        paths = [("flex", True)] if trains_on_flex else [("flex", False), ("flex", True)]
        if encoding.learnable_bias and supports(encoding):
            paths.append(("flex_learnable", True))
        for (path, training), dtype, head_dim in itertools.product(paths, DTYPES, HEAD_DIMS):
            case = Case(name, path, dtype, head_dim, training)
            first_shape = (dtype, head_dim) == (next(iter(DTYPES)), HEAD_DIMS[0])
            if first_shape or (every_shape and not case.refused):
                out.append(case)
    return out
