"""The Python blocks of docs/interop.md run as written, with Hugging Face, JAX and Orbax installed.

One namespace for the file, blocks in order, in one process (see tests/test_docs.py).
"""

from __future__ import annotations

import pytest

from tests.docs import run_blocks

pytest.importorskip(
    "transformers", reason="docs/interop.md builds a Hugging Face model: nox -s interop"
)
pytest.importorskip("jax", reason="docs/interop.md exchanges arrays with JAX: nox -s interop")
pytest.importorskip(
    "orbax.checkpoint", reason="docs/interop.md writes an Orbax checkpoint: nox -s interop"
)


def test_interop_doc_blocks_run(tmp_path):
    assert run_blocks("docs/interop.md", str(tmp_path)) == 6


def test_large_models_doc_blocks_run(tmp_path):
    assert run_blocks("docs/large_models.md", str(tmp_path)) == 5
