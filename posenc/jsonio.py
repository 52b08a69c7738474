"""Strict JSON for every file posenc writes (results, run summaries, sweep records, benchmarks).

``json.dumps`` writes non-finite floats as the bare tokens ``NaN``/``Infinity``, which are not JSON (a browser, jq
or W&B's importer rejects them), and its ``default`` hook is never called for floats, so they cannot be fixed
there. Values are cleaned before dumping instead: non-finite floats become ``null`` (a refused length has no
perplexity), numpy scalars become Python numbers, anything else unknown becomes its string.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np


def clean(value: Any) -> Any:
    """``value`` with non-finite floats as ``None`` and numpy scalars as Python numbers, recursively."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {key: clean(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [clean(item) for item in value]
    return value


def dumps(data: Any, indent: int = 2) -> str:
    """Strict JSON text of ``data`` (see the module docstring); raises rather than write NaN."""
    return json.dumps(clean(data), indent=indent, default=str, allow_nan=False)
