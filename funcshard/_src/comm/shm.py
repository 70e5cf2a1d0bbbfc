"""Shared-memory collectives for gloo ranks on one host: each rank's data crosses by one copy.

[Note: shared-memory collectives]
gloo on CPU sends every byte through a loopback socket: the kernel copies it
from the sender into socket buffers and again into the receiver, and on a
machine whose cores also run the ranks' compute, that CPU time is taken from
the step (on the 2-core benchmark machine a full_shard step spent 0.10-0.15 s
of system time in it). Ranks on one host can instead read each other's memory.
Each rank of a group owns *regions*, anonymous shared files (``memfd``) that
its peers map through ``/proc/<pid>/fd/<fd>``, and a collective is:

1. start: the rank copies what its peers need into a free region of its own
   (an all-gather: its shard; a reduce-scatter: every row but its own; an
   all-reduce: its buffer), then issues an all-gather of a 64-byte
   *descriptor* (magic, sequence number, pid, fd, bytes, read mark) on the
   group, asynchronously;
2. wait: once every rank's descriptor is in, the data has been written; the
   rank reads its peers' regions straight into the result (a copy for a
   gather, an add for a reduction, in group-rank order so that every rank of
   an all-reduce sums in the same order and gets the same bits).

A region is reused only once every peer has read it. A rank's *read mark* is
the lowest sequence number whose reads it has not finished; every descriptor
carries it, so a rank learns from the descriptors it receives which of its
regions every peer is done with. It never waits for that: a collective that
finds no free region of its size makes a new one, so no rank blocks on a
peer's progress outside a collective's own wait. In steady state the same
sizes recur every step and the regions are warm pages reused step after step.

Descriptors travel on the group itself, issued at the collective's start,
which every rank reaches in the same order (the same order the ring
algorithms rely on). A descriptor with the wrong magic or sequence number
means the ranks are out of step: :class:`CollectiveError`, never a read of
the wrong bytes.

The transport is chosen per group, once, by every rank together
(:func:`arena`): each rank makes a probe region holding a random nonce, the
ranks exchange descriptors, every rank maps its peers' probes and checks the
nonces, and an all-reduce of the results decides for all of them. Ranks on
different hosts, in different PID namespaces, or without ``memfd`` (not
Linux) keep gloo's sockets. ``FUNCSHARD_SHM=0`` turns the transport off.
"""

from __future__ import annotations

import datetime
import mmap
import os
import secrets
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from funcshard._src.comm import runtime
from funcshard._src.comm.algorithm import Timeout, wait_work
from funcshard._src.comm.channel import all_gather_single
from funcshard._src.comm.runtime import CollectiveError

ENV = "FUNCSHARD_SHM"
MAGIC = 0x6673_73686D  # "fsshm"
WORDS = 8  # a descriptor: (WORDS,) int64
PROBE_BYTES = 4096
# below this many bytes a collective keeps gloo's own: its descriptor exchange is itself a
# gloo collective, so a tiny payload gains nothing from the shared copy
MIN_BYTES = 0
_ALIGN = 4096


def enabled() -> bool:
    """Whether the shared-memory transport may be used: Linux with ``memfd`` and ``FUNCSHARD_SHM`` not ``0``.

    Example:
        >>> isinstance(enabled(), bool)
        True
    """
    return hasattr(os, "memfd_create") and os.environ.get(ENV, "1").strip() != "0"


@dataclass(eq=False)
class _Region:
    """One shared file of this rank: its fd, bytes, the mapping as a tensor, and the last collective that wrote it."""

    fd: int
    nbytes: int
    data: torch.Tensor  # (nbytes,) uint8 over the mapping
    last_seq: int = -1


@dataclass(eq=False)
class Arena:
    """One process group's shared regions on this rank and what it knows of its peers; mutated by every collective."""

    group: Any
    me: int
    w: int
    pids: list[int]
    regions: list[_Region] = field(default_factory=list)
    peer_maps: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    seq: int = 0  # collectives started on this arena: equal on every rank in step
    unread: set[int] = field(default_factory=set)  # started here, peers' regions not yet read
    marks: list[int] = field(default_factory=list)  # per group rank: its read mark, as last heard

    def __post_init__(self) -> None:
        weakref.finalize(self, _release, self.regions, self.marks, self.me)

    def read_mark(self) -> int:
        """The lowest sequence number this rank has not finished reading."""
        return min(self.unread) if self.unread else self.seq

    def region(self, nbytes: int) -> _Region:
        """A region of at least ``nbytes`` that every peer has finished reading; a new one if none is."""
        # free once every peer has read it, and this rank too: an all-reduce reads its own copy
        done = min(self.read_mark(), *(m for r, m in enumerate(self.marks) if r != self.me))
        free = [g for g in self.regions if g.last_seq < done and g.nbytes >= nbytes]
        if free:
            return min(free, key=lambda g: g.nbytes)
        made = _new_region(max(nbytes, 1))
        self.regions.append(made)
        return made

    def held_bytes(self) -> int:
        """Bytes of this rank's own regions."""
        return sum(g.nbytes for g in self.regions)

    def peer(self, rank: int, fd: int, nbytes: int) -> torch.Tensor:
        """Group rank ``rank``'s region ``fd``, mapped once; its first ``nbytes`` bytes."""
        key = (rank, fd)
        mapped = self.peer_maps.get(key)
        if mapped is None:
            mapped = _map_peer(self.pids[rank], fd)
            self.peer_maps[key] = mapped
        if nbytes > mapped.numel():
            raise CollectiveError(
                f"rank {rank}'s shared region holds {mapped.numel()} bytes, its descriptor "
                f"claims {nbytes}: the ranks are out of step"
            )
        return mapped[:nbytes]


_ARENAS: weakref.WeakKeyDictionary[Any, Arena | None] = weakref.WeakKeyDictionary()
_KEPT: list[int] = []  # fds of dropped arenas' regions a peer may not have mapped yet


def _release(regions: list[_Region], marks: list[int], me: int) -> None:
    """Closes a dropped arena's regions that every peer has read (and so mapped).

    A peer maps a region when it first reads it, in its wait, which may come
    after this rank dropped the group; a region it has not been heard to read
    stays open (:data:`_KEPT`) until this process exits.
    """
    done = min((m for r, m in enumerate(marks) if r != me), default=0)
    for g in regions:
        if g.last_seq < done:
            os.close(g.fd)
        else:
            _KEPT.append(g.fd)


def arena(group: Any, /) -> Arena | None:
    """The group's arena, set up by every rank together on first use; ``None`` where ranks cannot share memory.

    The first call on a group is collective (see [Note: shared-memory collectives]):
    every rank of the group must make it at the same point of its sequence of
    collectives on the group, as it does for any collective.
    """
    if group in _ARENAS:
        return _ARENAS[group]
    made = _probe(group) if enabled() else None
    _ARENAS[group] = made
    return made


def _probe(group: Any) -> Arena | None:
    w = dist.get_world_size(group)
    me = dist.get_group_rank(group, dist.get_rank())
    nonce = secrets.randbits(62)
    probe = _new_region(PROBE_BYTES)
    try:
        probe.data[:8].view(torch.int64)[0] = nonce
        mine = torch.tensor([MAGIC, os.getpid(), probe.fd, nonce, 0, 0, 0, 0], dtype=torch.int64)
        every = torch.zeros(w * WORDS, dtype=torch.int64)
        timeout = _timeout()
        wait_work(all_gather_single(every, mine, group=group, async_op=True), timeout)
        rows = every.view(w, WORDS).tolist()
        ok = 1
        for r, row in enumerate(rows):
            if r == me:
                continue
            try:
                seen = _map_peer(int(row[1]), int(row[2]))
                ok &= int(seen[:8].view(torch.int64)[0]) == int(row[3])
            except OSError:
                ok = 0
        agreed = torch.tensor([ok], dtype=torch.int64)
        reduced = dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group, async_op=True)
        wait_work(reduced, timeout)
    finally:  # every peer has mapped the probe or failed to once the all-reduce is past
        os.close(probe.fd)
    if not int(agreed[0]):
        return None
    return Arena(group, me, w, [int(row[1]) for row in rows], marks=[0] * w)


def _timeout() -> Timeout:
    seconds = runtime.collective_timeout()
    return None if seconds is None else datetime.timedelta(seconds=seconds)


def _new_region(nbytes: int) -> _Region:
    size = -(-nbytes // _ALIGN) * _ALIGN
    fd = os.memfd_create("funcshard-shm", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return _Region(fd, size, torch.frombuffer(mapping, dtype=torch.uint8))


def _map_peer(pid: int, fd: int) -> torch.Tensor:
    """Maps another process's shared file through ``/proc``; raises ``OSError`` where it cannot."""
    opened = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
    try:
        size = os.fstat(opened).st_size
        if size <= 0:
            raise OSError(f"/proc/{pid}/fd/{fd} is empty")
        mapping = mmap.mmap(opened, size)
    finally:
        os.close(opened)
    return torch.frombuffer(mapping, dtype=torch.uint8)


class _Exchange:
    """One collective in flight: this rank's region written, the descriptors being gathered.

    ``finish(views)`` gets each group rank's published bytes as a ``dtype``
    tensor (``None`` at this rank) once every descriptor is in.
    """

    def __init__(self, a: Arena, parts: Sequence[torch.Tensor], finish: Any, what: str) -> None:
        dtype = parts[0].dtype
        nbytes = sum(p.numel() for p in parts) * parts[0].element_size()
        region = a.region(nbytes)
        if nbytes:
            flat = region.data[:nbytes].view(dtype)
            at = 0
            for p in parts:
                flat[at : at + p.numel()].view(p.shape).copy_(p)
                at += p.numel()
        self.arena, self.region, self.seq, self.nbytes, self.dtype = a, region, a.seq, nbytes, dtype
        self.finish, self.what = finish, what
        region.last_seq = a.seq
        a.unread.add(a.seq)
        a.seq += 1
        mine = torch.tensor(
            [MAGIC, self.seq, os.getpid(), region.fd, nbytes, a.read_mark(), 0, 0],
            dtype=torch.int64,
        )
        self.every = torch.zeros(a.w * WORDS, dtype=torch.int64)
        self.work = all_gather_single(self.every, mine, group=a.group, async_op=True)

    def wait(self, timeout: Timeout = None) -> bool:
        wait_work(self.work, timeout)
        a = self.arena
        views: list[torch.Tensor | None] = []
        for r, row in enumerate(self.every.view(a.w, WORDS).tolist()):
            if (
                row[0] != MAGIC
                or row[1] != self.seq
                or row[2] != a.pids[r]
                or row[4] != self.nbytes
            ):
                raise CollectiveError(
                    f"{self.what}: group rank {r} is at another shared-memory collective "
                    f"(sequence {row[1]}, {row[4]} bytes; this rank: {self.seq}, "
                    f"{self.nbytes} bytes): the ranks are out of step"
                )
            a.marks[r] = max(a.marks[r], int(row[5]))
            views.append(
                None if r == a.me else a.peer(r, int(row[3]), self.nbytes).view(self.dtype)
            )
        self.finish(views)
        a.unread.discard(self.seq)
        return True


def all_gather(a: Arena, flat: torch.Tensor, rows: torch.Tensor, /) -> _Exchange:
    """Starts gathering every group rank's ``flat`` ``(n,)`` into ``rows`` ``(W, n)``; writes ``rows``."""
    own = rows[a.me]

    def finish(views: list[torch.Tensor | None]) -> None:
        for r, v in enumerate(views):
            if v is not None:
                rows[r].copy_(v)

    op = _Exchange(a, [flat], finish, "shared-memory all-gather")
    if own.data_ptr() != flat.data_ptr():
        own.copy_(flat)
    return op


def reduce_scatter(a: Arena, rows: torch.Tensor, out: torch.Tensor, /) -> _Exchange:
    """Starts summing ``rows`` ``(W, n)`` over the group into ``out`` ``(n,)``: group rank ``i`` gets row ``i``'s sum.

    This rank publishes every row but its own; it sums its peers' copies of its
    row and its own in group-rank order.
    """
    me, w = a.me, a.w
    parts = [p for p in (rows[:me], rows[me + 1 :]) if p.numel()]

    def finish(views: list[torch.Tensor | None]) -> None:
        terms = [
            rows[me] if v is None else v.view(w - 1, -1)[me if me < r else me - 1]
            for r, v in enumerate(views)
        ]
        torch.add(terms[0], terms[1], out=out)
        for t in terms[2:]:
            out.add_(t)

    return _Exchange(a, parts, finish, "shared-memory reduce-scatter")


def all_reduce(a: Arena, buf: torch.Tensor, /) -> _Exchange:
    """Starts summing ``buf`` over the group, in place; mutates ``buf``.

    Every rank adds the group's buffers in group-rank order, reading its own from
    its region, so every rank gets the same bits.
    """
    flat = buf.view(-1)
    holder: list[torch.Tensor] = []

    def finish(views: list[torch.Tensor | None]) -> None:
        terms = [holder[0] if v is None else v for v in views]
        torch.add(terms[0], terms[1], out=flat)
        for t in terms[2:]:
            flat.add_(t)

    op = _Exchange(a, [flat], finish, "shared-memory all-reduce")
    holder.append(op.region.data[: op.nbytes].view(flat.dtype))
    return op
