"""Shared-memory collectives: exact results with many in flight, bounded regions, and every way out.

Each worker runs all-gathers, reduce-scatters and all-reduces through
``comm/shm/`` with several in flight and waits for them in another order than it
started them, as the executor does; the references are gloo's own collectives
on the same inputs. The all-reduce must give the same bits on every rank (a
replicated parameter must stay replicated). Ranks that cannot map each other's
memory fall back together; a descriptor from a rank at another collective is
an error naming it, never a read of the wrong bytes.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

import funcshard as fs
from funcshard._src.comm import collectives, groups, shm, transport
from funcshard._src.comm.runtime import CollectiveError
from funcshard._src.comm.shm import regions

ag = transport.ALL_GATHER  # the all-gather's algorithms on gloo
rs = transport.REDUCE_SCATTER  # the reduce-scatter's algorithms on gloo

MESHES = {
    "world2": ({"fsdp": 2}, ("fsdp",)),
    "world4": ({"fsdp": 4}, ("fsdp",)),
    "2x2/dp": ({"dp": 2, "fsdp": 2}, ("dp",)),
}
ROUNDS = 12


def _many_in_flight(
    mesh: dict[str, int], axes: tuple[str, ...], large_bytes: int | None = None
) -> dict[str, Any]:
    if large_bytes is not None:  # every region counts as large: trimmed while free
        real = regions.LARGE_BYTES
        regions.LARGE_BYTES = large_bytes
        try:
            return _many_in_flight(mesh, axes)
        finally:
            regions.LARGE_BYTES = real
    bound = groups.bind(fs.Mesh(mesh))
    group = bound.group(axes)
    assert group is not None
    arena = shm.arena(group)
    assert arena is not None, "ranks of one host share memory"
    w, me = arena.w, arena.me
    before = len(arena.regions)  # the worker's earlier tests may have left some
    gen = torch.Generator().manual_seed(bound.rank)
    wrong: list[str] = []
    held: list[int] = []
    for it in range(ROUNDS):
        n = 257 + 64 * (it % 3)  # sizes that recur, as a step's units do
        flat = torch.randn(n, generator=gen)
        rows = torch.full((w, n), float("nan"))
        grads = torch.randn(w, n, generator=gen)
        out = torch.full((n,), float("nan"))
        buf = torch.randn(2 * n, generator=gen).to(torch.bfloat16 if it % 2 else torch.float32)
        refs = (flat.clone(), grads.clone(), buf.clone())
        ops = [
            ag.start("shm", flat, rows, group),
            rs.start("shm", grads, out, group),
            shm.all_reduce(arena, buf),
        ]
        for op in reversed(ops) if it % 2 else ops:
            op.wait()
        gathered = [torch.empty_like(refs[0]) for _ in range(w)]
        dist.all_gather(gathered, refs[0], group=group)
        if not torch.equal(rows, torch.stack(gathered)):
            wrong.append(f"all-gather, round {it}")
        summed = refs[1].clone()
        dist.all_reduce(summed, group=group)
        if not torch.allclose(out, summed[me], rtol=1e-5, atol=1e-5):
            wrong.append(f"reduce-scatter, round {it}")
        others = [torch.empty_like(refs[2]) for _ in range(w)]
        dist.all_gather(others, refs[2], group=group)
        total = torch.stack(others).double().sum(0)
        # each of the W - 1 additions rounds once: 2**-8 of |sum| < 16 in bfloat16
        tol = 3 * 16 * 2**-9 if buf.dtype == torch.bfloat16 else 1e-5
        if not torch.allclose(buf.double(), total, rtol=0, atol=tol):
            wrong.append(f"all-reduce, round {it}")
        everyone = [torch.empty_like(buf) for _ in range(w)]
        dist.all_gather(everyone, buf, group=group)
        if not all(torch.equal(everyone[0], b) for b in everyone):
            wrong.append(f"all-reduce differs between ranks, round {it}")
        held.append(len(arena.regions) - before)
    peers = [view.data_ptr() for _, view in arena.peer_maps.values()]
    return {"wrong": wrong, "regions": held, "peer_resident": _resident_bytes(peers)}


def _resident_bytes(starts: list[int]) -> int:
    """Resident bytes of this process's mappings that begin at ``starts`` (``/proc/self/smaps``)."""
    wanted, total, inside = set(starts), 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                inside = int(head.split("-")[0], 16) in wanted
            elif inside and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.parametrize("trimmed", [False, True], ids=["kept", "trimmed"])
@pytest.mark.parametrize("name", sorted(MESHES))
def test_collectives_in_flight_equal_gloo_and_reuse_their_regions(pools, name, trimmed):
    """Also with every region "large": its pages given back while free; a reader keeps no peer's pages."""
    mesh, axes = MESHES[name]
    large = 0 if trimmed else None
    for rank, r in enumerate(pools.run(fs.Mesh(mesh).size, _many_in_flight, mesh, axes, large)):
        assert r["wrong"] == [], f"rank {rank}: {r['wrong']}"
        # three collectives in flight at a time: their regions, and a few a peer had not
        # yet been heard to finish reading; never one per collective started
        assert r["regions"][-1] == r["regions"][ROUNDS // 2], f"rank {rank}: {r['regions']}"
        assert r["regions"][-1] <= 12, f"rank {rank}: {r['regions']}"
        # see [Note: peers' pages] in ``comm/shm/regions.py``: what a rank read from its peers is not in its RSS
        assert r["peer_resident"] == 0, f"rank {rank}: {r['peer_resident']} bytes of peers'"


def _cannot_map_a_peer() -> dict[str, Any]:
    bound = groups.bind(fs.Mesh({"dp": 2, "fsdp": 2}))
    group = bound.group(("fsdp",))
    assert group is not None
    regions._ARENAS.pop(group, None)  # probe again, on every rank: the group may have been used
    real = regions._map_peer
    if bound.rank == 1:  # as a rank in another PID namespace, or on another host, finds

        def refuse(pid: int, fd: int) -> Any:
            raise PermissionError(f"/proc/{pid}/fd/{fd}")

        regions._map_peer = refuse
    try:
        rows = torch.arange(4.0) + 10 * bound.rank
        out = collectives.reduce_scatter(rows.view(2, 2), bound, ("fsdp",)).wait()
        gathered = collectives.all_gather(torch.tensor([float(bound.rank)]), bound, ("fsdp",))
        buf = torch.full((3,), float(bound.rank))
        collectives.all_reduce(buf, bound, ("fsdp",)).wait()
        return {
            "arena": shm.arena(group) is not None,
            "out": out.tolist(),
            "gathered": gathered.wait().view(-1).tolist(),
            "sum": buf.tolist(),
        }
    finally:
        regions._map_peer = real
        regions._ARENAS.pop(group, None)  # later tests on this group probe afresh


def test_ranks_that_cannot_share_memory_fall_back_together_to_gloo(pools):
    results = pools.run(4, _cannot_map_a_peer)
    for rank, r in enumerate(results):
        members = [0, 1] if rank < 2 else [2, 3]
        me = members.index(rank)
        assert r["arena"] is (rank >= 2), f"rank {rank}: only the group of ranks 0-1 falls back"
        rows = [torch.arange(4.0).view(2, 2) + 10 * m for m in members]
        assert r["out"] == (rows[0][me] + rows[1][me]).tolist()
        assert r["gathered"] == [float(m) for m in members]
        assert r["sum"] == [float(sum(members))] * 3


def _out_of_step() -> str:
    bound = groups.bind(fs.Mesh({"fsdp": 2}))
    group = bound.group(("fsdp",))
    assert group is not None
    arena = shm.arena(group)
    assert arena is not None
    n = 5 + bound.rank  # rank 1 gathers another unit, of another size
    try:
        collectives.all_gather(torch.ones(n), bound, ("fsdp",), tag="b/1").wait()
    except CollectiveError as e:
        return str(e)
    return ""


def test_a_peer_at_another_collective_is_an_error_not_a_wrong_read(pools):
    try:
        errors = pools.run(2, _out_of_step)
    finally:
        pools.pool(2).close()  # both ranks are out of step: the next test starts fresh
    for rank, error in enumerate(errors):
        assert f"all_gather of unit 'b/1' over mesh axes ['fsdp'] on rank {rank} failed" in error
        assert "the ranks are out of step" in error


def test_the_transport_is_off_under_funcshard_shm_0(monkeypatch):
    monkeypatch.setenv(shm.ENV, "0")
    assert not shm.enabled()
    assert ag.resolve("auto", "gloo", 2, 1 << 30) == "ring_overlapped"
    assert rs.resolve("auto", "gloo", 2, 1 << 30) == "ring"
    assert ag.leaf_algorithm() == "ring_overlapped"


def _sharing(mesh: dict[str, int], axes: tuple[str, ...]) -> tuple[Any, Any, shm.Arena]:
    """The bound mesh, the group over ``axes`` and its arena, once the group shares memory."""
    bound = groups.bind(fs.Mesh(mesh))
    group = bound.group(axes)
    assert group is not None
    collectives.all_gather(torch.ones(4), bound, axes).wait()  # the group shares memory now
    arena = regions.existing(group)
    assert arena is not None
    return bound, group, arena


def _inputs_in_regions(mesh: dict[str, int], axes: tuple[str, ...]) -> dict[str, Any]:
    """Reduce-scatter and all-reduce inputs packed straight into regions: sent as they are."""
    bound, group, arena = _sharing(mesh, axes)
    w, n = arena.w, 301
    gen = torch.Generator().manual_seed(bound.rank)
    wrong = []
    for it in range(4):
        rows = collectives.input_rows(bound, axes, n, torch.float32)
        assert rows is not None
        assert arena.owner(rows) is not None
        rows.copy_(torch.randn(w, n, generator=gen))
        reference = rows.clone()
        out = collectives.reduce_scatter(rows, bound, axes).wait()
        dist.all_reduce(reference, group=group)
        if not torch.allclose(out, reference[arena.me], rtol=1e-5, atol=1e-5):
            wrong.append(f"reduce-scatter, round {it}")
        buf = collectives.input_rows(bound, axes, n, torch.float32, all_reduce=True)
        assert buf is not None
        buf.copy_(torch.randn(n, generator=gen))
        reference = buf.clone()
        dest = torch.full((n,), float("nan"))
        got = collectives.all_reduce(buf, bound, axes, out=dest).wait()
        dist.all_reduce(reference, group=group)
        if got.data_ptr() != dest.data_ptr() or not torch.allclose(dest, reference, atol=1e-5):
            wrong.append(f"all-reduce, round {it}")
        everyone = [torch.empty_like(dest) for _ in range(w)]
        dist.all_gather(everyone, dest, group=group)
        if not all(torch.equal(everyone[0], d) for d in everyone):
            wrong.append(f"all-reduce differs between ranks, round {it}")
    return {"wrong": wrong, "regions": len(arena.regions)}


@pytest.mark.parametrize("name", ["world2", "world4"])
def test_inputs_packed_into_regions_are_sent_as_they_are(pools, name):
    mesh, axes = MESHES[name]
    for rank, r in enumerate(pools.run(fs.Mesh(mesh).size, _inputs_in_regions, mesh, axes)):
        assert r["wrong"] == [], f"rank {rank}: {r['wrong']}"
        assert r["regions"] <= 8, f"rank {rank}: {r['regions']} regions"


def _socket_all_reduce_into_out(monkeypatch_env: str) -> list[float]:
    bound = groups.bind(fs.Mesh({"fsdp": 2}))
    buf = torch.full((2,), 1.0 + bound.rank)
    out = torch.zeros(2)
    os.environ[shm.ENV] = monkeypatch_env  # gloo's own all-reduce in place, then copied out
    try:
        collectives.all_reduce(buf, bound, ("fsdp",), out=out).wait()
    finally:
        del os.environ[shm.ENV]
    return out.tolist()


def test_an_all_reduce_on_sockets_gives_its_sum_to_out_too(pools):
    for r in pools.run(2, _socket_all_reduce_into_out, "0"):
        assert r == [3.0, 3.0]


def _own_row_apart(mesh: dict[str, int], axes: tuple[str, ...]) -> dict[str, Any]:
    """A reduce-scatter whose own row is made when summed ([Note: the own row from the leaves] in ``shard/flat.py``)."""
    bound, _, arena = _sharing(mesh, axes)
    w, n, me = arena.w, 301, arena.me
    gen = torch.Generator().manual_seed(bound.rank)
    wrong = []
    for it in range(3):
        grads = torch.randn(w, n, generator=gen)
        rows = collectives.input_rows(bound, axes, n, torch.float32)
        assert rows is not None
        rows.copy_(grads * 0.5)
        whole = collectives.reduce_scatter(rows, bound, axes).wait().clone()
        rows = collectives.input_rows(bound, axes, n, torch.float32)
        assert rows is not None
        rows.fill_(float("nan"))
        rows[[r for r in range(w) if r != me]] = grads[[r for r in range(w) if r != me]] * 0.5

        def own(out: torch.Tensor, base: torch.Tensor | None, row=grads[me]) -> None:
            if base is None:
                torch.mul(row, 0.5, out=out)
            else:
                torch.add(base, row, alpha=0.5, out=out)

        apart = collectives.reduce_scatter(rows, bound, axes, own=own).wait()
        if not torch.equal(apart, whole):
            wrong.append(f"round {it}")
    try:
        collectives.reduce_scatter(torch.zeros(w, n), bound, axes, own=own).wait()
        wrong.append("own with rows outside a region was accepted")
    except ValueError as e:
        if "collectives.input_rows" not in str(e):
            wrong.append(f"unclear error: {e}")
    return {"wrong": wrong}


@pytest.mark.parametrize("name", ["world2", "world4"])
def test_a_reduce_scatter_with_its_own_row_apart_gives_the_same_bits(pools, name):
    mesh, axes = MESHES[name]
    for rank, r in enumerate(pools.run(fs.Mesh(mesh).size, _own_row_apart, mesh, axes)):
        assert r["wrong"] == [], f"rank {rank}: {r['wrong']}"


def _trimmed_once_every_peer_has_read(large: bool) -> tuple[list[bool], list[bool]]:
    """Every region's `trimmed` after reductions, before and after Arena.trim behind a barrier.

    ``large``: every region counts as large (``LARGE_BYTES`` of 1).
    """
    real = regions.LARGE_BYTES
    if large:
        regions.LARGE_BYTES = 1
    try:
        w = dist.get_world_size()
        bound = groups.bind(fs.Mesh({"fsdp": w}))
        group = bound.group(("fsdp",))
        assert group is not None
        arena = shm.arena(group)
        assert arena is not None, "ranks of one host share memory"
        first = arena.seq  # the worker's earlier tests may have left regions
        for n in (300, 500, 300):
            out = torch.empty(n)
            rs.start("shm", torch.ones(w, n), out, group).wait()
        used = [g for g in arena.regions if g.last_seq >= first]
        before = [g.trimmed for g in used]
        dist.barrier(group=group)  # every peer is past its reads, as at a step's start
        arena.trim()
        return before, [g.trimmed for g in used]
    finally:
        regions.LARGE_BYTES = real


@pytest.mark.parametrize(
    ("w", "large", "trimmed"),
    [(2, True, True), (2, False, False), (4, False, True)],
    ids=["large", "small-at-w2-kept", "small-at-w4"],
)
def test_trim_gives_back_every_large_region_the_peers_are_done_with(pools, w, large, trimmed):
    # a root unit's packed gradients are a large region used once a step; a step gives it
    # back when it starts, once every rank has agreed to (value_and_grad's collectives.settle);
    # at W > 2 every region, which would otherwise stay resident through the next forward
    # ([Note: draining regions] in comm/shm/regions.py)
    for _, after in pools.run(w, _trimmed_once_every_peer_has_read, large):
        assert after, "the reductions made regions"
        assert after == [trimmed] * len(after), after


def test_a_step_settles_the_transport_when_it_starts_and_ends(monkeypatch):
    from funcshard._src.execute import run, value_and_grad

    events: list[str] = []
    monkeypatch.setattr(value_and_grad.collectives, "settle", lambda: events.append("settle"))
    monkeypatch.setattr(run.collectives, "settle", lambda: events.append("settle"))
    params = {"w": torch.ones(4)}
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}))

    def loss(p):
        events.append("loss_fn")
        return p["w"].sum()

    fs.value_and_grad(loss, plan)(fs.shard(params, plan))
    assert events == ["settle", "loss_fn", "settle"]


def test_a_reduction_lets_go_of_each_peers_pages_before_it_reads_the_next():
    # [Note: peers' pages] in comm/shm/regions.py: a reader drops each peer's view right after
    # adding it, so at most one peer's pages count in its resident set at a time. Here term r
    # holds its values only once done(r - 1) was called: a sum that read ahead would be NaN.
    from funcshard._src.comm.shm import _sum_in_order

    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(5, generator=gen) for _ in range(4)]
    terms = [v.clone() if r < 2 else torch.full((5,), float("nan")) for r, v in enumerate(values)]
    dones: list[int] = []

    def done(r: int) -> None:
        dones.append(r)
        if r + 1 < len(terms) and r >= 1:
            terms[r + 1].copy_(values[r + 1])
        terms[r].fill_(float("nan"))  # dropped: never read again

    out = torch.empty(5)
    _sum_in_order(terms, out, done)
    assert torch.equal(out, ((values[0] + values[1]) + values[2]) + values[3])
    assert dones == [0, 1, 2, 3]


@pytest.mark.parametrize("me", [0, 1, 2, 3])
def test_a_reduction_with_its_own_row_apart_lets_go_of_every_peer_in_order(me):
    from funcshard._src.comm.shm import _sum_with_own

    gen = torch.Generator().manual_seed(me)
    values = [torch.randn(5, generator=gen) for _ in range(4)]
    dones: list[int] = []

    def own(out: torch.Tensor, base: torch.Tensor | None) -> None:
        torch.add(values[me], out if base is None else base, out=out)

    out = torch.empty(5)
    given = [None if r == me else v for r, v in enumerate(values)]
    _sum_with_own(given, me, own, out, dones.append)
    # the first addition is commutative: the same bits as the sum in group-rank order
    assert torch.equal(out, ((values[0] + values[1]) + values[2]) + values[3])
    assert dones == [r for r in range(4) if r != me]


def _drained_without_a_barrier() -> tuple[list[bool], list[bool]]:
    """Regions' `trimmed` after Arena.drain: those read (a peer late to read), then one in flight."""
    import time

    bound = groups.bind(fs.Mesh({"fsdp": 3}))
    group = bound.group(("fsdp",))
    assert group is not None
    arena = shm.arena(group)
    assert arena is not None, "ranks of one host share memory"
    me = dist.get_rank()
    n = 1000  # small regions: drain gives back any size, not only LARGE_BYTES
    works = []
    for _ in range(2):  # two in flight: two regions, as a block's and the next one's
        rows = shm.input_rows(arena, 3, n, torch.float32)
        rows.fill_(1.0)
        works.append(shm.reduce_scatter(arena, rows, torch.empty(n)))
    for w in works:
        if me == 1:
            time.sleep(0.3)  # a peer slow to read: the others' drain waits for it
        w.wait()
    arena.drain()
    read = [g.trimmed for g in arena.regions]
    rows = shm.input_rows(arena, 3, n, torch.float32)
    rows.fill_(1.0)
    flying = shm.reduce_scatter(arena, rows, torch.empty(n))
    arena.drain()  # its own reduction not yet read: that region stays
    held = [g.trimmed for g in arena.regions if g.last_seq == flying.seq]
    flying.wait()
    return read, held


def test_drain_gives_back_every_region_read_once_every_peer_has_read_it(pools):
    # where a step drains its staging pools, the regions it packed gradients into go too:
    # [Note: draining regions] in comm/shm/regions.py
    for read, held in pools.run(3, _drained_without_a_barrier):
        assert len(read) == 2, read
        assert all(read), read
        assert held == [False], held


def _drain_with_a_peer_that_never_reads() -> str:
    """Rank 1 posts its rows and never waits (never reads): the others' drain fails in time."""
    import time

    from funcshard._src.comm import runtime

    bound = groups.bind(fs.Mesh({"fsdp": 3}))
    group = bound.group(("fsdp",))
    assert group is not None
    arena = shm.arena(group)
    assert arena is not None, "ranks of one host share memory"
    rows = shm.input_rows(arena, 3, 100, torch.float32)
    rows.fill_(1.0)
    work = shm.reduce_scatter(arena, rows, torch.empty(100))
    if dist.get_rank() == 1:
        time.sleep(3.0)  # past the others' timeout, then leaves without reading
        return ""
    work.wait()
    runtime.set_collective_timeout(1.0)
    try:
        arena.drain()
    except CollectiveError as e:
        return str(e)
    finally:
        runtime.set_collective_timeout(None)
    return ""


def test_a_drain_waiting_for_a_peer_that_never_reads_fails_in_time(pools):
    # [Note: draining regions] in comm/shm/regions.py: the wait fails like a collective's
    try:
        errors = pools.run(3, _drain_with_a_peer_that_never_reads)
    finally:
        pools.pool(3).close()  # out of step: the next test starts fresh
    for rank in (0, 2):
        assert "group rank(s) [1] have not finished reading" in errors[rank], errors[rank]
        assert "the ranks are out of step" in errors[rank]
