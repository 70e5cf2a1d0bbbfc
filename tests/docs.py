"""Running the Python blocks of a Markdown file, in order, in one namespace (as a reader would)."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks(name: str) -> list[str]:
    """The Python blocks of ``ROOT / name``, in order."""
    return _BLOCK.findall((ROOT / name).read_text())


def documents() -> list[str]:
    """Every Markdown file of the README and docs/ that holds a Python block."""
    names = ["README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")))]
    return [n for n in names if blocks(n)]


def run_blocks(name: str, directory: str) -> int:
    """Runs every block of ``name`` in one namespace, with ``directory`` as the working directory.

    Returns the number of blocks run. A failing block raises with the file and block number.
    """
    namespace: dict[str, object] = {"__name__": "__doc_blocks__"}
    before = os.getcwd()
    os.makedirs(directory, exist_ok=True)
    os.chdir(directory)
    try:
        found = blocks(name)
        for i, code in enumerate(found):
            exec(compile(code, f"{name}, Python block {i + 1}", "exec"), namespace)
    finally:
        os.chdir(before)
    return len(found)
