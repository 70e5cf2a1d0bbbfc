"""The worker pool itself: rank tracebacks on failure, a clear timeout on a hang, recovery after both."""

from __future__ import annotations

import pytest

from tests.pool import PoolTimeoutError, WorkerError, WorkerPool


def _rank_and_world():
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def _fail_on_rank_1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("boom on rank one")
    return "fine"


def _hang_on_rank_0():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.barrier()  # rank 1 never joins


def test_pool_runs_bodies_on_every_rank(pools):
    assert pools.run(2, _rank_and_world) == [(0, 2), (1, 2)]


def test_failure_reports_the_rank_and_its_traceback():
    pool = WorkerPool(2)
    try:
        with pytest.raises(
            WorkerError,
            match=r"(?s)_fail_on_rank_1 failed on rank\(s\) \[1\] of 2.*--- rank 1 ---.*RuntimeError: boom on rank one",
        ):
            pool.run(_fail_on_rank_1)
        assert pool.run(_rank_and_world) == [(0, 2), (1, 2)]  # restarted
    finally:
        pool.close()


def test_hang_ends_with_a_timeout_and_the_pool_recovers():
    pool = WorkerPool(2)
    try:
        pool.run(_rank_and_world)
        with pytest.raises(
            PoolTimeoutError,
            match=r"_hang_on_rank_0 did not finish on rank\(s\) \[0\] of world size 2 within 3 s",
        ):
            pool.run(_hang_on_rank_0, timeout_s=3)
        assert pool.run(_rank_and_world) == [(0, 2), (1, 2)]
    finally:
        pool.close()
