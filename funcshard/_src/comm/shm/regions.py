"""The memory ranks on one host share: regions made, mapped by peers and reused once read; probe pages and their board; reading a peer in place.

The memory the shared-memory collectives (``shm/__init__.py``, [Note: shared-memory
collectives]) move data through: each rank's regions (``memfd`` files its peers
map through ``/proc/<pid>/fd/<fd>``), which of them every peer has finished
reading (the read marks), and the probe that decides, once per group and on
every rank together, whether its ranks can share memory at all.

**Reading a peer process's memory** with one copy: Linux's ``process_vm_readv``
(cross-memory attach).

[Note: shards read in place]
An all-gather through shared memory (``shm/__init__.py``) copies the rank's shard into a
region, and each peer copies it out again: two copies of every shard, on top of
the copy of the rank's own row into its gathered storage. Where the kernel lets
ranks read each other's memory (``process_vm_readv``, which MPI libraries use for
large messages on one host), a peer instead reads the shard straight from the
owner's tensor into its own storage: one copy, made by the kernel, and no region.

That is safe only while the owner neither frees nor writes the tensor, so:

- only collectives whose caller declares its input *stable* publish it this way:
  the executor's gathers of a unit's shard (or of its cast copy), which nothing
  writes during an evaluation; staging buffers from a pool never are;
- the arena keeps a reference to each tensor published so until every peer's
  read mark passes it (``regions.py``, [Note: read marks]), so it is not freed;
- an evaluation returns to the caller, who may then update the shards in place
  (an optimizer step), only once every peer has read what it published
  (``Arena.settle``). In training this is already so when the step's last
  reduction is in, since every peer gathered each unit before reducing it; an
  evaluation alone may wait for a slower peer to finish its last gather.

The ranks agree on it with the shared-memory probe (``regions.py``): each reads
its peers' probe pages this way, and all use it only if all can and their read
marks are shared live (x86). Containers or hosts whose ptrace policy forbids the
call (Yama's ``ptrace_scope`` 1 between sibling processes, a seccomp filter) keep
the regions. ``FUNCSHARD_SHM_READV=0`` turns it off.

**The board**: each rank's probe page, shared by its group, holds its read mark and
its collectives' descriptors.

[Note: descriptors on the board]
A shared-memory collective (``shm/__init__.py``) starts by telling its peers where its
data is: a 64-byte descriptor. Sent as a gloo all-gather, each cost a loopback
round trip and a wake-up of gloo's threads, about 0.25 ms a collective on the
benchmark machine: a few percent of a step of small units, where DDP meets its
peers once per bucket. Where the ranks' probe pages are shared live (x86, whose
loads and stores keep program order: "Memory ordering" in [Note: shared-memory
collectives], ``shm/__init__.py``), each
rank instead writes its descriptor into a slot of its own page and its peers
read it there:

- the page holds a header (word 1: the rank's read mark) and a ring of slots,
  one per collective, ``seq % SLOTS``; the writer fills the slot and writes its
  flag word (``seq + 1``) last, so a reader that sees the flag sees the rest;
- a writer reuses a slot only once every peer's read mark has passed the
  collective that last used it (its descriptor was read then), which a rank
  ``SLOTS`` collectives ahead of a peer waits for;
- a reader waits for its peers' flags as it would for a gloo collective: past
  the collective timeout it fails with the same "timed out" error, and a peer
  whose process has exited fails it at once.

The descriptor's words are the same as on gloo, and checked the same way: a
peer at another collective of the same sequence number is an error before any
data is read; a peer at another sequence number never writes the slot waited
for, and the wait times out.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import errno
import mmap
import os
import platform
import secrets
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from funcshard._src.comm import runtime
from funcshard._src.comm.channel import all_gather_single
from funcshard._src.comm.runtime import CollectiveError, Timeout, wait_work
from funcshard._src.comm.transport import LARGE_BYTES, SHM_ENV, SHM_MIN_BYTES, shm_enabled

PAGE_BYTES = 16384  # a probe page: header and slots
WORDS = 8  # a descriptor: (WORDS,) int64
HEADER = 8  # words before the first slot; word 0 the probe's nonce, word 1 the read mark
SLOTS = (PAGE_BYTES // 8 - HEADER) // WORDS
# [Note: waiting for a peer]
# A wait polls its peers' words. It first yields the CPU between polls (sched_yield) for
# _YIELD_S, then sleeps _POLL_S between polls. It never spins without yielding: on a host
# with more runnable threads than cores (two ranks of each of two jobs on two cores), the
# peer a rank waits for may be waiting for this rank's core, and a spin takes the time
# from it; a yield hands the core over at once, and costs about a microsecond where
# nothing else wants it. bench/board_wait.py measures the round trip both ways: two ranks
# on a host whose cores were all busy (load about 20) took 0.20-0.49 s for 5,000 round
# trips yielding against 1.99-2.12 s spinning first; with two more processes that only
# spin (never wait), yielding took 4.4-5.3 s for 3,000 against 1.5-2.1 s, as the yield
# hands them the core for a whole time slice. Which one a real neighbour job resembles is
# for the step benchmark to say (python -m bench, with another job beside it).
_YIELD_S = 50e-6
_POLL_S = 20e-6


class Board:
    """Every group rank's page as int64 words; this rank writes its own, reads its peers'."""

    def __init__(self, pages: Sequence[mmap.mmap], me: int, pids: Sequence[int]) -> None:
        self.words = [memoryview(p).cast("q") for p in pages]
        self.me, self.pids = me, list(pids)

    def mark(self, rank: int, /) -> int:
        """``rank``'s read mark as it stands."""
        return self.words[rank][1]

    def set_mark(self, value: int, /) -> None:
        """Publishes this rank's read mark; mutates its page."""
        self.words[self.me][1] = value

    def post(self, seq: int, descriptor: Sequence[int], timeout_s: float, /) -> None:
        """Writes this rank's descriptor of collective ``seq`` into its slot; mutates its page.

        Raises:
            RuntimeError: a peer has not read the slot's last descriptor within ``timeout_s``.
            CollectiveError: that peer's process exited.
        """
        if seq >= SLOTS:
            reused = seq - SLOTS
            self.wait_until(
                lambda: all(self.mark(r) > reused for r in self._peers()),
                lambda: [r for r in self._peers() if self.mark(r) <= reused],
                timeout_s,
                f"reading descriptor {reused}",
            )
        page, at = self.words[self.me], HEADER + (seq % SLOTS) * WORDS
        for i, word in enumerate(descriptor):
            if i != 1:
                page[at + i] = word
        page[at + 1] = seq + 1  # the flag, last

    def collect(self, seq: int, mine: Sequence[int], timeout_s: float, /) -> list[list[int]]:
        """Every group rank's descriptor of collective ``seq`` (``mine`` at this rank), once all are posted.

        Raises:
            RuntimeError: a peer has not posted it within ``timeout_s`` ("timed out").
            CollectiveError: that peer's process exited.
        """
        at = HEADER + (seq % SLOTS) * WORDS
        self.wait_until(
            lambda: all(self.words[r][at + 1] == seq + 1 for r in self._peers()),
            lambda: [r for r in self._peers() if self.words[r][at + 1] != seq + 1],
            timeout_s,
            f"posting its descriptor of collective {seq}",
        )
        rows = []
        for r in range(len(self.words)):
            row = list(mine) if r == self.me else list(self.words[r][at : at + WORDS])
            row[1] = seq  # the flag held seq + 1
            rows.append(row)
        return rows

    def _peers(self) -> list[int]:
        return [r for r in range(len(self.words)) if r != self.me]

    def wait_until(
        self,
        ready: Callable[[], bool],
        late: Callable[[], list[int]],
        timeout_s: float,
        what: str,
    ) -> None:
        """Polls ``ready`` until it holds, yielding the CPU, then sleeping between polls.

        See [Note: waiting for a peer].

        ``late`` names the group ranks still awaited; ``what`` ends the messages.

        Raises:
            CollectiveError: a late rank's process exited ("... exited before ``what``").
            RuntimeError: ``timeout_s`` passed ("timed out ... ``what``").
        """
        start = time.monotonic()
        while not ready():
            waited = time.monotonic() - start
            if waited < _YIELD_S:
                os.sched_yield()
                continue
            for r in late():
                if not alive(self.pids[r]):
                    raise CollectiveError(
                        f"group rank {r} (pid {self.pids[r]}) exited before {what}"
                    )
            if waited > timeout_s:
                raise RuntimeError(
                    f"timed out after {timeout_s:g} s waiting for group rank(s) {late()} {what}"
                )
            time.sleep(_POLL_S)


def alive(pid: int, /) -> bool:
    """Whether process ``pid`` exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


READV_ENV = "FUNCSHARD_SHM_READV"


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _bind() -> Any:
    """libc's ``process_vm_readv``, or ``None`` where there is none."""
    if not hasattr(os, "memfd_create"):  # Linux only
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        call = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    vec = ctypes.POINTER(_IoVec)
    call.argtypes = [ctypes.c_int, vec, ctypes.c_ulong, vec, ctypes.c_ulong, ctypes.c_ulong]
    call.restype = ctypes.c_ssize_t
    return call


_READV = _bind()


def readv_offered() -> bool:
    """Whether this rank offers to read its peers' memory: the call exists and ``FUNCSHARD_SHM_READV`` is not ``0``.

    Example:
        >>> isinstance(readv_offered(), bool)
        True
    """
    return _READV is not None and runtime.setting(READV_ENV, "1").strip() != "0"


def read_peer(pid: int, address: int, targets: list[tuple[int, torch.Tensor]], /) -> None:
    """Copies process ``pid``'s bytes at ``address + offset`` into each ``(offset, target)``; mutates the targets.

    Each target is a contiguous CPU tensor; the bytes it receives are its size.

    Raises:
        CollectiveError: the read failed or came back short (the peer exited, or
            the ranks are out of step).
    """
    if _READV is None:
        raise CollectiveError("process_vm_readv is not available on this host")
    n = len(targets)
    local, remote = (_IoVec * n)(), (_IoVec * n)()
    total = 0
    for i, (offset, target) in enumerate(targets):
        nbytes = target.numel() * target.element_size()
        local[i].base, local[i].len = target.data_ptr(), nbytes
        remote[i].base, remote[i].len = address + offset, nbytes
        total += nbytes
    done = _READV(pid, local, n, remote, n, 0) if total else 0
    if done != total:
        code = ctypes.get_errno() if done < 0 else 0
        why = errno.errorcode.get(code, str(code)) if code else f"{done} of {total} bytes"
        raise CollectiveError(
            f"reading rank process {pid}'s shard failed ({why}): the peer exited or the "
            f"ranks are out of step"
        )


def probe_peer(pid: int, address: int, expected: int, /) -> bool:
    """Whether this rank can read ``pid``'s int64 at ``address`` and finds ``expected`` there."""
    got = torch.zeros(1, dtype=torch.int64)
    try:
        read_peer(pid, address, [(0, got)])
    except CollectiveError:
        return False
    return int(got[0]) == expected


ENV = SHM_ENV
MAGIC = 0x6673_73686D  # "fsshm"
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
# a reduction adds W - 1 peers' rows, at most two peers' pages (the first addition's two
# terms) count in its resident set at a time, not W - 1 (a root unit's at W = 8: 7/8 of
# its packed gradients; large_vocab in bench/results/memory_shapes: 1.12x FSDP2's peak
# without it, 0.92x with it). With one peer the view goes after the read mark is set,
# which the peer reads before it reuses the region (else it makes another). The data
# stays in the peer's file, and the next read maps it again, a minor fault per 64 KiB (the kernel's fault-around, which also
# maps written pages beyond those read, hence the whole view), about 0.3 ms on an 8 MiB
# read on the benchmark machine, where the copy itself takes about 1 ms.
_REMOVE = getattr(mmap, "MADV_REMOVE", None)
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)
# [Note: draining regions]
# A rank packs each unit's gradients into a region of its own (input_rows), and the next
# unit's, packed once this rank has read the last reduction but before its peers all have,
# into another: two regions of a block's packed gradients in turn, where the socket path
# reuses one pool buffer. The one not in flight stays resident until a collective next asks
# for a region, which, after the last block, is the root's reduction: through autograd's
# gradients of the embeddings, the peak of a step with tied or large ones, it added one
# block's packed gradients (wide_shallow at W = 8 in bench/results/memory_shapes: 108 MiB).
# So where a step drains its staging pools (Run.post_backward, [Note: staging lifetimes]
# in execute/param_group.py), ``Arena.drain`` gives back the pages of every region, of any
# size, this rank has finished reading, first waiting for its peers to finish reading
# them too: only collectives this rank has finished, so posted by every rank, which each
# peer reads in its next wait, before it starts its own last reduction; the wait fails
# like a collective's past the timeout. The region of the reduction still in flight stays.
# With one peer (W = 2) it does nothing, as measured before it (the early drop, [Note:
# peers' pages], is likewise for more than one peer). Without a board the marks heard
# lag, so nothing is waited for and what is known free is given back. For the same
# reason, at more than two ranks ``Arena.trim`` (at the end of a step and before the
# next, ``settle``) gives back every free region, not only the large ones: the regions of
# the last reductions would otherwise stay resident through the next step's forward to
# its peak at the start of backward, where the socket path holds no staging (its pools
# are drained). On a held-out GPT of 512 tokens a rank at W = 8 (width 512, 8 blocks;
# bench/results/memory_shapes, stop 52) they were 24 MiB of a 962 MiB peak, and put it
# 27 MiB over FSDP2's. Each step then faults those pages in again as it packs them, which
# at W = 2, where steps are short, the speed bench would see; at W = 2 they stay.
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
    trimmed: bool = False  # its pages given back (free: a large one, any at W > 2): see trim


@dataclass(eq=False)
class Arena:
    """One process group's shared regions on this rank and what it knows of its peers; mutated by every collective."""

    # by weak reference, as [Note: weak process groups] in comm/groups.py asks: the group
    # is this arena's key in _ARENAS, which a strong reference would keep alive forever
    group_ref: weakref.ReferenceType[Any]
    me: int
    w: int
    pids: list[int]
    regions: list[Region] = field(default_factory=list)
    peer_maps: dict[tuple[int, int], tuple[mmap.mmap, torch.Tensor]] = field(default_factory=dict)
    seq: int = 0  # collectives started on this arena: equal on every rank in step
    unread: set[int] = field(default_factory=set)  # started here, peers' regions not yet read
    marks: list[int] = field(default_factory=list)  # per group rank: its read mark, as last heard
    # every group rank's probe page, word 1 its read mark as it stands (see [Note: read marks]),
    # and the descriptors ([Note: descriptors on the board] in regions.py); None: not shared live
    board: Board | None = None
    # whether peers read stable inputs in place ([Note: shards read in place] in regions.py)
    readv: bool = False
    # (sequence number, tensor) published in place, kept until every peer has read it
    exposed: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        weakref.finalize(self, _release, self.regions, self.marks, self.me)

    @property
    def group(self) -> Any:
        """The process group, which a collective on this arena is running on, so alive."""
        group = self.group_ref()
        assert group is not None, "a collective on a destroyed process group's arena"
        return group

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

        See [Note: shards read in place] in ``regions.py``: called before an
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

    def drain(self) -> None:
        """Gives back the pages of every region this rank has finished reading, once its peers have too; mutates.

        See [Note: draining regions]. Waits only for peers' reads of collectives
        this rank has finished itself, so already posted by every rank.

        Raises:
            CollectiveError: a peer exited, or has not read within the collective timeout.
        """
        if self.w <= 2:
            return
        mine = self.read_mark()
        read = [g.last_seq for g in self.regions if 0 <= g.last_seq < mine and not g.trimmed]
        if read and self.board is not None:
            last = max(read)

            def late() -> list[int]:
                return [r for r, m in enumerate(self.marks) if r != self.me and m <= last]

            try:
                self.board.wait_until(
                    lambda: self._peers_done() > last,
                    late,
                    runtime.wait_limit_s(),
                    f"finishing shared-memory collective {last}",
                )
            except CollectiveError:  # a peer exited
                raise
            except RuntimeError as e:  # timed out
                raise CollectiveError(
                    f"group rank(s) {late()} have not finished reading shared-memory "
                    f"collective {last} in time: the ranks are out of step"
                ) from e
        for g in self._free():
            if not g.trimmed:
                _give_back(g.mapping, g.nbytes, _REMOVE)
                g.trimmed = True

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
        """Gives back the pages of every large region (at W > 2, every region) that every peer has finished reading; mutates.

        A large region (``LARGE_BYTES``: a root unit's packed gradients) is used once a
        step; kept resident, it would add to every peak until the next step reuses it.
        At more than two ranks so is every region: see [Note: draining regions].
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
            if (g.nbytes >= LARGE_BYTES or self.w > 2) and not g.trimmed:
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


def drain_all() -> None:
    """:meth:`Arena.drain` for every group's arena on this rank.

    Raises:
        CollectiveError: as :meth:`Arena.drain`.
    """
    for made in list(_ARENAS.values()):
        if made is not None:
            made.drain()


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
        readv = int(shared_marks and readv_offered())
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
            if readv:  # [Note: shards read in place] in regions.py
                readv &= probe_peer(int(row[1]), int(row[4]), int(row[3]))
        agreed = torch.tensor([ok, readv], dtype=torch.int64)
        reduced = dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group, async_op=True)
        wait_work(reduced, timeout)
    finally:  # every peer has mapped the probe or failed to once the all-reduce is past
        os.close(probe.fd)
    if not int(agreed[0]):
        return None
    pids = [int(row[1]) for row in rows]
    return Arena(
        weakref.ref(group),
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
