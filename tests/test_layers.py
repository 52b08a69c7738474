"""The package's shape: every module imports only downward, and no file grows past what one reads at a sitting.

Entry points sit on top, run bookkeeping and data below them, the model, attention and the schemes at the bottom.
An import that points upward is how a low layer starts depending on a high one (a scheme that reads the training
config, an attention backend that knows the report): this test names the import and both layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "posenc"

# Top-level module or package → layer; a module may import only from strictly lower layers (or itself).
LAYERS = {
    "runtime": 0,
    "jsonio": 0,
    "encodings": 1,
    "schema": 1,  # the config schema: pydantic models of every key, read by the config, run checks and entry points
    "attention": 2,
    "probe": 3,
    "decoding": 3,
    "layout": 3,  # how an encoding spec becomes layers: each layer's scheme and kind (global or local)
    "model": 4,
    "training.compiling": 5,
    "training.stability": 5,  # per-layer stability measures over the model's attention, read by the loop and report
    "config": 5,
    "data": 5,
    "training.lit": 6,
    "runs": 7,
    "training.identity": 8,
    "api": 8,
    "training.sweep": 8,
    "evaluate": 9,
    "cluster": 9,  # the SLURM launcher (above the sweep's bookkeeping) and the local cluster
    "training.callbacks": 9,
    "training.console": 9,  # what the console and train.log show of a run: Lightning's own lines, quieted
    "training.watch": 10,  # a run's callbacks and its summary: above the evaluation they run, below the loop
    "training.loop": 10.5,
    "report": 10,
    "bench": 11,
    "gpu": 11,  # the GPU check and session: they run the training, the benchmark and pytest as subprocesses
    "gpucheck": 12,  # entry points only: python -m posenc.gpucheck, python -m posenc.gpusession
    "gpusession": 12,
    "lane": 11,  # the kernel lane: a tool over the attention backends, like the benchmark
    "train": 11,
    "training": 12,  # the folder's __init__: a docstring, importing nothing
    "": 12,  # the package itself: posenc/__init__.py
}
MAX_LINES = 420
# Folders whose modules keep a layer each: training's pieces sit at different depths (the compile switch just above
# the model, the Lightning module below the run directory's code, the loop above the evaluation it ends with).
SPLIT = {"training"}


def _top(module: str) -> str:
    """``posenc.attention.sdpa`` → ``attention``; ``posenc.training.lit`` → ``training.lit``; ``posenc`` → ``""``."""
    parts = module.split(".")
    if len(parts) > 2 and parts[1] in SPLIT:
        return f"{parts[1]}.{parts[2]}"
    return parts[1] if len(parts) > 1 else ""


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level posenc module) of every posenc import in ``path``, function-level imports included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "posenc":
            if node.module == "posenc":  # from posenc import decoding, probe: the names are the modules
                found += [(node.lineno, alias.name) for alias in node.names]
            else:
                found.append((node.lineno, _top(node.module)))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, _top(a.name)) for a in node.names if a.name.split(".")[0] == "posenc"]
    return found


def _owner(path: Path) -> str:
    relative = path.relative_to(PACKAGE).with_suffix("")
    if relative.parts[0] in SPLIT and len(relative.parts) > 1:
        return relative.parts[0] if relative.parts[1] == "__init__" else f"{relative.parts[0]}.{relative.parts[1]}"
    return "" if relative.parts == ("__init__",) else relative.parts[0]


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_import_points_downward(path: Path) -> None:
    owner = _owner(path)
    assert owner in LAYERS, f"{owner!r} has no layer: add it to LAYERS in {Path(__file__).name}"
    for line, imported in _imports(path):
        if imported == owner:
            continue
        assert imported in LAYERS, f"{path.name}:{line} imports {imported!r}, which has no layer in LAYERS"
        assert LAYERS[imported] < LAYERS[owner], (
            f"{path.relative_to(PACKAGE.parent)}:{line} imports posenc.{imported} (layer {LAYERS[imported]}) "
            f"from {owner or 'posenc'} (layer {LAYERS[owner]}): a module imports only from lower layers"
        )


def test_the_layer_table_covers_the_package_and_nothing_else() -> None:
    present = {_owner(path) for path in _modules()}
    assert present == set(LAYERS), f"missing: {present - set(LAYERS)}; gone: {set(LAYERS) - present}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_files_stay_short(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE.parent)} has {lines} lines: split it by what it does"
