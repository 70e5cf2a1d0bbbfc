"""A unit's state changes only through its transitions; one from the wrong state is an internal error.

Reference: the state diagram in docs/executor.md.

Huge pages for large gathered storages: asked for where they can be, never changing a value.

[Note: huge pages for gathered storage] in ``execute/unit_state.py``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from typing import Any

import pytest
import torch

import funcshard as fs
from funcshard._src.comm import collectives
from funcshard._src.execute import unit_state
from funcshard._src.execute.param_group import BufferPool, ParamGroup
from funcshard._src.execute.unit_state import UnitState, UnitStateError
from funcshard.testing import assert_trees_close, reference_value_and_grad


def _unit():
    params = {"blocks": [{"w": torch.ones(4, 2)}]}
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=["blocks/*"])
    step = fs.value_and_grad(
        lambda p, x: fs.call(lambda b, x: (x @ b["w"]).sum(), p["blocks"][0], x), plan
    )
    step(fs.shard(params, plan), torch.ones(3, 4))  # one step binds every unit
    (members,) = [m for m in step._members if m[0].name == "blocks/0"]
    return ParamGroup(members, BufferPool(), BufferPool())


def test_the_transitions_of_the_diagram():
    group = _unit()
    (unit,) = group.members
    assert unit.state is UnitState.SHARDED
    group.prefetch(unit)
    assert unit.state is UnitState.GATHERING
    group.acquire(unit)
    group.acquire(unit)  # a second holder (a unit called twice)
    assert (unit.state, unit.holders) == (UnitState.GATHERED, 2)
    group.release(unit)
    assert unit.state is UnitState.GATHERED
    group.release(unit)
    assert (unit.state, unit.holders) == (UnitState.SHARDED, 0)
    group.prefetch(unit)
    group.drop_unused(unit)  # prefetched, never used
    assert unit.state is UnitState.SHARDED


@pytest.mark.parametrize(
    ("wrong", "message"),
    [
        (
            lambda g, u: g.release(u),
            r"unit 'blocks/0' asked to release in state sharded, which needs gathered",
        ),
        (
            lambda g, u: (g.prefetch(u), g.prefetch(u)),
            r"asked to prefetch in state gathering, which needs sharded",
        ),
        (lambda g, u: u.full_leaves(), r"asked to full_leaves in state sharded"),
        (lambda g, u: (g.acquire(u), u.bind(u.flats)), r"asked to bind in state gathered"),
        (
            lambda g, u: (g.acquire(u), g.release(u), g.acquire(u), g.release(u), g.release(u)),
            r"in state sharded",
        ),
        (lambda g, u: u.mark_gathered(), r"asked to finish gathering in state sharded"),
        (lambda g, u: u.hold(), r"asked to be held in state sharded"),
    ],
    ids=[
        "release-sharded",
        "prefetch-twice",
        "leaves-sharded",
        "bind-gathered",
        "release-too-often",
        "gathered-without-gathering",
        "held-sharded",
    ],
)
def test_a_transition_from_the_wrong_state_is_an_internal_error(wrong, message):
    group = _unit()
    with pytest.raises(UnitStateError, match=message):
        wrong(group, group.members[0])


# -- gathering leaf by leaf ([Note: persistent gathered storage] in ``execute/unit_state.py``) ----------------------------------


def _blocks(v: tuple[int, ...]) -> dict[str, Any]:
    """Three blocks of ``w`` (6, 6), ``b`` (6,) and ``v`` of shape ``v``."""
    gen = torch.Generator().manual_seed(0)
    return {
        "blocks": [
            {
                "w": torch.randn(6, 6, generator=gen),
                "b": torch.randn(6, generator=gen),
                "v": torch.randn(v, generator=gen),
            }
            for _ in range(3)
        ]
    }


def _recording_loss(remat: bool) -> tuple[Any, list[Any], list[bool]]:
    """A loss over :func:`_blocks` whose block records, per call, where w, b and v live."""
    seen: list[list[tuple[int, int, int]]] = []
    recording = [True]  # not in the reference, whose leaves are functorch wrappers

    def block(b, x):
        if recording[0]:
            seen.append(
                [
                    (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
                    for t in (b["w"], b["b"], b["v"])
                ]
            )
        return torch.tanh(x @ b["w"] + b["b"]) * b["v"].sum()

    def loss(p, x):
        for blk in p["blocks"]:
            x = fs.call(block, blk, x, remat=remat)
        return (x**2).mean()

    return loss, seen, recording


def _views_in_calls(bucket_bytes: int | None, remat: bool) -> dict[str, object]:
    """Worker body: where the full leaves each call of a block sees live, and the step's results."""
    params = _blocks((2, 3))
    plan = fs.plan(params, fs.Mesh({"fsdp": fs.world_size()}), units=["blocks/*"])
    loss, seen, recording = _recording_loss(remat)
    step = fs.value_and_grad(loss, plan, bucket_bytes=bucket_bytes)
    measured = _second_step(step, loss, params, plan, seen, recording)
    units = [u for u in step._runtimes() if not u.unit.is_root]
    return {**measured, "in_place": [p.in_place for u in units for p in u.parts]}


def _second_step(
    step: Any,
    loss: Any,
    params: Any,
    plan: fs.Plan,
    seen: list[Any],
    recording: list[bool],
    during: Any = contextlib.nullcontext,
) -> dict[str, Any]:
    """A warm-up step, then one recorded step (inside ``during()``) checked against one process.

    Returns what the recorded step saw: the leaves of ``seen``, its gather-pool
    allocations, the bytes it sent and the cost model's bytes.
    """
    sparams = fs.shard(params, plan)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(fs.rank()))
    step(sparams, x)
    seen.clear()
    before = step.gather_pool.allocations
    step.ledger.reset()
    with during():
        _, grads = step(sparams, x)
    recording[0] = False  # the reference's leaves are functorch wrappers
    xs = [
        (torch.randn(3, 6, generator=torch.Generator().manual_seed(r)),)
        for r in range(fs.world_size())
    ]
    _, expected = reference_value_and_grad(loss, params, xs)
    assert_trees_close(fs.unshard(grads), expected, rtol=1e-5, atol=1e-6)
    return {
        "seen": seen,
        "gather_allocations": step.gather_pool.allocations - before,
        "sent": step.ledger.total(),
        "model": sum(fs.cost.estimate(plan).comm.values()),
    }


@pytest.mark.parametrize("remat", [False, True])
def test_on_two_gloo_ranks_each_leaf_is_gathered_into_a_view_of_the_units_storage(pools, remat):
    """Every leaf split evenly on dim 0 (the default placement): one collective per leaf,
    each writing its full leaf, a view of one storage per unit; no gathered buffer beside."""
    for r in pools.run(2, _views_in_calls, 0, remat):
        assert all(r["in_place"])
        assert len(r["seen"]) == 3 * (2 if remat else 1)  # remat: the calls again in backward
        for leaves in r["seen"]:
            assert len({ptr for ptr, _, _ in leaves}) == 1, leaves  # one storage
            spans = sorted((offset, offset + n) for _, offset, n in leaves)
            assert spans[0][0] == 0
            assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), spans  # tiled
        assert r["gather_allocations"] == 0  # no staging buffer for any gather
        assert r["sent"] == r["model"]


def test_units_in_a_bucket_are_gathered_packed(pools):
    """The same blocks bucketed (gloo's default): one packed all-gather for the bucket."""
    for r in pools.run(2, _views_in_calls, None, False):
        assert not any(r["in_place"])
        assert r["sent"] == r["model"]


# -- the flat layout: a gathered unit is one buffer, its leaves views of it -----------------------


def _flat_views(remat: bool) -> dict[str, object]:
    """Worker body: what each all-gather writes into, and where each call's full leaves live."""
    params = _blocks((5,))  # 47 elements a block: ranges cut inside leaves, the last one padded
    plan = fs.plan(params, fs.Mesh({"fsdp": fs.world_size()}), units=["blocks/*"], layout="flat")
    loss, seen, recording = _recording_loss(remat)
    outputs: list[tuple[int, int]] = []
    original = collectives.all_gather

    def recorded(*args, **kwargs):
        out = kwargs.get("out")
        if out is not None:
            outputs.append((out.untyped_storage().data_ptr(), out.numel()))
        return original(*args, **kwargs)

    @contextlib.contextmanager
    def recording_gathers():
        collectives.all_gather = recorded
        try:
            yield
        finally:
            collectives.all_gather = original

    step = fs.value_and_grad(loss, plan, bucket_bytes=0)
    measured = _second_step(step, loss, params, plan, seen, recording, recording_gathers)
    return {**measured, "outputs": outputs}


@pytest.mark.parametrize(("world", "remat"), [(2, False), (2, True), (4, False)])
def test_in_the_flat_layout_every_leaf_is_a_view_of_the_all_gathers_output(pools, world, remat):
    """One all-gather per unit writes the unit's concatenation; every full leaf a call sees, in
    forward and in remat's recompute, is a view of that very buffer at its place in the
    concatenation (47 elements: ranges cut inside leaves); no staging, no unpacking."""
    for r in pools.run(world, _flat_views, remat):
        outputs = r["outputs"]
        assert len(outputs) == 3 * 2  # each block: forward and backward, one collective each
        assert len(r["seen"]) == 3 * (2 if remat else 1)
        gathered = {ptr for ptr, _ in outputs}
        for leaves in r["seen"]:
            (ptr,) = {p for p, _, _ in leaves}  # one storage
            assert ptr in gathered  # the one the collective wrote
            # w, b, v at their place in the concatenation, which is in leaf order: b, v, w
            assert [(offset, n) for _, offset, n in leaves] == [(11, 36), (0, 6), (6, 5)]
        assert all(n == world * -(-47 // world) for _, n in outputs)
        assert r["gather_allocations"] == 0
        assert r["sent"] == r["model"]


def test_only_large_cpu_storages_are_advised():
    assert not unit_state.advise(torch.empty(1024))
    assert not unit_state.advise(torch.empty(0))


@pytest.mark.skipif(
    not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
    reason="a kernel without transparent huge pages refuses MADV_HUGEPAGE",
)
def test_a_large_storage_is_advised_and_keeps_what_is_written():
    storage = torch.empty(unit_state.MIN_BYTES // 4 + 12345)
    assert unit_state.advise(storage)
    storage.copy_(torch.arange(storage.numel(), dtype=torch.float32))
    assert torch.equal(storage, torch.arange(storage.numel(), dtype=torch.float32))
