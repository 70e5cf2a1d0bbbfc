"""The memory ranks on one host share (``comm/shm/regions.py``): the board and reads across processes.

Descriptors on the board: what a rank posts is what its peers collect, and every wait ends.
[Note: descriptors on the board] in ``comm/shm/regions.py``. Two boards over the same
two anonymous pages stand for two ranks of a group in one process: a descriptor
posted by one is collected by the other with its words intact, slot after slot
around the ring; a slot is reused only once the peer's read mark has passed it;
a peer that never posts fails the wait with "timed out" (what a collective's
timeout says), and one whose process has exited fails it at once.

Shards read in place across processes: exact, agreed by every rank, and never read once written.
[Note: shards read in place] in ``comm/shm/regions.py``: where the kernel lets
ranks read each other's memory, an all-gather whose input is stable publishes it
as it is and peers copy it straight into their rows. The ranks agree on it at
the shared-memory probe; a rank that cannot (or will not) read its peers' memory
makes every rank of the group keep the regions. An evaluation hands its shards
back to the caller only once every peer has read them (``Arena.settle``): a peer
that has not is waited for, and past the collective timeout it is an error, never
a read of values the caller wrote since.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import funcshard as fs
from funcshard._src.comm import collectives, groups, runtime, shm
from funcshard._src.comm.runtime import CollectiveError
from funcshard._src.comm.shm import regions
from funcshard._src.comm.shm.regions import PAGE_BYTES, SLOTS, Board


def _boards(pids: list[int] | None = None) -> tuple[Board, Board]:
    pages = [mmap.mmap(-1, PAGE_BYTES), mmap.mmap(-1, PAGE_BYTES)]
    pids = pids or [os.getpid(), os.getpid()]
    return Board(pages, 0, pids), Board(pages, 1, pids)


def _descriptor(seq: int, salt: int) -> list[int]:
    return [0x1234, seq, 7 + salt, 8, 9 * seq + salt, 0, salt % 3, 64 + seq]


@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=3 * SLOTS))
def test_what_a_rank_posts_its_peer_collects_around_the_ring(salts):
    first, second = _boards()
    for seq, salt in enumerate(salts):
        mine, theirs = _descriptor(seq, salt), _descriptor(seq, salt + 1)
        first.post(seq, mine, 1.0)
        second.post(seq, theirs, 1.0)
        assert first.collect(seq, mine, 1.0) == [mine, theirs]
        assert second.collect(seq, theirs, 1.0) == [mine, theirs]
        first.set_mark(seq + 1)  # both have read collective seq
        second.set_mark(seq + 1)


def test_a_peer_that_never_posts_times_out_like_a_collective():
    first, _ = _boards()
    first.post(0, _descriptor(0, 0), 1.0)
    with pytest.raises(
        RuntimeError, match=r"timed out after 0.05 s waiting for group rank\(s\) \[1\]"
    ):
        first.collect(0, _descriptor(0, 0), 0.05)


def test_a_slot_is_reused_only_once_the_peer_has_read_it():
    first, second = _boards()
    for seq in range(SLOTS):
        first.post(seq, _descriptor(seq, 0), 1.0)
    with pytest.raises(RuntimeError, match=r"timed out .* reading descriptor 0"):
        first.post(SLOTS, _descriptor(SLOTS, 0), 0.05)
    second.set_mark(1)  # the peer read collective 0: its slot is free
    first.post(SLOTS, _descriptor(SLOTS, 0), 1.0)
    for seq in range(SLOTS):
        second.post(seq, _descriptor(seq, 1), 1.0)
    first.set_mark(1)
    second.post(SLOTS, _descriptor(SLOTS, 1), 1.0)
    assert second.collect(SLOTS, _descriptor(SLOTS, 1), 1.0)[0] == _descriptor(SLOTS, 0)


def test_a_peer_whose_process_exited_fails_the_wait_at_once():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    first, _ = _boards([os.getpid(), gone.pid])
    with pytest.raises(CollectiveError, match=rf"group rank 1 \(pid {gone.pid}\) exited"):
        first.collect(0, _descriptor(0, 0), 60.0)


AXES = ("fsdp",)


def test_a_read_copies_each_range_and_a_bad_address_is_an_error():
    source = torch.arange(64, dtype=torch.float32)
    first, second = torch.zeros(8), torch.zeros(4)
    regions.read_peer(os.getpid(), source.data_ptr(), [(0, first), (40 * 4, second)])
    assert first.tolist() == list(range(8))
    assert second.tolist() == list(range(40, 44))
    with pytest.raises(CollectiveError, match="the peer exited or the ranks are out of step"):
        regions.read_peer(os.getpid(), 8, [(0, torch.zeros(4))])
    assert regions.probe_peer(
        os.getpid(), source.data_ptr() + 8 * 4, int(source[8:10].view(torch.int64)[0])
    )


def _fresh_group() -> tuple[Any, Any]:
    """The ``fsdp`` group of a 2-rank mesh with its arena probed again on every rank."""
    bound = groups.bind(fs.Mesh({"fsdp": 2}))
    group = bound.group(AXES)
    assert group is not None
    regions._ARENAS.pop(group, None)
    return bound, group


def _gathers_read_in_place(offer: list[bool]) -> dict[str, Any]:
    bound, group = _fresh_group()
    if not offer[bound.rank]:
        os.environ[regions.READV_ENV] = "0"
    try:
        shard = torch.arange(6.0) + 100 * bound.rank
        gathered = collectives.all_gather(shard, bound, AXES, stable=True).wait()
        arena = shm.existing(group)
        assert arena is not None
        pieces = [(0, torch.zeros(2, 2)), (3, torch.zeros(2, 3))]
        collectives.all_gather_pieces(shard, bound, AXES, pieces, stable=True).wait()
        made = len(arena.regions)
        collectives.settle()
        return {
            "readv": arena.readv,
            "gathered": gathered.tolist(),
            "pieces": [rows.tolist() for _, rows in pieces],
            "regions made": made,
            "exposed": len(arena.exposed),
        }
    finally:
        os.environ.pop(regions.READV_ENV, None)
        regions._ARENAS.pop(group, None)  # later tests on this group probe afresh


@pytest.mark.parametrize("offer", [[True, True], [True, False]], ids=["both", "one refuses"])
def test_gathers_read_in_place_only_where_every_rank_can(pools, offer):
    rows = [[float(i + 100 * r) for i in range(6)] for r in range(2)]
    for rank, r in enumerate(pools.run(2, _gathers_read_in_place, offer)):
        both = all(offer) and regions.readv_offered()
        assert r["readv"] is both, f"rank {rank}: every rank of the group decides alike"
        assert r["gathered"] == rows
        assert r["pieces"] == [[row[0:2] for row in rows], [row[3:6] for row in rows]]
        assert (r["regions made"] == 0) is both, (
            f"rank {rank}: a region only without reading in place"
        )
        assert r["exposed"] == 0, f"rank {rank}: settled, nothing is kept"


def _settle_waits_for_the_reader() -> dict[str, Any]:
    bound, group = _fresh_group()
    previous = runtime.collective_timeout()
    shard = torch.full((1000,), float(bound.rank))
    try:
        pending = collectives.all_gather(shard, bound, AXES, stable=True)
        arena = shm.existing(group)
        assert arena is not None
        assert arena.readv
        out: dict[str, Any] = {}
        if bound.rank == 0:
            pending.wait()  # rank 0 reads; rank 1 has not read rank 0's shard yet
            runtime.set_collective_timeout(0.5)
            try:
                collectives.settle()
                out["first settle"] = "returned"
            except CollectiveError as e:
                out["first settle"] = str(e)
            runtime.set_collective_timeout(previous)
            dist.barrier()  # rank 1 reads now
            collectives.settle()
            shard.fill_(-1.0)  # the caller's write after the evaluation
        else:
            dist.barrier()  # only once rank 0's first settle gave up
            out["gathered"] = pending.wait().view(2, -1)[:, :3].tolist()
            collectives.settle()
        return out
    finally:
        runtime.set_collective_timeout(previous)
        regions._ARENAS.pop(group, None)


@pytest.mark.skipif(
    not regions.readv_offered(), reason="process_vm_readv is not available on this host"
)
def test_an_evaluation_returns_only_once_its_peers_have_read_its_shards(pools):
    first, second = pools.run(2, _settle_waits_for_the_reader)
    assert "have not read this rank's shard" in first["first settle"]
    assert "the ranks are out of step" in first["first settle"]
    assert second["gathered"] == [[0.0] * 3, [1.0] * 3]
