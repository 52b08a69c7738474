"""The project speaks only of itself: its README, docs, code, tests and configs name nothing a user does not have.

A reader has this repository and pip; a tracker's numbers, paths outside the repository and tooling of the
people who built it mean nothing to them.
"""

from __future__ import annotations

import re
from pathlib import Path

from posenc.report.study import BEGIN

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


README = ROOT / "README.md"
README_MAX_LINES = 400
# [text](target) and ![alt](target); the target ends at the first space or closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s[^)]*)?\)")
FENCE = re.compile(r"^(```|~~~)")


def prose(text: str) -> str:
    """The text outside fenced code blocks, where a bracket is markdown and not code."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return "\n".join(lines)


def anchor(heading: str) -> str:
    """The anchor a markdown renderer gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    words = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return words.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {anchor(line.lstrip("#")) for line in prose(path.read_text()).splitlines() if line.startswith("#")}


def markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def test_readme_is_a_guide_of_at_most_400_lines() -> None:
    count = len(README.read_text().splitlines())
    assert count <= README_MAX_LINES, f"README.md has {count} lines; reference detail belongs in docs/guide/"


def test_readme_opens_with_the_two_setup_commands() -> None:
    """CI runs the README's first code block as its install and test commands: exactly these two."""
    match = re.search(r"^```[a-z]*\n(.*?)^```", README.read_text(), re.MULTILINE | re.DOTALL)
    assert match, "README.md has no code block"
    commands = [line.strip() for line in match.group(1).splitlines() if line.strip() and not line.startswith("#")]
    assert commands == ['pip install -e ".[dev]"', "pytest"]


def test_every_relative_link_in_the_markdown_resolves() -> None:
    """A link to a file or a heading that moved is caught here, not by a reader."""
    broken = []
    for path in markdown_files():
        for target in LINK.findall(prose(path.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, fragment = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_study_opens_with_its_provenance() -> None:
    """A result the README cites says how to regenerate it and on what, before its first table."""
    studies = sorted((ROOT / "docs" / "results").glob("*.md"))
    assert studies, "docs/results/ holds no study"
    for path in studies:
        text = path.read_text()
        generated = BEGIN in text
        head = text.split(BEGIN, 1)[0] if generated else text.split("\n## ", 1)[0]
        assert "```bash\n" in head, f"{path.name}: no command before its first section"
        # Written by the report: the runs' own record in one table; transcribed: the fields as the text gave them.
        fields = (
            ("| runs (results) |", "| seeds per column |", "| machine |", "| torch |", "| training wall time")
            if generated
            else ("**Machine**", "**torch**", "**Wall time**", "**n**", "**Date**")
        )
        for field in fields:
            assert field in head, f"{path.name}: its header lacks {field}"
        assert "\n## History\n" in text, f"{path.name}: no History section"


# The three words a test can give (flat: a ratio's equivalence with 1), and a study document to name.
TESTED_WORD = re.compile(r"\b(separated|equivalent|inconclusive|flat)\b")
STUDY_LINK = re.compile(r"\]\(docs/results/[\w.-]+\.md\)")
FIGURE = re.compile(r"\d\.\d")


def sentences(text: str) -> list[str]:
    """``text`` cut after each full stop or semicolon outside parentheses (so "(0.25 → 0.16; 0.53)" stays whole)."""
    out, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(char, 0)
        if depth == 0 and char in ".;" and text[i + 1 : i + 2] in (" ", ""):
            out.append(text[start : i + 1].strip())
            start = i + 1
    return [s for s in [*out, text[start:].strip()] if s]


def test_sentences_split_outside_parentheses_only() -> None:
    assert sentences("A (0.25 → 0.16; 0.53) is 1.0 flat. B 2.5; C.") == [
        "A (0.25 → 0.16; 0.53) is 1.0 flat.",
        "B 2.5;",
        "C.",
    ]


def test_every_finding_names_its_table_and_each_figure_a_word_its_test_gave() -> None:
    """Each bullet of the README's findings is a claim: it links the study its figures come from, and every sentence
    of it that states a figure says the word a test gave it, or that it is untested.

    A claim without its table cannot be checked, and a figure without a tested word reads a difference or a parity
    into numbers that no test gave. The opening states the setting and holds the table, whose cells carry words.
    """
    section = README.read_text().split("\n## What we found\n", 1)[1].split("\n## ", 1)[0]
    opening, *bullets = re.split(r"\n(?=- )", section)
    assert bullets, "the findings are no longer bullets: this test reads each bullet as one claim"
    assert STUDY_LINK.search(opening) and TESTED_WORD.search(opening), "the findings' opening lost its table or words"
    for claim in bullets:
        text = " ".join(claim.split())
        assert STUDY_LINK.search(claim), f"a finding names no study document: {text[:80]}…"
        for sentence in sentences(text):
            if FIGURE.search(sentence):
                assert TESTED_WORD.search(sentence) or "untested" in sentence, (
                    f"a figure without a word a test gave (or 'untested'): {sentence[:120]}…"
                )
