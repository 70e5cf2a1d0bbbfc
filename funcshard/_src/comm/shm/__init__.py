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
   all-reduce: its buffer), unless the caller packed it into one already
   (``collectives.input_rows``), then publishes a 64-byte *descriptor* (magic, sequence
   number, pid, fd, bytes, read mark, layout, size): in a slot of its probe
   page where the ranks' pages are shared live ([Note: descriptors on the
   board] in ``regions.py``; the ordering is under "Memory ordering" below), else by an all-gather on the group, asynchronously.
   A gather of a stable input where the ranks may read each other's memory
   copies nothing: its descriptor carries the input's address instead
   ([Note: shards read in place] in ``regions.py``);
2. wait: once every rank's descriptor is in, the data has been written; the
   rank reads its peers' regions (or their inputs, in place) straight into the
   result (a copy for a gather, an add for a reduction, in group-rank order so
   that every rank of an all-reduce sums in the same order and gets the same
   bits).

A region is reused only once every peer has read it. A rank's *read mark* is
the lowest sequence number whose reads it has not finished; every descriptor
carries it, so a rank learns from the descriptors it receives which of its
regions every peer is done with. Finding a region never waits for that: a
collective that finds no free region of its size makes a new one. A rank
blocks on its peers only in a collective's own wait, in posting its descriptor
to a board slot a peer has not yet read (``Board.post``), and where the
executor asks for it between steps (``Arena.settle``: inputs published in
place, read by every peer; ``Arena.drain``: large regions given back) or after
the last reduction of a step (``drain``). In steady state the same
sizes recur every step and the regions are warm pages reused step after step.

Descriptors are numbered by the collective's sequence number on the group,
which every rank reaches in the same order (the same order the ring
algorithms rely on). A descriptor with the wrong magic, sequence number, pid
or size means the ranks are out of step: :class:`CollectiveError`, never a read of
the wrong bytes.

The transport is chosen per group, once, by every rank together
(:func:`arena`): each rank makes a probe region holding a random nonce, the
ranks exchange descriptors, every rank maps its peers' probes and checks the
nonces, and an all-reduce of the results decides for all of them. Ranks on
different hosts, in different PID namespaces, or without ``memfd`` (not
Linux) keep gloo's sockets. ``FUNCSHARD_SHM=0`` turns the transport off.

This package is a plug-in of ``comm/transport.py`` ([Note: transports] there):
nothing outside it names its modules or types, it is imported only when
chosen, and where it is missing gloo and NCCL run as with ``FUNCSHARD_SHM=0``.
A rank maps its peers' regions and probe pages read-only (``PROT_READ``): it
only ever writes its own.

Memory ordering. Where descriptors and read marks go through the probe pages
(the board, x86 only), nothing but plain loads and stores orders them:

- data before its descriptor: the writer stores its data into its region
  (``copy_``, a ``memcpy`` that has returned), then the descriptor's words,
  then the slot's flag word (``seq + 1``) last, each an aligned 8-byte store
  through a ``memoryview`` of the mapped page (one ``mov``, never torn). The
  reader loads the flag, and only once it reads ``seq + 1`` loads the
  descriptor and then the data. x86-64's model (TSO) keeps store after store
  and load after load in program order as other cores see them, so a reader
  that sees the flag sees every store made before it;
- reads before reuse: a reader finishes its loads of a peer's region, then
  stores its read mark; a writer loads its peers' marks, then stores into a
  region again. TSO never moves a store ahead of an earlier load, so a region
  is rewritten only after every load of it that its readers' marks claim;
- the one reordering TSO allows, a load passing an earlier store to another
  address, is relied on nowhere: no rank stores and then loads a peer's word
  expecting the peer to have seen the store.

CPython runs each of these accesses as a separate C call, which neither the
interpreter nor the C compiler moves across another. Machines with weaker
ordering (Arm, POWER) do not use the board: their descriptors go through a
gloo all-gather, whose system calls order everything, and only the marks the
descriptors carry are used ([Note: read marks] in ``regions.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import funcshard._src.comm.shm.regions as regions
from funcshard._src.comm import runtime
from funcshard._src.comm.channel import all_gather_single
from funcshard._src.comm.runtime import CollectiveError, Timeout, wait_work
from funcshard._src.comm.shm.regions import (
    ENV,
    MAGIC,
    MIN_BYTES,
    WORDS,
    Arena,
    Region,
    arena,
    drain_all,
    enabled,
    existing,
    settle_all,
)
from funcshard._src.comm.transport import Capabilities, OwnTerm, Work

__all__ = [
    "ENV",
    "MIN_BYTES",
    "TRANSPORT",
    "Arena",
    "Exchange",
    "OwnTerm",
    "all_gather",
    "all_gather_pieces",
    "all_reduce",
    "arena",
    "enabled",
    "existing",
    "input_rows",
    "reduce_scatter",
    "settle_all",
]


READ_IN_PLACE = 2  # a descriptor's layout word: its fd word is the address of a stable input


@dataclass(frozen=True)
class Remote:
    """A peer's input published in place: ``nbytes`` at ``address`` in process ``pid``."""

    pid: int
    address: int
    nbytes: int

    def read(self, targets: list[tuple[int, torch.Tensor]], /) -> None:
        """Copies the bytes at each ``offset`` into its ``target``; mutates the targets.

        Raises:
            CollectiveError: a target reaches past the published bytes (the ranks
                are out of step), or the read failed.
        """
        for offset, target in targets:
            if offset + target.numel() * target.element_size() > self.nbytes:
                raise CollectiveError(
                    f"a peer published {self.nbytes} bytes in place, fewer than this rank "
                    f"reads: the ranks are out of step"
                )
        regions.read_peer(self.pid, self.address, targets)


class Exchange:
    """One collective in flight: this rank's region written, the descriptors being gathered.

    ``finish(views, layouts, done)`` gets each group rank's published bytes as a
    ``dtype`` tensor (``None`` at this rank) and the layout word of its
    descriptor once every descriptor is in; it calls ``done(r)`` once it has
    read all of rank ``r``'s bytes, which, where there are several peers, drops
    them from this rank's pages at once ([Note: peers' pages] in ``regions.py``):
    a reader then holds at most two peers' pages at a time (the first sum's
    terms), not every peer's.
    """

    def __init__(
        self,
        a: Arena,
        parts: Sequence[torch.Tensor],
        finish: Any,
        what: str,
        *,
        size: int | None = None,
        layout: int = 0,
        in_place: bool = False,
        stable: bool = False,
    ) -> None:
        dtype = parts[0].dtype
        nbytes = sum(p.numel() for p in parts) * parts[0].element_size()
        # size: what every rank's descriptor must agree on (a row's bytes for a
        # reduce-scatter, whose ranks may publish all rows or all but their own)
        self.size = nbytes if size is None else size
        self.arena, self.seq, self.nbytes, self.dtype = a, a.seq, nbytes, dtype
        self.finish, self.what = finish, what
        self.region: Region | None = None
        whole = parts[0]
        if stable and a.readv and len(parts) == 1 and whole.is_contiguous() and whole.is_cpu:
            # read in place by the peers: [Note: shards read in place] in regions.py
            a.expose(a.seq, whole)
            where, layout = whole.data_ptr(), READ_IN_PLACE
        else:
            held = a.owner(whole) if in_place else None
            if in_place and held is None:
                raise ValueError(f"{what}: its input is not a region held for it (input_rows)")
            region = held if held is not None else a.region(nbytes)
            if nbytes and held is None:
                flat = region.data[:nbytes].view(dtype)
                at = 0
                for p in parts:
                    flat[at : at + p.numel()].view(p.shape).copy_(p)
                    at += p.numel()
            region.last_seq = a.seq
            self.region, where = region, region.fd
        a.unread.add(a.seq)
        a.seq += 1
        self.mine = [MAGIC, self.seq, os.getpid(), where, nbytes, a.read_mark(), layout, self.size]
        if a.board is not None:  # [Note: descriptors on the board] in regions.py
            a.board.post(self.seq, self.mine, _seconds(None))
            return
        self.every = torch.zeros(a.w * WORDS, dtype=torch.int64)
        mine = torch.tensor(self.mine, dtype=torch.int64)
        self.work = all_gather_single(self.every, mine, group=a.group, async_op=True)

    def wait(self, timeout: Timeout = None) -> bool:
        a = self.arena
        if a.board is not None:
            rows = a.board.collect(self.seq, self.mine, _seconds(timeout))
        else:
            wait_work(self.work, timeout)
            rows = self.every.view(a.w, WORDS).tolist()
        views: list[torch.Tensor | Remote | None] = []
        for r, row in enumerate(rows):
            if row[0] != MAGIC or row[1] != self.seq or row[2] != a.pids[r] or row[7] != self.size:
                raise CollectiveError(
                    f"{self.what}: group rank {r} is at another shared-memory collective "
                    f"(sequence {row[1]}, {row[7]} bytes; this rank: {self.seq}, "
                    f"{self.size} bytes): the ranks are out of step"
                )
            a.marks[r] = max(a.marks[r], int(row[5]))
            if r == a.me:
                views.append(None)
            elif row[6] == READ_IN_PLACE:
                views.append(Remote(a.pids[r], int(row[3]), int(row[4])))
            else:
                views.append(a.peer(r, int(row[3]), int(row[4])).view(self.dtype))
        dropped: set[int] = set()

        def drop(r: int) -> None:
            row = rows[r]
            if r != a.me and row[6] != READ_IN_PLACE and r not in dropped:
                a.unmap_read(r, int(row[3]), int(row[4]))
                dropped.add(r)

        # with several peers each goes as soon as it is read (one peer's pages resident at a
        # time); with one, after the read mark, which its peer reads before it reuses the
        # region (else it makes another): an early drop would only delay the mark
        self.finish(views, [int(row[6]) for row in rows], drop if a.w > 2 else _keep)
        a.finished(self.seq)
        for r in range(len(rows)):
            drop(r)
        return True


def _keep(r: int, /) -> None:
    """A finish's ``done`` that drops nothing until the read mark is set (one peer)."""


def _seconds(timeout: Timeout, /) -> float:
    """A wait's limit in seconds: ``timeout``, else the collective timeout, else the default."""
    if timeout is not None:
        return timeout.total_seconds()
    return runtime.wait_limit_s()


def all_gather(
    a: Arena, flat: torch.Tensor, rows: torch.Tensor, /, *, stable: bool = False
) -> Exchange:
    """Starts gathering every group rank's ``flat`` ``(n,)`` into ``rows`` ``(W, n)``; writes ``rows``.

    See :func:`all_gather_pieces` for ``stable``.
    """
    return all_gather_pieces(a, flat, [(0, rows)], stable=stable)


def all_gather_pieces(
    a: Arena,
    flat: torch.Tensor,
    pieces: Sequence[tuple[int, torch.Tensor]],
    /,
    *,
    stable: bool = False,
) -> Exchange:
    """Starts gathering pieces of every group rank's ``flat``, in one collective; writes each piece's rows.

    A piece ``(offset, rows)``, ``rows`` of shape ``(W, n)``, gets group rank
    ``j``'s ``flat[offset : offset + n]`` in row ``j``: the leaves of a unit's
    shard, each into its own full storage, with one descriptor for them all.
    With ``stable`` the caller promises that nothing frees or writes ``flat``
    until its evaluation ends and :meth:`Arena.settle` has returned: where the
    arena allows it, peers then read it in place ([Note: shards read in place]
    in ``regions.py``).
    """
    itemsize = flat.element_size()

    def finish(views: list[torch.Tensor | Remote | None], _: list[int], done: Done) -> None:
        for r, v in enumerate(views):
            if isinstance(v, Remote):
                v.read([(lo * itemsize, rows[r]) for lo, rows in pieces])
            elif v is not None:
                for lo, rows in pieces:
                    rows[r].copy_(v[lo : lo + rows.shape[1]])
                done(r)

    op = Exchange(a, [flat], finish, "shared-memory all-gather", stable=stable)
    for lo, rows in pieces:
        own = rows[a.me]
        mine = flat[lo : lo + rows.shape[1]]
        if own.data_ptr() != mine.data_ptr():
            own.copy_(mine)
    return op


def reduce_scatter(
    a: Arena, rows: torch.Tensor, out: torch.Tensor, /, *, own: OwnTerm | None = None
) -> Exchange:
    """Starts summing ``rows`` ``(W, n)`` over the group into ``out`` ``(n,)``: group rank ``i`` gets row ``i``'s sum.

    This rank publishes every row but its own (a copy), or, where ``rows`` is a
    region held for it (:func:`input_rows`), all of them as they are; it sums its
    peers' copies of its row and its own in group-rank order. With ``own``,
    ``rows`` must be such a region, its own row is never read, and ``own``
    supplies that term when the sum is made (``shard/flat.py``).

    Raises:
        ValueError: ``own`` is given and ``rows`` is not a region held for it.
    """
    me, w = a.me, a.w
    whole = a.owner(rows) is not None
    if own is not None and not whole:
        raise ValueError("a reduce-scatter with its own row apart needs rows from input_rows")
    parts = [rows] if whole else [p for p in (rows[:me], rows[me + 1 :]) if p.numel()]

    def finish(
        published: list[torch.Tensor | Remote | None], layouts: list[int], done: Done
    ) -> None:
        views = _mapped(published)
        terms = [
            None
            if v is None
            else (v.view(w, -1)[me] if layouts[r] else v.view(w - 1, -1)[me if me < r else me - 1])
            for r, v in enumerate(views)
        ]
        if own is not None:
            _sum_with_own(terms, me, own, out, done)
            return
        _sum_in_order([rows[me] if t is None else t for t in terms], out, done)

    return Exchange(
        a,
        parts,
        finish,
        "shared-memory reduce-scatter",
        size=rows.shape[1] * rows.element_size(),
        layout=int(whole),
        in_place=whole,
    )


def input_rows(a: Arena, w: int, n: int, dtype: torch.dtype, /) -> torch.Tensor:
    """A ``(w, n)`` buffer in a region of this rank's that the next :func:`reduce_scatter` publishes without a copy.

    Pack gradients into it and start the reduce-scatter before any other
    collective on the group: the region is held for the next one.
    """
    return a.reserve(w * n * dtype.itemsize).view(dtype).view(w, n)


def _mapped(views: list[torch.Tensor | Remote | None], /) -> list[torch.Tensor | None]:
    """``views`` with none read in place: only an all-gather's inputs are; else out of step."""
    if any(isinstance(v, Remote) for v in views):
        raise CollectiveError(
            "a peer published a gather's input where this rank reduces: the ranks are out of step"
        )
    return [v if isinstance(v, torch.Tensor) else None for v in views]


Done = Callable[[int], None]  # Exchange's done(r): group rank r's bytes are all read


def _sum_in_order(terms: Sequence[torch.Tensor], out: torch.Tensor, done: Done, /) -> None:
    """``out = terms[0] + terms[1] + ...``, left to right: the same bits on every rank; mutates ``out``.

    ``terms[r]`` is group rank ``r``'s; ``done(r)`` follows its last read.
    """
    torch.add(terms[0], terms[1], out=out)
    done(0)
    done(1)
    for r, t in enumerate(terms[2:], start=2):
        out.add_(t)
        done(r)


def _sum_with_own(
    terms: Sequence[torch.Tensor | None], me: int, own: OwnTerm, out: torch.Tensor, done: Done, /
) -> None:
    """:func:`_sum_in_order` where ``own`` makes term ``me``: the same additions, the same bits; mutates ``out``.

    The first addition is commutative, so where ``me`` is 0 or 1 ``own`` adds its
    row to the other of the first two terms in one pass.
    """
    ranks = [r for r, t in enumerate(terms) if t is not None]
    rest = [t for t in terms if t is not None]
    if me <= 1:
        own(out, rest[0])
        done(ranks[0])
        for r, t in zip(ranks[1:], rest[1:]):
            out.add_(t)
            done(r)
        return
    _sum_in_order(rest[:me], out, done)  # ranks 0 .. me - 1: their indices are their ranks
    own(out, out)
    for r, t in zip(ranks[me:], rest[me:]):
        out.add_(t)
        done(r)


def all_reduce(a: Arena, buf: torch.Tensor, /, *, out: torch.Tensor | None = None) -> Exchange:
    """Starts summing ``buf`` over the group, in place or into ``out``; mutates ``buf`` or ``out``.

    Every rank adds the group's buffers in group-rank order, reading its own from
    its region, so every rank gets the same bits. A ``buf`` in a region held for
    it (:func:`input_rows`) is sent as it is; its sum must go to ``out``.
    """
    flat = buf.view(-1)
    dest = flat if out is None else out.view(-1)
    held = out is not None and a.owner(flat) is not None
    holder: list[torch.Tensor] = []

    def finish(published: list[torch.Tensor | Remote | None], _: list[int], done: Done) -> None:
        views = _mapped(published)
        _sum_in_order([holder[0] if v is None else v for v in views], dest, done)

    op = Exchange(a, [flat], finish, "shared-memory all-reduce", in_place=held)
    assert op.region is not None  # an all-reduce is never read in place
    holder.append(op.region.data[: op.nbytes].view(flat.dtype))
    return op


class _SharedMemory:
    """The shared-memory transport as ``comm/transport.py``'s ``Transport``; see [Note: transports] there.

    Each method returns ``None`` where the group's ranks cannot share memory (the
    probe of :func:`arena` found so, on every rank alike); the caller then runs
    torch's collective.
    """

    def all_gather(
        self,
        group: Any,
        flat: torch.Tensor,
        pieces: Sequence[tuple[int, torch.Tensor]],
        /,
        *,
        stable: bool = False,
    ) -> Work | None:
        a = arena(group)
        return None if a is None else all_gather_pieces(a, flat, pieces, stable=stable)

    def reduce_scatter(
        self,
        group: Any,
        rows: torch.Tensor,
        out: torch.Tensor,
        /,
        *,
        own: OwnTerm | None = None,
    ) -> Work | None:
        a = arena(group)
        return None if a is None else reduce_scatter(a, rows, out, own=own)

    def all_reduce(
        self, group: Any, buf: torch.Tensor, /, *, out: torch.Tensor | None = None
    ) -> Work | None:
        a = arena(group)
        return None if a is None else all_reduce(a, buf, out=out)

    def input_rows(
        self, group: Any, rows: int, numel: int, dtype: torch.dtype, /
    ) -> torch.Tensor | None:
        """A buffer in a region of this rank's, where a collective has set up the group's arena."""
        a = existing(group)
        if a is None:
            return None
        return input_rows(a, rows, numel, dtype)

    def holds_copy(self, work: Work, /) -> bool:
        return isinstance(work, Exchange)

    def owns(self, group: Any, rows: torch.Tensor, /) -> bool:
        """Whether ``rows`` is a region held for the next collective on ``group``."""
        a = existing(group)
        return a is not None and a.owner(rows) is not None

    def settle(self) -> None:
        settle_all()

    def drain(self) -> None:
        drain_all()

    def capabilities(self, backend: str, group_size: int, /) -> Capabilities:
        return Capabilities(gathers_leaf_by_leaf=True, sends_inputs_in_place=True)


TRANSPORT = _SharedMemory()
