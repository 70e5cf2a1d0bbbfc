"""The order of streams, events and collectives of a parameter group, on the CPU with a recording fake.

See [Note: streams and buffer lifetimes] in ``execute/streams.py``. A fake device
module (streams, events, the current stream) logs every ``wait_stream``,
``wait_event``, event ``record`` and ``record_stream``, and a fake transport
(as in ``tests/test_param_group.py``) logs which stream was current when each
collective was issued and when each of its works was waited for, as NCCL's
would be. The tests run a full_shard step of two units and a hybrid_shard
reduction through real :class:`ParamGroup` objects, and check the order FSDP2
keeps: copy-in, then all-gather on its stream; the compute stream waits on the
all-gather's event before the unit is used; reduce-scatter on its stream after
the compute stream; the hybrid all-reduce right after its reduce-scatter, before
the host asks for it; no wait of a work while the compute stream is current.
What only a GPU shows (that the streams overlap, that no host sync happens in
torch itself) is for ``bench/gpu.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import funcshard as fs
from funcshard._src.comm import collectives as real_collectives
from funcshard._src.comm.collectives import Ledger, Pending
from funcshard._src.comm.groups import BoundMesh
from funcshard._src.execute import param_group
from funcshard._src.execute.param_group import BufferPool, ParamGroup
from funcshard._src.execute.streams import NO_STREAMS, DeviceStreams, streams_for
from funcshard._src.execute.unit_state import GatheredMemory, UnitRuntime, UnitState
from funcshard._src.plan.precision import MixedPrecision
from funcshard._src.shard.shard import plan_layouts, shard_for_rank
from funcshard._src.shard.sharded import flats_of
from funcshard._src.tree import flatten_with_paths

PARAMS = {
    "a": {"w": torch.arange(24.0).view(4, 6), "b": torch.arange(4.0)},
    "c": {"w": torch.arange(12.0).view(2, 6) + 100, "b": torch.arange(2.0) - 5},
}
SIDE = ("copy_in", "all_gather", "reduce_scatter", "all_reduce")  # made in this order


class FakeStream:
    def __init__(self, log: list[tuple[Any, ...]], name: str) -> None:
        self.log, self.name = log, name

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait_event", self.name, event.name))


class FakeEvent:
    count = 0

    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self.log, self.name = log, ""

    def record(self, stream: FakeStream) -> None:
        FakeEvent.count += 1
        self.name = f"e{FakeEvent.count}"
        self.log.append(("record", stream.name, self.name))


class FakeDeviceModule:
    """What ``DeviceStreams`` uses of ``torch.cuda``: Stream, Event, stream(), current_stream()."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.current = FakeStream(self.log, "compute")
        self.made: list[dict[str, Any]] = []

    def Stream(self, **kwargs: Any) -> FakeStream:  # torch.cuda.Stream
        self.made.append(kwargs)
        return FakeStream(self.log, SIDE[len(self.made) - 1])

    def Event(self) -> FakeEvent:  # torch.cuda.Event
        return FakeEvent(self.log)

    def current_stream(self) -> FakeStream:
        return self.current

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        before, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = before


class FakeWork:
    """An NCCL work: its wait makes the current stream wait; logged with that stream."""

    def __init__(self, device: FakeDeviceModule, op: str) -> None:
        self.device, self.op = device, op

    def wait(self, **kwargs: Any) -> bool:
        self.device.log.append(("work.wait", self.op, self.device.current.name, kwargs))
        return True


class RecordingCollectives:
    """Collectives answered in this process (rank 0's shards for every rank), logged with the current stream."""

    group_size = staticmethod(real_collectives.group_size)

    @staticmethod
    def input_rows(*args: Any, **kw: Any) -> None:
        """No transport's own input buffers: the group packs into its pools."""

    def __init__(self, device: FakeDeviceModule, rows: int) -> None:
        self.device, self.rows = device, rows

    def _pending(self, op: str, tag: str, result: torch.Tensor) -> Pending:
        self.device.log.append(("issue", op, self.device.current.name, tag))
        return Pending(result, FakeWork(self.device, op), op, backend="nccl")

    def all_gather(self, local: torch.Tensor, bound: Any, axes: Any, /, **kw: Any) -> Pending:
        out = kw["out"].view(self.rows, -1)
        out.copy_(local.expand(self.rows, -1))
        return self._pending("all_gather", kw.get("tag", ""), out)

    def all_gather_pieces(self, *args: Any, **kw: Any) -> Pending:
        raise AssertionError("not gathered leaf by leaf without a backend")

    def reduce_scatter(self, rows: torch.Tensor, bound: Any, axes: Any, /, **kw: Any) -> Pending:
        out = kw.get("out")
        out = rows[0].clone() if out is None else out.copy_(rows[0])
        return self._pending("reduce_scatter", kw.get("tag", ""), out)

    def all_reduce(self, buf: torch.Tensor, bound: Any, axes: Any, /, **kw: Any) -> Pending:
        return self._pending("all_reduce", kw.get("tag", ""), buf)


def _reduce(group: ParamGroup, unit: UnitRuntime, rows: torch.Tensor) -> Any:
    """Packs ``rows`` as ``unit``'s gradients of its first part and flushes the round: a group of one's."""
    columns, _, _ = group.columns(unit, 0, opened=0)
    columns.copy_(rows)
    return group.flush(0)


def _units(mesh: dict[str, int], strategy: Any, mp: MixedPrecision) -> list[UnitRuntime]:
    plan = fs.plan(PARAMS, fs.Mesh(mesh), units=["a", "c"], strategy=strategy)
    flats = list({id(f): f for f in flats_of(shard_for_rank(PARAMS, plan, 0))}.values())
    bound = BoundMesh(plan.mesh, 0, False)
    memory, ledger = GatheredMemory(), Ledger()
    layouts = plan_layouts(plan)
    units = []
    for u in plan.units:
        unit = UnitRuntime(u, [x for x in layouts if x.unit == u.name], bound, mp, ledger, memory)
        unit.bind([f for f in flats if f.layout.unit == u.name])
        units.append(unit)
    return units


@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> FakeDeviceModule:
    """A fake device's streams for every group, and the recording collectives (two ranks a group)."""
    module = FakeDeviceModule()
    kept: list[tuple[Any, ...]] = module.log

    def record_stream(tensor: torch.Tensor, stream: FakeStream) -> None:
        kept.append(("record_stream", stream.name))

    streams = DeviceStreams(module, record_stream=record_stream)
    monkeypatch.setattr(param_group, "_side", lambda _device: streams)
    monkeypatch.setattr(param_group, "collectives", RecordingCollectives(module, 2))
    return module


def _at(log: list[tuple[Any, ...]], entry: tuple[Any, ...], after: int = -1) -> int:
    for i in range(after + 1, len(log)):
        if log[i] == entry:
            return i
    raise AssertionError(f"{entry} not in the log after entry {after}: {log}")


def _event_after(log: list[tuple[Any, ...]], i: int, stream: str) -> tuple[int, str]:
    """The first event recorded on ``stream`` after entry ``i``."""
    for j in range(i + 1, len(log)):
        if log[j][0] == "record" and log[j][1] == stream:
            return j, log[j][2]
    raise AssertionError(f"no event recorded on {stream} after entry {i}: {log}")


def _no_host_wait(log: list[tuple[Any, ...]]) -> None:
    waits = [e for e in log if e[0] == "work.wait"]
    assert waits, "the test no longer sees the works' waits"
    for _, op, stream, kwargs in waits:
        # on NCCL a wait with no timeout makes the current stream wait, not the host
        assert stream in SIDE, f"{op}'s work was waited for on the {stream} stream"
        assert kwargs == {}, f"{op}'s work was waited for with {kwargs}"


def test_streams_are_four_high_priority_side_streams_and_none_on_the_cpu():
    module = FakeDeviceModule()
    DeviceStreams(module)
    assert module.made == [{"priority": -1}] * 4
    assert streams_for(torch.device("cpu")) is NO_STREAMS
    assert not NO_STREAMS.active


def test_a_full_shard_step_orders_copy_in_all_gather_compute_and_reduce_scatter_by_events(device):
    log = device.log
    units = _units({"fsdp": 2}, "full_shard", MixedPrecision(param_dtype=torch.bfloat16))
    groups = [ParamGroup([u], BufferPool(), BufferPool()) for u in units]
    a, c = units
    ga, gc = groups
    paths, leaves, _ = flatten_with_paths(PARAMS)
    expected = {p: x.to(torch.bfloat16).reshape(-1) for p, x in zip(paths, leaves)}

    def use(unit: UnitRuntime) -> None:
        log.append(("use", unit.name))
        assert unit.state is UnitState.GATHERED
        # rank 0's shard in every row: the first leaf's first half is rank 0's, cast
        slot, leaf = unit.slots[0], unit.full_leaves()[0]
        assert leaf.dtype == torch.bfloat16
        half = leaf.numel() // 2
        assert torch.equal(leaf.reshape(-1)[:half], expected[slot.path][:half]), slot.path

    # forward: a gathered, c prefetched while a is used, then c
    ga.acquire(a)
    use(a)
    gc.prefetch(c)
    ga.release(a)
    gc.acquire(c)
    use(c)
    gc.release(c)
    # backward: c's gradients, then a's
    for unit, group in ((c, gc), (a, ga)):
        part = unit.parts[0]
        rows = torch.ones(2, part.layout.numel, dtype=part.grad_dtype)
        log.append(("backward", unit.name))
        _reduce(group, unit, rows)
        log.append(("host asks", unit.name))
        ((_, reduced),) = group.finish_oldest(lambda _: None).results
        assert torch.equal(reduced, rows[0])
        log.append(("gradient used", unit.name))

    for unit in units:
        n = unit.name
        issued = _at(log, ("issue", "all_gather", "all_gather", n))
        # the shard was cast on the copy-in stream, after the compute stream, and the
        # all-gather stream waited for it before the all-gather was issued
        copy_in = _at(log, ("wait_stream", "copy_in", "compute"))
        assert copy_in < issued
        assert log.index(("wait_stream", "all_gather", "copy_in")) < issued
        # the event after it, and the compute stream waits on it before the unit is used
        recorded, event = _event_after(log, issued, "all_gather")
        assert ("record_stream", "all_gather") in log[issued:recorded]  # the cast shard
        waited = _at(log, ("wait_event", "compute", event), recorded)
        assert waited < log.index(("use", n))
        # reduce-scatter: on its stream, after the compute stream made the gradients
        backward = log.index(("backward", n))
        rs = _at(log, ("issue", "reduce_scatter", "reduce_scatter", n), backward)
        assert ("wait_stream", "reduce_scatter", "compute") in log[backward:rs]
        recorded, event = _event_after(log, rs, "reduce_scatter")
        assert ("record_stream", "reduce_scatter") in log[rs:recorded]  # the packed gradients
        waited = _at(log, ("wait_event", "compute", event), recorded)
        assert waited < log.index(("gradient used", n))
    assert not any(e[:2] == ("issue", "all_reduce") for e in log)
    _no_host_wait(log)


def test_hybrid_shard_all_reduces_right_after_the_reduce_scatter_on_its_stream(device):
    log = device.log
    units = _units({"dp": 2, "fsdp": 2}, "hybrid_shard", MixedPrecision())
    unit = units[0]
    group = ParamGroup([unit], BufferPool(), BufferPool())
    part = unit.parts[0]
    rows = torch.full((2, part.layout.numel), 3.0)
    _reduce(group, unit, rows)
    log.append(("host asks", unit.name))
    rs = _at(log, ("issue", "reduce_scatter", "reduce_scatter", unit.name))
    ar = _at(log, ("issue", "all_reduce", "all_reduce", unit.name), rs)
    # issued before the host asks for the reduction, after the all-reduce stream
    # waited for the reduce-scatter stream
    assert ar < log.index(("host asks", unit.name))
    assert ("wait_stream", "all_reduce", "reduce_scatter") in log[rs:ar]
    assert ("record_stream", "all_reduce") in log[rs:ar]  # its input, made on another stream
    ((_, out),) = group.finish_oldest(lambda _: None).results
    assert torch.equal(out, rows[0])
    recorded, event = _event_after(log, ar, "all_reduce")
    _at(log, ("wait_event", "compute", event), recorded)
    assert [e[1] for e in log if e[0] == "issue"] == ["reduce_scatter", "all_reduce"]
    _no_host_wait(log)


def test_on_the_cpu_hybrid_shard_all_reduces_when_the_host_waits(monkeypatch):
    """No streams: the order and results of before, the all-reduce issued by the wait."""
    module = FakeDeviceModule()
    monkeypatch.setattr(param_group, "collectives", RecordingCollectives(module, 2))
    unit = _units({"dp": 2, "fsdp": 2}, "hybrid_shard", MixedPrecision())[0]
    group = ParamGroup([unit], BufferPool(), BufferPool())
    part = unit.parts[0]
    rows = torch.full((2, part.layout.numel), 3.0)
    reduction = _reduce(group, unit, rows)
    assert [e[1] for e in module.log if e[0] == "issue"] == ["reduce_scatter"]
    assert reduction.stage.event is None
    group.finish_oldest(lambda _: None)
    assert [e[1] for e in module.log if e[0] == "issue"] == ["reduce_scatter", "all_reduce"]
    assert not any(e[0] in ("wait_stream", "wait_event", "record") for e in module.log)
