"""posenc: train the same decoder with each positional scheme and compare how each extrapolates."""

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``posenc.load_run`` (see ``posenc/api.py``), imported on first use so ``import posenc`` stays light."""
    if name == "load_run":
        from posenc.api import load_run

        return load_run
    raise AttributeError(f"module 'posenc' has no attribute {name!r}")
