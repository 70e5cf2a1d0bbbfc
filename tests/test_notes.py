"""Notes are claims the code relies on: each is defined once and every citation finds it.

A Note is defined by a line that holds only ``[Note: name]`` (in a docstring, or after
``#``); the text below it says what the code does. Code, tests and docs elsewhere cite
it as ``[Note: name]`` (wrapped across lines or not) and name the file that defines it
close by, so a reader lands on it at once and a Note that moves breaks its citations
here; a file named right after a citation (``in file.py``) must be the defining one,
in the defining file too.
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("funcshard", "tests", "bench", "examples", "docs")
DEFINITION = re.compile(r"^\s*(?:#\s*)?\[Note: ([^\]]+)\]\s*$")
# a citation may wrap across lines (of a comment or a docstring): matched on the joined text
CITATION = re.compile(r"\[Note:\s+([a-zA-Z0-9][^\]]*)\]")
# the file a citation names right after it: ``[Note: x] in ``comm/shm/regions.py````
NAMED = re.compile(r"\s+in\s+`{0,2}([\w./-]*(?:py|md))\b")
MARGIN = re.compile(r"^\s*(?:#\s?)?")  # a line's indentation and comment marker
WINDOW = 240  # characters around a citation in which it names its file (before it too)


@dataclass(frozen=True)
class Citation:
    path: Path
    line: int
    name: str
    named: str | None  # the file named right after it, if one is
    context: str  # the joined text around the citation


def _sources(root: Path) -> list[Path]:
    found = [root / "README.md"]
    for folder in FOLDERS:
        found += [p for p in (root / folder).rglob("*") if p.suffix in (".py", ".md")]
    return [p for p in found if p.resolve() != Path(__file__).resolve()]


def _scan(root: Path = ROOT) -> tuple[dict[str, list[Path]], list[Citation]]:
    definitions: dict[str, list[Path]] = defaultdict(list)
    citations: list[Citation] = []
    for path in _sources(root):
        lines = path.read_text().splitlines()
        starts, pieces, at, defining = [], [], 0, set()
        for i, line in enumerate(lines):
            if m := DEFINITION.match(line):
                definitions[m.group(1)].append(path)
                defining.add(i)
            piece = MARGIN.sub("", line)
            starts.append(at)
            pieces.append(piece)
            at += len(piece) + 1
        text = " ".join(pieces)
        for m in CITATION.finditer(text):
            i = bisect.bisect_right(starts, m.start()) - 1
            if i in defining:
                continue
            named = NAMED.match(text, m.end())
            citations.append(
                Citation(
                    path,
                    i + 1,
                    " ".join(m.group(1).split()),
                    named.group(1) if named else None,
                    text[max(0, m.start() - WINDOW) : m.end() + WINDOW],
                )
            )
    return definitions, citations


def _names(named: str, defining: Path) -> bool:
    """Whether ``named`` (``regions.py``, ``comm/shm/regions.py``) is the defining file."""
    return f"/{defining.as_posix()}".endswith(f"/{named}")


def test_every_note_is_defined_once_and_cited():
    """A Note defined twice says two things; one nobody cites is no longer relied on."""
    definitions, citations = _scan()
    twice = {
        name: [str(p.relative_to(ROOT)) for p in where]
        for name, where in definitions.items()
        if len(where) > 1
    }
    assert not twice, f"Notes defined in more than one place: {twice}"
    cited = {c.name for c in citations}
    uncited = {
        name: str(where[0].relative_to(ROOT))
        for name, where in definitions.items()
        if name not in cited
    }
    assert not uncited, (
        f"Notes that nothing cites (cite them where the code relies on them, or drop them): {uncited}"
    )


def test_every_citation_names_the_file_that_defines_the_note():
    """``See [Note: x] in ``file.py```` everywhere but in the defining file itself.

    A citation wrapped across lines counts; a file named right after a citation
    (``in file.py``), in the defining file too, must be the defining one.
    """
    definitions, citations = _scan()
    undefined = [
        f"{c.path.relative_to(ROOT)}:{c.line}: [Note: {c.name}]"
        for c in citations
        if c.name not in definitions
    ]
    assert not undefined, "citations of Notes that no file defines:\n" + "\n".join(undefined)
    wrong = []
    for c in citations:
        defining = definitions[c.name][0]
        if c.named is not None:
            ok = _names(c.named, defining)
        else:
            ok = defining == c.path or defining.name in c.context
        if not ok:
            wrong.append(
                f"{c.path.relative_to(ROOT)}:{c.line}: [Note: {c.name}] names "
                f"{c.named or 'no file'}; it is defined in {defining.relative_to(ROOT)}"
            )
    assert not wrong, "citations that do not name the defining file:\n" + "\n".join(wrong)


def test_the_scan_finds_wrapped_and_misnamed_citations(tmp_path):
    """The checks above cannot pass vacuously: a wrapped citation and a wrong file are seen."""
    (tmp_path / "funcshard").mkdir()
    (tmp_path / "README.md").write_text("")
    (tmp_path / "funcshard" / "a.py").write_text("# [Note: the thing]\n# what it does\n")
    (tmp_path / "funcshard" / "b.py").write_text(
        "# see [Note: the\n# thing] in a.py, and\n# [Note: the thing] in ``c/py`` too\n"
    )
    definitions, citations = _scan(tmp_path)
    assert [p.name for p in definitions["the thing"]] == ["a.py"]
    assert [(c.line, c.name, c.named) for c in citations] == [
        (1, "the thing", "a.py"),
        (3, "the thing", "c/py"),
    ]
    defining = definitions["the thing"][0]
    assert _names("a.py", defining)
    assert not _names("c/py", defining)
