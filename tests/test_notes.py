"""Every `NOTE [topic]` that the code cites exists: a `# NOTE [topic]` block in remat or its tests."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
# remat's modules, those of its subpackages (`remat/_torch/`, `remat/testing/`) included, and the tests.
SOURCES = sorted([*ROOT.joinpath("remat").rglob("*.py"), *ROOT.joinpath("tests").glob("*.py")])
DEFINITION = re.compile(r"^\s*# NOTE \[([^\]]+)\]\s*$", re.MULTILINE)
CITATION = re.compile(r"NOTE\s+\[([^\]]+)\]")


def _joined(text: str) -> str:
    """`text` with comment and string continuations joined, so that a citation split over lines reads whole."""
    return re.sub(r"\s*\n\s*#?\s*", " ", text)


def test_every_cited_note_exists() -> None:
    defined = {name for path in SOURCES for name in DEFINITION.findall(path.read_text())}
    cited = {
        (" ".join(name.split()), path.name)
        for path in SOURCES
        if path.name != "test_notes.py"  # whose own text cites example names
        for name in CITATION.findall(_joined(path.read_text()))
    }
    unresolved = sorted((path, name) for name, path in cited if name not in defined)
    assert len(defined) > 30
    assert not unresolved, f"cited but never written as `# NOTE [...]`: {unresolved}"


def test_each_note_is_written_once() -> None:
    names = [name for path in SOURCES for name in DEFINITION.findall(path.read_text())]
    assert sorted({n for n in names if names.count(n) > 1}) == []
