"""How many funcshard source files one steady-state full_shard step runs through (``tests/step_files.py``).

At most 16 with the shared-memory transport (FSDP2 enters four files of its own,
over torch.distributed's); the bounds are what a step enters today, so that no
change adds to them.
"""

from __future__ import annotations

import functools

from tests.step_files import step_files

BOUND = {1: 15, 2: 16}  # the shared-memory transport loaded, as step_files says


def test_a_steady_state_step_at_one_rank_stays_within_its_files():
    files = step_files({"fsdp": 1})
    assert len(files) <= BOUND[1], "\n".join(files)


def test_a_steady_state_step_at_two_ranks_stays_within_its_files(pools):
    for files in pools.run(2, step_files):
        assert len(files) <= BOUND[2], "\n".join(files)


def test_a_flat_unit_of_its_own_enters_no_more_files(pools):
    """The flat layout (its rows, its own row summed from the leaves) and no buckets."""
    run = functools.partial(step_files, layout="flat", bucket_bytes=0)
    for files in pools.run(2, run):
        assert len(files) <= BOUND[2], "\n".join(files)
