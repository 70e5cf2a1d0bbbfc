"""The README's complete training loop resumes bit for bit: 6 steps then 8 from its checkpoint == 8 at once."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import funcshard as fs
from tests.docs import blocks


def _loop_namespace() -> dict[str, Any]:
    """The README's blocks up to the loop's, run (the loop block without its last two lines)."""
    found = blocks("README.md")
    loop = next(i for i, b in enumerate(found) if "def train(" in b)
    namespace: dict[str, Any] = {"__name__": "__doc_blocks__"}
    for i, code in enumerate(found[: loop + 1]):
        if i == loop:
            code = code[: code.index("\ntrain(6")]
        exec(compile(code, f"README.md, Python block {i + 1}", "exec"), namespace)
    return namespace


def _resume_equals_straight(directory: str) -> list[bool]:
    os.makedirs(directory, exist_ok=True)
    os.chdir(directory)
    train = _loop_namespace()["train"]
    straight = train(8, "straight")
    train(6, "resumed")
    resumed = train(8, "resumed")
    assert resumed["step"] == straight["step"] == 8
    full = [
        fs.unshard(t)
        for t in (straight["params"], straight["opt"], resumed["params"], resumed["opt"])
    ]
    pairs = zip(fs.tree.leaves(full[:2]), fs.tree.leaves(full[2:]))
    return [torch.equal(a, b) for a, b in pairs]


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_readme_loop_resumes_bit_for_bit(pools, tmp_path, world_size):
    for equal in pools.run(world_size, _resume_equals_straight, str(tmp_path), timeout_s=300):
        assert equal
        assert all(equal)
