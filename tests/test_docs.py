"""Every Python block of the README and docs/ runs as written: one namespace per file, in order.

References: the blocks themselves (a block that raises fails its file, naming the block).
Files that need a distributed run run on two ranks of the worker pool; those that need
Hugging Face, JAX or Orbax run in ``nox -s interop`` (tests/interop/test_docs_interop.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs import documents, run_blocks

WORLD = {
    "README.md": (1, 2),
    "docs/checkpoints.md": (1, 2),
    "docs/planner.md": (1,),
    "docs/design.md": (2,),
    "docs/verify.md": (1, 2),
    "docs/optimizers.md": (1,),
}
INTEROP = {"docs/interop.md", "docs/large_models.md"}


def test_every_document_with_python_is_run_somewhere():
    assert set(documents()) == set(WORLD) | INTEROP


@pytest.mark.parametrize("name", sorted(n for n, w in WORLD.items() if 1 in w))
def test_blocks_run_in_one_process(name, tmp_path):
    assert run_blocks(name, str(tmp_path)) > 0


@pytest.mark.parametrize("name", sorted(n for n, w in WORLD.items() if 2 in w))
def test_blocks_run_on_two_ranks(pools, name, tmp_path):
    assert pools.run(2, run_blocks, name, str(tmp_path), timeout_s=300) == [pools_count(name)] * 2


def pools_count(name: str) -> int:
    from tests.docs import blocks

    return len(blocks(name))


def test_every_note_cited_is_written():
    """A ``[Note: ...]`` cited in the code or the docs exists: a line of its own opens it.

    The docs state the executor's rules by citing the Notes that keep them
    (docs/executor.md); a citation whose Note was renamed or removed would state
    a rule no code holds.
    """
    root = Path(__file__).resolve().parent.parent
    files = [
        *(root / "funcshard").rglob("*.py"),
        *(root / "docs").rglob("*.md"),
        root / "README.md",
    ]
    written: set[str] = set()
    cited: dict[str, set[str]] = {}
    for path in files:
        text = path.read_text()
        for line in text.splitlines():
            opened = re.fullmatch(r"\s*#?\s*\[Note: ([^\]]+)\]\s*", line)
            if opened:
                written.add(opened.group(1))
        joined = re.sub(r"\s*\n\s*(#\s*)?", " ", text)  # a citation may wrap
        for name in re.findall(r"\[Note: ([^\]]+)\]", joined):
            cited.setdefault(name, set()).add(str(path.relative_to(root)))
    assert len(written) > 40, "the test no longer finds the Notes"
    missing = {name: sorted(where) for name, where in cited.items() if name not in written}
    assert not missing, f"cited but never written: {missing}"
