"""Every JSON file posenc writes is strict JSON."""

from __future__ import annotations

import json
import math

import numpy as np

from posenc.jsonio import clean, dumps


def test_non_finite_floats_become_null_and_numpy_becomes_python() -> None:
    data = {"ppl": math.nan, "rows": [math.inf, 1.5, np.float32(2.0), (np.int64(3),)], "ok": "x"}
    assert clean(data) == {"ppl": None, "rows": [None, 1.5, 2.0, [3]], "ok": "x"}
    text = dumps(data)
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text)["rows"][2] == 2.0
