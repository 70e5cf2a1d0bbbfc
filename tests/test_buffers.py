"""Staging buffers are reused within a step and none is kept past its last reduction (docs/performance.md).

Reference: [Note: staging lifetimes] in ``funcshard/_src/execute/param_group.py``.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

import funcshard as fs
from funcshard._src.execute.param_group import BufferPool
from funcshard.testing import assert_trees_close, reference_value_and_grad


def _blocks(width: int = 6, n: int = 4) -> dict:
    gen = torch.Generator().manual_seed(0)
    return {
        "blocks": [
            {
                "w": torch.randn(width, width + 1, generator=gen),
                "b": torch.randn(width + 1, generator=gen),
            }
            for _ in range(n)
        ]
    }


def _loss(p, x):
    for blk in p["blocks"]:
        x = fs.call(lambda b, x: torch.tanh(x @ b["w"] + b["b"])[:, : x.shape[1]], blk, x)
    return (x**2).mean()


def _train(
    strategy: Any, prefetch: int, bucket_bytes: int | None
) -> tuple[list[int], int, int, int, bool]:
    """Per step, the pools' allocations so far; their held bytes at the start of backward and
    after the step; the staging bound; grads right."""
    params = _blocks()
    plan = fs.plan(
        params, fs.Mesh({"fsdp": fs.world_size()}), units=["blocks/*"], strategy=strategy
    )
    mid: list[int] = []

    def loss(p, x):
        out = _loss(p, x)
        # runs first in backward: what the pools hold while the units are reduced
        out.register_hook(lambda g: mid.append(step.stats.staging_bytes) or g)
        return out

    step = fs.value_and_grad(loss, plan, prefetch=prefetch, bucket_bytes=bucket_bytes)
    sparams = fs.shard(params, plan)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(fs.rank()))
    counts = []
    for _ in range(4):
        _, grads = step(sparams, x)
        counts.append(step.gather_pool.allocations + step.reduce_pool.allocations)
    after = step.stats.staging_bytes
    xs = [
        (torch.randn(3, 6, generator=torch.Generator().manual_seed(r)),)
        for r in range(fs.world_size())
    ]
    _, expected = reference_value_and_grad(_loss, params, xs)
    assert_trees_close(fs.unshard(grads), expected, rtol=1e-5, atol=1e-6)
    unit = next(u for u in step._runtimes() if u.name == "blocks/0")
    part = unit.parts[0]
    one_gather = unit.group_size * part.layout.numel * 4
    step.release()  # frees the pools; the next step allocates them again and trains alike
    _, again = step(sparams, x)
    assert_trees_close(fs.unshard(again), expected, rtol=1e-5, atol=1e-6)
    return counts, max(mid[1:]), after, one_gather, True


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op"])
@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.parametrize("bucket_bytes", [0, None], ids=["units", "buckets"])
def test_a_step_in_steady_state_allocates_its_staging_once_and_keeps_none(
    pools, strategy, prefetch, bucket_bytes
):
    for counts, held, after, one, ok in pools.run(2, _train, strategy, prefetch, bucket_bytes):
        assert ok
        # the first step knows no call order, so it prefetches nothing; from the second on,
        # every step allocates the same few buffers, once each, not one per unit or collective
        per_step = [b - a for a, b in itertools.pairwise(counts)]
        assert per_step[1] == per_step[2], counts
        assert 0 < per_step[2] <= 2 * (prefetch + 1), counts
        # what is kept while the units are reduced: at most `prefetch` all-gather outputs and
        # one reduce-scatter input, of one unit or of one bucket (the 4 units; its gathers also
        # keep their 1/W-sized input); and once the last unit is reduced, nothing (drained)
        assert held <= (prefetch + 1) * one * (1 if bucket_bytes == 0 else 4 * 1.5)
        # full_shard's first backward gather, started at the end of forward, has taken the
        # pooled buffer by then ([Note: the first backward gather] in execute/run.py)
        assert (held == 0) == (strategy == "full_shard")
        assert after == 0


def test_the_pool_hands_back_what_it_was_given_up_to_its_depth():
    pool = BufferPool(depth=1)
    cpu = torch.device("cpu")
    a, b = pool.take(8, torch.float32, cpu), pool.take(8, torch.float32, cpu)
    pool.give(a.view(2, 4))  # a view of a whole buffer counts as the buffer
    pool.give(b)  # beyond the depth: dropped
    assert pool.held_bytes == 32
    assert pool.allocations == 2
    assert pool.take(8, torch.float32, cpu) is a
    assert pool.take(8, torch.bfloat16, cpu) is not a  # another dtype is another kind
    pool.give(torch.zeros(8)[:4])  # part of a buffer: never kept
    assert pool.held_bytes == 0
    keeps_nothing = BufferPool(depth=0)  # the root unit's: used once a step, not held
    keeps_nothing.give(keeps_nothing.take(8, torch.float32, cpu))
    assert keeps_nothing.held_bytes == 0
    with pytest.raises(ValueError, match="depth of at least 0"):
        BufferPool(depth=-1)


def _root_staging_held() -> tuple[list[int], int]:
    """Per step, the bytes the pools hold in the middle of backward; the root's all-gather output."""
    # 63 rows do not divide by 2: the root is gathered through a staging buffer, not in place
    params = {"embed": torch.randn(63, 6, generator=torch.Generator().manual_seed(1)), **_blocks()}
    plan = fs.plan(params, fs.Mesh({"fsdp": fs.world_size()}), units=["blocks/*"])
    held: list[int] = []

    def loss(p, x):
        h = _loss({"blocks": p["blocks"]}, x @ p["embed"][:6].T)
        # runs in backward, after the blocks' reductions and before the root's
        h.register_hook(lambda g: held.append(step.gather_pool.held_bytes) or g)
        return h + (p["embed"] ** 2).mean()

    step = fs.value_and_grad(loss, plan)
    sparams = fs.shard(params, plan)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(fs.rank()))
    for _ in range(3):
        step(sparams, x)
    return held, 63 * 6 * 4


def test_the_root_units_staging_is_not_held_from_its_gather_to_its_reduction(pools):
    """The root's all-gather output is as large as the embeddings: a pool that kept it would hold
    it through the whole step (the peak, in backward), which FSDP2 frees once copied out."""
    for held, root_bytes in pools.run(2, _root_staging_held):
        assert len(held) == 3
        assert all(h < root_bytes for h in held), (held, root_bytes)
