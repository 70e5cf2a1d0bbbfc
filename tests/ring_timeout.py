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


def _time_out_in_a_ring(op: str, algorithm: str) -> tuple[str, float, bool]:
    """Rank 0 starts a point-to-point ``op`` that rank 1 never joins; its error, seconds and out-of-step."""
    bound = groups.bind(fs.Mesh({"fsdp": 2}))
    # both ranks agree on the transport settings (the first collective on a fresh pool),
    # so that what times out is the collective itself
    collectives.all_gather(torch.ones(1), bound, ("fsdp",)).wait()
    if bound.rank == 1:
        return "", 0.0, True
    fs.set_collective_timeout(2.0)
    start = time.monotonic()
    try:
        if op == "reduce_scatter":
            pending = collectives.reduce_scatter(
                torch.ones(2, 5), bound, ("fsdp",), tag="b/1", algorithm=algorithm
            )
        else:
            pending = collectives.all_gather(
                torch.ones(5), bound, ("fsdp",), tag="b/1", algorithm=algorithm
            )
        pending.wait()
        error = ""
    except CollectiveError as e:
        error = str(e)
    finally:
        fs.set_collective_timeout(None)
    ch = channel.existing_channel()
    return error, time.monotonic() - start, ch is not None and ch.out_of_step is not None


def check_a_ring_that_a_peer_never_joins(pools: Any, op: str, algorithm: str = "ring") -> None:
    """Rank 0's ``op`` by ``algorithm`` fails naming the unit within the timeout and leaves it out of step."""
    try:
        (error, seconds, out_of_step), _ = pools.run(
            2, _time_out_in_a_ring, op, algorithm, timeout_s=60
        )
    finally:
        pools.pool(2).close()  # rank 0 is out of step: the next test starts fresh
    assert f"{op} of unit 'b/1' over mesh axes ['fsdp'] on rank 0 failed" in error, (error, seconds)
    assert seconds < 2.0 + 5
    assert out_of_step
