"""A ring collective that its peer never joins: rank 0's wait fails within the timeout.

Shared by tests/test_reduce_scatter.py and tests/test_all_gather.py (the pool
runs this module's worker, so it must be importable by name).
"""

from __future__ import annotations

import time
from typing import Any

import torch

import funcshard as fs
from funcshard._src.comm import channel, collectives, groups
from funcshard._src.comm.runtime import CollectiveError


def _time_out_in_a_ring(op: str) -> tuple[str, float, bool]:
    """Rank 0 starts a ring ``op`` that rank 1 never joins; its error, seconds and out-of-step."""
    bound = groups.bind(fs.Mesh({"fsdp": 2}))
    if bound.rank == 1:
        return "", 0.0, True
    fs.set_collective_timeout(2.0)
    start = time.monotonic()
    try:
        if op == "reduce_scatter":
            pending = collectives.reduce_scatter(
                torch.ones(2, 5), bound, ("fsdp",), tag="b/1", algorithm="ring"
            )
        else:
            pending = collectives.all_gather(
                torch.ones(5), bound, ("fsdp",), tag="b/1", algorithm="ring"
            )
        pending.wait()
        error = ""
    except CollectiveError as e:
        error = str(e)
    finally:
        fs.set_collective_timeout(None)
    ch = channel.existing_channel()
    return error, time.monotonic() - start, ch is not None and ch.out_of_step is not None


def check_a_ring_that_a_peer_never_joins(pools: Any, op: str) -> None:
    """Rank 0's ring ``op`` fails naming the unit within the timeout and leaves it out of step."""
    try:
        (error, seconds, out_of_step), _ = pools.run(2, _time_out_in_a_ring, op, timeout_s=60)
    finally:
        pools.pool(2).close()  # rank 0 is out of step: the next test starts fresh
    assert f"{op} of unit 'b/1' over mesh axes ['fsdp'] on rank 0 failed" in error
    assert seconds < 2.0 + 5
    assert out_of_step
