"""Shared regions of one process group on one host: made, mapped by peers, reused once read.

The memory the shared-memory collectives (``shm/__init__.py``, [Note: shared-memory
collectives]) move data through: each rank's regions (``memfd`` files its peers
map through ``/proc/<pid>/fd/<fd>``), which of them every peer has finished
reading (the read marks), and the probe that decides, once per group and on
every rank together, whether its ranks can share memory at all.
"""

from __future__ import annotations

import datetime
import mmap
import os
import platform
import secrets
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import funcshard._src.comm.shm.cross_memory as cross_memory
from funcshard._src.comm import runtime
from funcshard._src.comm.channel import all_gather_single
from funcshard._src.comm.runtime import CollectiveError, Timeout, wait_work
from funcshard._src.comm.shm.board import PAGE_BYTES, Board
from funcshard._src.comm.transport import LARGE_BYTES, SHM_ENV, SHM_MIN_BYTES, shm_enabled

ENV = SHM_ENV
MAGIC = 0x6673_73686D  # "fsshm"
WORDS = 8  # a descriptor: (WORDS,) int64
PROBE_BYTES = PAGE_BYTES
MIN_BYTES = SHM_MIN_BYTES
_ALIGN = 4096
# regions of LARGE_BYTES or more (comm/transport.py) give their pages back while free
# (MADV_REMOVE): a root unit's embeddings are gathered once and reduced once a step, and
# their copies would otherwise stay resident all step in the owner
# [Note: peers' pages]
# A page a rank reads from a peer's region counts in its own resident set as a shared page,
# so a reader that kept its views would hold, in RSS, every page of every peer's regions it
# ever read: W - 1 copies of what each peer holds. At W = 8 on a 0.47B Llama that was
# 196 MiB a rank between steps and about 200 MiB of each rank's peak
# (bench/results/large_model_fsdp2). A reader therefore drops its whole view of a region
# (MADV_DONTNEED) once read, whatever its size, and, with more than one peer, before it reads
# the next peer's (the ``done`` of a shared-memory collective's finish, shm/__init__.py): while
# a reduction adds W - 1 peers' rows, only one peer's pages count in its resident set at a
# time, not W - 1 (a root unit's at W = 8: 7/8 of its packed gradients; large_vocab in
# bench/results/memory_shapes: 1.12x FSDP2's peak without it, 0.92x with it). With one peer the
# view goes after the read mark is set, which the peer reads before it reuses the region
# (else it makes another). The data stays in the peer's file, and the
# next read maps it again, a minor fault per 64 KiB (the kernel's fault-around, which also
# maps written pages beyond those read, hence the whole view), about 0.3 ms on an 8 MiB
# read on the benchmark machine, where the copy itself takes about 1 ms.
_REMOVE = getattr(mmap, "MADV_REMOVE", None)
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)
# [Note: read marks]
# A descriptor carries its rank's read mark as of the collective's start, so a mark heard
# that way lags: with a step's reductions all in flight, a region is known free only two
# steps on, and a step's worth of regions more is held. Each rank therefore also keeps its
# mark, as it stands, in word 1 of its probe page, which its peers map, and writes it after
# finishing a collective's reads; a writer reads its peers' marks there before reusing a
# region. That a peer's reads are done before its mark is seen, and the mark read before
# the region is written, is the order x86's memory model keeps for plain loads and stores
# (TSO; the argument is under "Memory ordering" in [Note: shared-memory collectives],
# shm/__init__.py); elsewhere only the descriptors' marks are used.
_ORDERED_MACHINES = frozenset({"x86_64", "amd64", "i386", "i686"})


enabled = shm_enabled


@dataclass(eq=False)
class Region:
    """One shared file of this rank: its fd, bytes, the mapping as a tensor, and the last collective that wrote it."""

    fd: int
    nbytes: int
    mapping: mmap.mmap
    data: torch.Tensor  # (nbytes,) uint8 over the mapping
    last_seq: int = -1
    trimmed: bool = False  # its pages given back (a large region, free): see LARGE_BYTES


@dataclass(eq=False)
class Arena:
    """One process group's shared regions on this rank and what it knows of its peers; mutated by every collective."""

    group: Any
    me: int
    w: int
    pids: list[int]
    regions: list[Region] = field(default_factory=list)
    peer_maps: dict[tuple[int, int], tuple[mmap.mmap, torch.Tensor]] = field(default_factory=dict)
    seq: int = 0  # collectives started on this arena: equal on every rank in step
    unread: set[int] = field(default_factory=set)  # started here, peers' regions not yet read
    marks: list[int] = field(default_factory=list)  # per group rank: its read mark, as last heard
    # every group rank's probe page, word 1 its read mark as it stands (see [Note: read marks]),
    # and the descriptors ([Note: descriptors on the board] in board.py); None: not shared live
    board: Board | None = None
    # whether peers read stable inputs in place ([Note: shards read in place] in cross_memory.py)
    readv: bool = False
    # (sequence number, tensor) published in place, kept until every peer has read it
    exposed: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        weakref.finalize(self, _release, self.regions, self.marks, self.me)

    def read_mark(self) -> int:
        """The lowest sequence number this rank has not finished reading."""
        return min(self.unread) if self.unread else self.seq

    def finished(self, seq: int, /) -> None:
        """Records that this rank has read every peer's data of collective ``seq``; mutates the arena."""
        self.unread.discard(seq)
        if self.board is not None:
            self.board.set_mark(self.read_mark())

    def _heard(self) -> None:
        """Takes in the peers' read marks from their pages (where shared marks are used)."""
        if self.board is not None:
            for r in range(self.w):
                if r != self.me:
                    self.marks[r] = max(self.marks[r], self.board.mark(r))

    def _peers_done(self) -> int:
        """The lowest sequence number some peer has not finished reading, as last heard."""
        self._heard()
        return min((m for r, m in enumerate(self.marks) if r != self.me), default=self.seq)

    def expose(self, seq: int, t: torch.Tensor, /) -> None:
        """Keeps ``t``, published in place by collective ``seq``, until every peer has read it; mutates."""
        done = self._peers_done()
        self.exposed = [(q, kept) for q, kept in self.exposed if q >= done]
        self.exposed.append((seq, t))

    def settle(self) -> None:
        """Returns once every peer has read what this rank published in place; mutates.

        See [Note: shards read in place] in ``cross_memory.py``: called before an
        evaluation returns, so that the caller may write its shards. In training the
        peers are done already; otherwise this waits for a slower peer's last gather.

        Gives back the pages of every large region the peers are done with too
        (:meth:`trim`).

        Raises:
            CollectiveError: a peer exited, or has not read within the collective timeout.
        """
        self.trim()
        if not self.exposed:
            return
        assert self.board is not None  # reading in place needs the live marks of a board

        def read() -> bool:
            done = self._peers_done()
            self.exposed = [(q, kept) for q, kept in self.exposed if q >= done]
            return not self.exposed

        def late() -> list[int]:
            return [r for r, m in enumerate(self.marks) if r != self.me and m <= self.exposed[0][0]]

        seq = self.exposed[0][0]
        timeout_s = runtime.wait_limit_s()
        what = f"it read this rank's shard of shared-memory collective {seq}"
        try:
            self.board.wait_until(read, late, timeout_s, what)
        except CollectiveError:  # a peer exited
            raise
        except RuntimeError as e:  # timed out
            raise CollectiveError(
                f"group rank(s) {late()} have not read this rank's shard of shared-memory "
                f"collective {self.exposed[0][0]} in time: the ranks are out of step"
            ) from e

    def region(self, nbytes: int) -> Region:
        """A region of at least ``nbytes`` that every peer has finished reading; a new one if none is."""
        # free once every peer has read it, and this rank too: an all-reduce reads its own copy
        free = self._free()
        fits = [g for g in free if g.nbytes >= nbytes]
        chosen = min(fits, key=lambda g: g.nbytes) if fits else _new_region(max(nbytes, 1))
        self._trim([g for g in free if g is not chosen])
        if not fits:
            self.regions.append(chosen)
        chosen.trimmed = False
        return chosen

    def trim(self) -> None:
        """Gives back the pages of every large region that every peer has finished reading; mutates.

        A large region (``LARGE_BYTES``: a root unit's packed gradients) is used once a
        step; kept resident, it would add to every peak until the next step reuses it.
        ``settle`` calls this at the end of a step and before the next starts.
        """
        self._trim(self._free())

    def _free(self) -> list[Region]:
        """The regions every peer, and this rank, has finished reading."""
        # free once every peer has read it, and this rank too: an all-reduce reads its own copy
        self._heard()
        done = min(self.read_mark(), *(m for r, m in enumerate(self.marks) if r != self.me))
        return [g for g in self.regions if g.last_seq < done]

    def _trim(self, free: list[Region]) -> None:
        for g in free:
            if g.nbytes >= LARGE_BYTES and not g.trimmed:
                _give_back(g.mapping, g.nbytes, _REMOVE)
                g.trimmed = True

    def reserve(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of a free region, held for the next collective to publish as they are.

        For a caller that writes its input straight into a region (a reduce-scatter's
        packed gradients); the region is free again once that collective's readers
        are done.
        """
        region = self.region(nbytes)
        region.last_seq = self.seq  # the next collective's: no other takes it before
        return region.data[:nbytes]

    def owner(self, t: torch.Tensor, /) -> Region | None:
        """The region ``t`` starts, held for the next collective (:meth:`reserve`), or ``None``."""
        ptr = t.data_ptr()
        return next(
            (g for g in self.regions if g.data.data_ptr() == ptr and g.last_seq == self.seq),
            None,
        )

    def held_bytes(self) -> int:
        """Bytes of this rank's own regions."""
        return sum(g.nbytes for g in self.regions)

    def peer(self, rank: int, fd: int, nbytes: int) -> torch.Tensor:
        """Group rank ``rank``'s region ``fd``, mapped once; its first ``nbytes`` bytes."""
        key = (rank, fd)
        if key not in self.peer_maps:
            mapping = _map_peer(self.pids[rank], fd)
            self.peer_maps[key] = (mapping, _read_only_view(mapping))
        mapping, mapped = self.peer_maps[key]
        if nbytes > mapped.numel():
            raise CollectiveError(
                f"rank {rank}'s shared region holds {mapped.numel()} bytes, its descriptor "
                f"claims {nbytes}: the ranks are out of step"
            )
        return mapped[:nbytes]

    def unmap_read(self, rank: int, fd: int, nbytes: int) -> None:
        """Drops ``rank``'s region from this rank's pages once read: they are the peer's memory.

        See [Note: peers' pages].
        """
        if nbytes:  # the whole mapping: a fault maps the 64 KiB around it, read or not
            mapping, mapped = self.peer_maps[(rank, fd)]
            _give_back(mapping, mapped.numel(), _DONTNEED)


_ARENAS: weakref.WeakKeyDictionary[Any, Arena | None] = weakref.WeakKeyDictionary()
_KEPT: list[int] = []  # fds of dropped arenas' regions a peer may not have mapped yet


def _release(regions: list[Region], marks: list[int], me: int) -> None:
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


def settle_all() -> None:
    """:meth:`Arena.settle` for every group's arena on this rank.

    Raises:
        CollectiveError: as :meth:`Arena.settle`.
    """
    for made in list(_ARENAS.values()):
        if made is not None:
            made.settle()


def existing(group: Any, /) -> Arena | None:
    """The group's arena if a collective has set it up already; ``None`` otherwise (never collective)."""
    return _ARENAS.get(group)


def arena(group: Any, /) -> Arena | None:
    """The group's arena, set up by every rank together on first use; ``None`` where ranks cannot share memory.

    The first call on a group is collective (see [Note: shared-memory collectives] in ``comm/shm/__init__.py``):
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
        address = probe.data.data_ptr()
        mine = torch.tensor(
            [MAGIC, os.getpid(), probe.fd, nonce, address, 0, 0, 0], dtype=torch.int64
        )
        every = torch.zeros(w * WORDS, dtype=torch.int64)
        timeout = _timeout()
        wait_work(all_gather_single(every, mine, group=group, async_op=True), timeout)
        rows = every.view(w, WORDS).tolist()
        ok = 1
        shared_marks = platform.machine().lower() in _ORDERED_MACHINES
        readv = int(shared_marks and cross_memory.offered())
        pages: list[mmap.mmap] = []
        for r, row in enumerate(rows):
            if r == me:
                pages.append(probe.mapping)
                continue
            try:
                page = _map_peer(int(row[1]), int(row[2]))
                seen = _read_only_view(page)
                ok &= int(seen[:8].view(torch.int64)[0]) == int(row[3])
                pages.append(page)
            except OSError:
                ok = 0
            if readv:  # [Note: shards read in place] in cross_memory.py
                readv &= cross_memory.probe(int(row[1]), int(row[4]), int(row[3]))
        agreed = torch.tensor([ok, readv], dtype=torch.int64)
        reduced = dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group, async_op=True)
        wait_work(reduced, timeout)
    finally:  # every peer has mapped the probe or failed to once the all-reduce is past
        os.close(probe.fd)
    if not int(agreed[0]):
        return None
    pids = [int(row[1]) for row in rows]
    return Arena(
        group,
        me,
        w,
        pids,
        marks=[0] * w,
        board=Board(pages, me, pids) if shared_marks else None,
        readv=bool(int(agreed[1])),
    )


def _timeout() -> Timeout:
    seconds = runtime.collective_timeout()
    return None if seconds is None else datetime.timedelta(seconds=seconds)


def _new_region(nbytes: int) -> Region:
    size = -(-nbytes // _ALIGN) * _ALIGN
    fd = os.memfd_create("funcshard-shm", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return Region(fd, size, mapping, torch.frombuffer(mapping, dtype=torch.uint8))


def _give_back(mapping: mmap.mmap, nbytes: int, advice: int | None) -> None:
    if advice is not None:
        mapping.madvise(advice, 0, -(-nbytes // _ALIGN) * _ALIGN)


def _map_peer(pid: int, fd: int) -> mmap.mmap:
    """Maps another process's shared file through ``/proc``, read-only; raises ``OSError`` where it cannot.

    A rank only reads its peers' regions and probe pages (it writes its own), so
    the mapping is ``PROT_READ``: a write through it would fault, never reach a
    peer's memory.
    """
    opened = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)
    try:
        size = os.fstat(opened).st_size
        if size <= 0:
            raise OSError(f"/proc/{pid}/fd/{fd} is empty")
        return mmap.mmap(opened, size, access=mmap.ACCESS_READ)
    finally:
        os.close(opened)


def _read_only_view(mapping: mmap.mmap, /) -> torch.Tensor:
    """A peer's read-only mapping as ``uint8``; torch warns that it is not writable, which it is not meant to be."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mapping, dtype=torch.uint8)
