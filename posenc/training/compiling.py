"""When and how the model is compiled: each block with static shapes in training, nothing compiled in evaluation.

The design follows measurements on an H100 (torch 2.11): compiled blocks crashed at the first training
step for ALiBi and T5 (a garbage shape from aot_autograd's ``gen_alias_from_base``, cf. pytorch/pytorch#185630)
when torch's automatic dynamic shapes recompiled them with a symbolic batch and length, the validation batches
having another shape than the training ones; with automatic dynamic shapes off, the same runs trained and
evaluated. So:

- training compiles each block with ``dynamic=False``: the training shape and the validation shape(s) each get a
  static graph (train and eval modes are separate graphs anyway), a handful per scheme type;
- evaluation at 1×…32× the training length runs the blocks uncompiled (``eager_blocks``): one static graph per
  evaluation shape would cost a compilation each for a single forward pass. The attention inside stays on its
  compiled kernels (FlexAttention and the rotation compile themselves on CUDA), so nothing materialises scores;
- nothing falls back silently: past the recompile limit dynamo raises (``forbid_recompile_fallback``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from posenc.attention.flex import forbid_recompile_fallback
from posenc.model import Decoder
from posenc.runtime import eager_modules as eager_blocks  # evaluation runs the compiled blocks uncompiled

__all__ = ["compile_blocks", "eager_blocks", "should_compile"]


def should_compile(setting: str | bool, accelerator: str) -> bool:
    """Resolve the ``compile`` setting: ``true``, ``false``, or ``auto`` = on for a CUDA GPU only.

    Compiling on CPU costs more time than it saves in short runs, and the CPU test suite must stay fast.
    """
    if isinstance(setting, bool):
        return setting
    if setting not in ("auto", "true", "false"):
        raise ValueError(f"compile must be auto, true or false, got {setting!r}")
    if setting != "auto":
        return setting == "true"
    return accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()


def compile_blocks(model: Decoder, backend: str | Callable[..., Any] = "inductor") -> None:
    """Compile each transformer block in place with static shapes (``Block.compile``: state_dict keys unchanged).

    Per block rather than the whole model: every block shares one compiled graph per scheme type and shape, so
    compile time does not grow with depth. See the module docstring for why the shapes are static.
    """
    forbid_recompile_fallback()
    for block in model.blocks:
        block.compile(backend=backend, dynamic=False)
