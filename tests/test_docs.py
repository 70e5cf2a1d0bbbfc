"""Every Python block of the README and docs/ runs as written: one namespace per file, in order.

References: the blocks themselves (a block that raises fails its file, naming the block).
Files that need a distributed run run on two ranks of the worker pool; those that need
Hugging Face, JAX or Orbax run in ``nox -s interop`` (tests/interop/test_docs_interop.py).
"""

from __future__ import annotations

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
