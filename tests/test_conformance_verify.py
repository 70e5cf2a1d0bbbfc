"""fs.verify catches the silent kinds: each construct of the table, with funcshard's handling of it undone.

``verify`` of every supported row passes (``tests/test_conformance.py`` checks it in
each row's full_shard run). Here each kind of module code that reads parameters
outside apply's calls runs as it did before placeholders and re-entry
(``stale_module_code``: the module keeps its initial weights, recomputes and backward
hooks read them): the training is silently wrong, and ``fs.verify`` must fail, naming
the leaf that differs. A failure names the row.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.conformance.harness import verify_stale

LEAF = re.compile(r"^[\w.]+(/[\w.]+)+: ")  # a problem that starts with a leaf path

STALE = [
    "dtensor/Transformer-checkpointed",  # torch.utils.checkpoint in the model's forward
    "checkpoint/reentrant",
    "checkpoint/sequential",
    "checkpoint/wrapper",  # apply_activation_checkpointing
    "checkpoint/composable",
    "checkpoint/selective",
    "checkpoint/spanning",
    "checkpoint/inside-a-unit",
    "hook/full-backward",
    "hook/backward-pre",
    "read/another-unit",
    "read/next-unit-from-the-root",
]


@pytest.mark.parametrize("name", STALE)
def test_verify_fails_naming_the_leaf_where_module_code_reads_stale_weights(pools: Any, name: str):
    for rank, result in enumerate(pools.run(2, verify_stale, name, timeout_s=300)):
        assert not result["ok"], f"rank {rank}: fs.verify passed {name} reading stale weights"
        named = [p for p in result["problems"] if LEAF.match(p)]
        assert named, f"rank {rank}: no problem names a leaf: {result['problems']}"
