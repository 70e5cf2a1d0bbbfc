"""A parameter group against an in-process fake transport, with no processes ([Note: one owner per collective] in ``execute/param_group.py``).

As FSDP2 tests its param group: rank 0 of a two-rank mesh is built in this
process (``shard_for_rank``), and the group's collectives go to
:class:`FakeCollectives`, which answers an all-gather with every rank's shard
(each rank's, made here too) and counts what was issued. The tests follow a
unit through its states, the gathered bytes back to zero, and a bucket's shared
gather and reduction rounds.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import funcshard as fs
from funcshard._src.comm import collectives as real_collectives
from funcshard._src.comm.collectives import Ledger, Pending
from funcshard._src.comm.groups import BoundMesh
from funcshard._src.execute import param_group
from funcshard._src.execute.param_group import BufferPool, ParamGroup, make_groups, plan_groups
from funcshard._src.execute.unit_state import GatheredMemory, UnitRuntime, UnitState
from funcshard._src.plan.precision import FULL_PRECISION
from funcshard._src.shard.shard import plan_layouts, shard_for_rank
from funcshard._src.shard.sharded import flats_of
from funcshard._src.tree import flatten_with_paths

W = 2
PARAMS = {
    "a": {"w": torch.arange(24.0).view(4, 6), "b": torch.arange(4.0)},
    "c": {"w": torch.arange(12.0).view(2, 6) + 100, "b": torch.arange(2.0) - 5},
}


class FakeCollectives:
    """The collectives a group issues, answered in this process: every rank's shard, by the shard's address."""

    group_size = staticmethod(real_collectives.group_size)

    @staticmethod
    def input_rows(*args: Any, **kw: Any) -> None:
        """No transport's own input buffers: the group packs into its pools."""

    def __init__(self, shards_by_ptr: dict[int, list[torch.Tensor]]) -> None:
        self.shards_by_ptr = shards_by_ptr
        self.issued: list[tuple[str, str]] = []

    def all_gather(self, local: torch.Tensor, bound: Any, axes: Any, /, **kw: Any) -> Pending:
        self.issued.append(("all_gather", kw.get("tag", "")))
        out = kw["out"].view(W, -1)
        rows = self.shards_by_ptr.get(local.data_ptr(), [local] * W)  # a bucket's: rank 0's
        for j, row in enumerate(rows):
            out[j].copy_(row)
        return Pending(out)

    def all_gather_pieces(self, *args: Any, **kw: Any) -> Pending:
        raise AssertionError("not gathered leaf by leaf without a backend")

    def reduce_scatter(self, rows: torch.Tensor, bound: Any, axes: Any, /, **kw: Any) -> Pending:
        self.issued.append(("reduce_scatter", kw.get("tag", "")))
        out = kw.get("out")
        out = rows[0].clone() if out is None else out.copy_(rows[0])
        return Pending(out)

    def all_reduce(self, buf: torch.Tensor, bound: Any, axes: Any, /, **kw: Any) -> Pending:
        self.issued.append(("all_reduce", kw.get("tag", "")))
        return Pending(buf)


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Rank 0's units of PARAMS on {"fsdp": 2}, bound to their shards, and the fake collectives."""
    plan = fs.plan(PARAMS, fs.Mesh({"fsdp": W}), units=["a", "c"], strategy="full_shard")
    ranks = [shard_for_rank(PARAMS, plan, r) for r in range(W)]
    flats = [list({id(f): f for f in flats_of(s)}.values()) for s in ranks]
    # rank r's flats come in the same order: the i-th of every rank is one layout's
    fake = FakeCollectives(
        {flats[0][i].data.data_ptr(): [fl[i].data for fl in flats] for i in range(len(flats[0]))}
    )
    monkeypatch.setattr(param_group, "collectives", fake)
    bound = BoundMesh(plan.mesh, 0, False)
    memory, ledger = GatheredMemory(), Ledger()
    layouts = plan_layouts(plan)
    units = [
        UnitRuntime(
            u, [x for x in layouts if x.unit == u.name], bound, FULL_PRECISION, ledger, memory
        )
        for u in plan.units
    ]
    for unit in units:
        unit.bind([f for f in flats[0] if f.layout.unit == unit.name])
    return units, fake, memory


def test_a_unit_alone_is_gathered_held_and_freed_by_its_group(built):
    units, fake, memory = built
    unit = next(u for u in units if u.name == "a")
    group = ParamGroup([unit], BufferPool(), BufferPool())
    assert unit.state is UnitState.SHARDED
    group.prefetch(unit)
    assert unit.state is UnitState.GATHERING
    assert fake.issued == [("all_gather", "a")] * len(unit.parts)
    group.acquire(unit)
    assert unit.state is UnitState.GATHERED
    assert unit.holders == 1
    paths, leaves, _ = flatten_with_paths(PARAMS)
    expected = dict(zip(paths, leaves))
    for slot, leaf in zip(unit.slots, unit.full_leaves()):
        assert torch.equal(leaf, expected[slot.path]), slot.path
    group.release(unit)
    assert unit.state is UnitState.SHARDED
    assert unit.holders == 0
    assert memory.current == 0


def test_a_prefetched_unit_no_call_holds_is_dropped(built):
    units, _fake, memory = built
    unit = units[0]
    group = ParamGroup([unit], BufferPool(), BufferPool())
    group.prefetch(unit)
    group.drop_unused(unit)
    assert unit.state is UnitState.SHARDED
    assert memory.current == 0


def test_a_bucket_gathers_its_members_in_one_collective_per_part_and_frees_them_one_by_one(built):
    units, fake, memory = built
    (group,) = make_groups(plan_groups(units, 1 << 20), BufferPool(), BufferPool())
    assert group.members == units
    group.prefetch(units[0])
    assert all(u.state is UnitState.GATHERING for u in units)
    assert [op for op, _ in fake.issued] == ["all_gather"] * len(units[0].parts)
    for unit in units:
        group.acquire(unit)
    group.release(units[0])
    assert units[0].state is UnitState.SHARDED
    assert units[1].state is UnitState.GATHERED
    group.release(units[1])
    assert memory.current == 0


def test_a_bucket_reduces_a_round_once_every_member_reported_and_early_when_one_reports_twice(
    built,
):
    units, fake, _ = built
    (group,) = make_groups(plan_groups(units, 1 << 20), BufferPool(), BufferPool())
    group.columns(units[0], 0, opened=0)
    assert not group.complete(0)
    assert group.open_rounds() == [(0, 0)]
    group.columns(units[1], 0, opened=1)
    assert group.complete(0)
    group.flush(0)
    assert group.open_rounds() == []
    assert fake.issued == [("reduce_scatter", group.name)]
    group.columns(units[0], 0, opened=2)
    _, _, flushed = group.columns(units[0], 0, opened=3)  # reported twice: flushed first
    assert flushed is not None
    assert group.open_rounds() == [(3, 0)]


def _full_grads(unit: UnitRuntime, scale: float) -> list[torch.Tensor]:
    """``unit``'s full gradients in its leaf order: each leaf's values times ``scale``."""
    paths, leaves, _ = flatten_with_paths(PARAMS)
    by_path = dict(zip(paths, leaves))
    return [by_path[slot.path] * scale for slot in unit.slots]


def _reduce(group: ParamGroup, unit: UnitRuntime, rows: torch.Tensor) -> Any:
    """Packs ``rows`` as ``unit``'s gradients of its first part and flushes the round: a group of one's."""
    columns, _, _ = group.columns(unit, 0, opened=0)
    assert group.complete(0)  # its one member reported
    columns.copy_(rows)
    return group.flush(0)


def test_a_group_holds_each_reduction_it_starts_until_asked_for_its_oldest(built):
    units, fake, _ = built
    unit = next(u for u in units if u.name == "a")
    group = ParamGroup([unit], BufferPool(), BufferPool())
    part = unit.parts[0]
    rows = torch.arange(2.0 * part.layout.numel).view(2, -1)
    first = _reduce(group, unit, rows)
    second = _reduce(group, unit, rows + 1)
    assert group.reductions == [first, second]
    assert group.staged() == 2  # both hold packed gradients
    finished = group.finish_oldest(lambda _: None)
    assert group.reductions == [second]
    ((got_part, reduced),) = finished.results
    assert got_part is part
    assert torch.equal(reduced, rows[0])  # the fake's sum: rank 0's row
    assert (finished.partial_bytes, finished.started) == (0, False)
    assert fake.issued == [("reduce_scatter", "a")] * 2


def test_the_reducer_waits_for_the_oldest_reduction_of_any_group_first(built, monkeypatch):
    units, _, _ = built
    groups = make_groups([[u] for u in units], BufferPool(), BufferPool())
    reducer = param_group.Reducer(world_size=W, spares={})
    waited: list[str] = []
    for group in groups:
        finish = group.finish_oldest

        def logged(spare: Any, group: ParamGroup = group, finish: Any = finish) -> Any:
            waited.append(group.name)
            return finish(spare)

        monkeypatch.setattr(group, "finish_oldest", logged)
    for group in groups:
        (unit,) = group.members
        reducer.reduce(group, unit, _full_grads(unit, 1.0), defer=False)
    # packing the second group's gradients waited for the first's reduction (MAX_PENDING)
    assert waited == ["a"]
    assert [g.name for g in reducer.order] == ["c"]
    reducer.finish()
    assert waited == ["a", "c"]
    assert reducer.order == []
    assert all(g.reductions == [] for g in groups)
    for group in groups:
        (unit,) = group.members
        for part in unit.parts:
            sums = reducer.gradients.sums[part]
            assert sums.shape == (part.layout.numel,)
            # rank 0's row of the packed gradients, divided by the world size
            assert torch.equal(sums * W, _packed_row(unit, part, 0))


def _packed_row(unit: UnitRuntime, part: Any, row: int) -> torch.Tensor:
    """Row ``row`` of ``unit``'s full gradients (its leaves' values) packed for ``part``'s reduce-scatter."""
    rows = torch.empty(W, part.layout.numel, dtype=part.grad_dtype)
    param_group.pack_into(
        part.layout, unit.split(_full_grads(unit, 1.0))[0], rows, unit.axes, scale=1.0
    )
    return rows[row]


def test_an_error_drops_every_collective_a_group_has_in_flight_and_its_step_state(built):
    units, _, memory = built
    (group,) = make_groups(plan_groups(units, 1 << 20), BufferPool(), BufferPool())
    group.prefetch(units[0])
    columns, _, _ = group.columns(units[0], 0, opened=0)
    columns.zero_()
    group.columns(units[1], 0, opened=1)
    group.flush(0)
    dropped = group.discard()
    # the reduce-scatter, then the shared all-gather of every part
    assert len(dropped) == 1 + len(units[0].parts)
    assert (group.reductions, group.inflight, group.rounds) == ([], {}, {})
    assert all(u.state is UnitState.SHARDED for u in units)
    assert memory.current == 0
