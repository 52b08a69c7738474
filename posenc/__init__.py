"""posenc: train the same decoder with each positional scheme and compare how each extrapolates."""

__version__ = "0.1.0"
