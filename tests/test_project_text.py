"""The project speaks only of itself: its README, docs, code, tests and configs name nothing a user does not have.

A reader has this repository and pip; a tracker's numbers, paths outside the repository and tooling of the
people who built it mean nothing to them.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Built from pieces so that this file does not match itself.
FORBIDDEN = re.compile(
    "|".join(
        [
            r"issue [0-9]",
            "shared" + "/",
            "closing" + " note",
            r"\bcarry" + ":",
            "device" + " tool",
            r"\.\./" + "shared",
        ]
    ),
    re.IGNORECASE,
)


def test_no_file_refers_to_what_is_not_the_project() -> None:
    files = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for folder in ("docs", "posenc", "tests", "conf", "sweeps", "hydra_plugins"):
        files += [p for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in (".py", ".md", ".yaml", ".toml")]
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in files
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if FORBIDDEN.search(line)
    ]
    assert not found, "\n".join(found)
