"""Notes are claims the code relies on: each is defined once and every citation finds it.

A Note is defined by a line that holds only ``[Note: name]`` (in a docstring, or after
``#``); the text below it says what the code does. Code, tests and docs elsewhere cite
it as ``[Note: name]`` and name the file that defines it on the same line or the next
two, so a reader lands on it at once and a Note that moves breaks its citations here.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("funcshard", "tests", "bench", "examples", "docs")
DEFINITION = re.compile(r"^\s*(?:#\s*)?\[Note: ([^\]]+)\]\s*$")
CITATION = re.compile(r"\[Note: ([a-zA-Z0-9][^\]]*)\]")


def _sources() -> list[Path]:
    found = [ROOT / "README.md"]
    for folder in FOLDERS:
        found += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md")]
    return [p for p in found if p.resolve() != Path(__file__).resolve()]


def _scan() -> tuple[dict[str, list[Path]], list[tuple[Path, int, str, str]]]:
    definitions: dict[str, list[Path]] = defaultdict(list)
    citations: list[tuple[Path, int, str, str]] = []
    for path in _sources():
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if m := DEFINITION.match(line):
                definitions[m.group(1)].append(path)
                continue
            for m in CITATION.finditer(line):
                citations.append((path, i + 1, m.group(1), " ".join(lines[i : i + 3])))
    return definitions, citations


def test_every_note_is_defined_once_and_cited():
    """A Note defined twice says two things; one nobody cites is no longer relied on."""
    definitions, citations = _scan()
    twice = {
        name: [str(p.relative_to(ROOT)) for p in where]
        for name, where in definitions.items()
        if len(where) > 1
    }
    assert not twice, f"Notes defined in more than one place: {twice}"
    cited = {name for _, _, name, _ in citations}
    uncited = {
        name: str(where[0].relative_to(ROOT))
        for name, where in definitions.items()
        if name not in cited
    }
    assert not uncited, (
        f"Notes that nothing cites (cite them where the code relies on them, or drop them): {uncited}"
    )


def test_every_citation_names_the_file_that_defines_the_note():
    """``See [Note: x] in ``file.py```` everywhere but in the defining file itself."""
    definitions, citations = _scan()
    undefined = [
        f"{p.relative_to(ROOT)}:{n}: [Note: {name}]"
        for p, n, name, _ in citations
        if name not in definitions
    ]
    assert not undefined, "citations of Notes that no file defines:\n" + "\n".join(undefined)
    unnamed = [
        f"{p.relative_to(ROOT)}:{n}: [Note: {name}] is defined in {definitions[name][0].relative_to(ROOT)}"
        for p, n, name, context in citations
        if definitions[name][0] != p and definitions[name][0].name not in context
    ]
    assert not unnamed, "citations that do not name the defining file:\n" + "\n".join(unnamed)
