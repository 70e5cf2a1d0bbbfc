"""Flat-buffer collectives: one call per buffer, never one per leaf, each counted in a ledger.

Every collective is issued asynchronously and returns a :class:`Pending` whose
``wait()`` yields the result, so callers overlap communication with compute and
wait only when they need the data; a caller that needs the result at once just
waits. A collective that fails or outlives :func:`runtime.collective_timeout`
raises :class:`CollectiveError` naming the operation, its ``tag`` (the unit),
the mesh axes and the rank, and leaves this process out of step (see
[Note: out of step] in ``comm/settle.py``): no later collective is issued. Every
collective is counted in the trace that agreements compare. Before the first,
every rank agrees on the settings that choose how collectives move their bytes
([Note: transport settings]); with ``FUNCSHARD_DEBUG=1`` every collective first agrees on
(op, tag, shape, dtype) with every rank.

:func:`issue` is the one door every collective goes through: it refuses a
process that is out of step, checks the transport settings every rank agreed on,
records the collective in the trace that agreements compare, and turns a failure
into a :class:`CollectiveError` naming the operation, its unit, the mesh axes and
the rank.

[Note: waits that never block the host]
On NCCL, ``Work.wait()`` makes the current CUDA stream wait for the collective
and returns at once; ``Work.wait(timeout=...)`` instead blocks the host thread
until the collective has finished. A timed wait would stall the host at every
gather and reduction, so it could never run ahead of the GPU. So no timeout
reaches a wait anywhere but on gloo, and :func:`runtime.wait_timeout_s` is the
one place that decides: on NCCL the process group's own timeout (``fs.init``
passes ``timeout_s`` to ``init_process_group``) and its watchdog end a
collective that never completes; on gloo, where every wait blocks the host
anyway, the collective timeout bounds it and its error names the collective.
:func:`wait_for` is the wait that every :class:`Pending` goes through.

[Note: transport settings]
Environment variables choose how a collective crosses between ranks:
``FUNCSHARD_SHM`` (shared memory on one host or gloo's sockets),
``FUNCSHARD_ALL_GATHER`` and ``FUNCSHARD_REDUCE_SCATTER`` (the algorithm) and
``FUNCSHARD_DEBUG`` (an agreement before every collective). Each rank reads its
own environment, and a launcher may hand ranks different ones (a per-node
script, a variable exported on one host). Ranks that differ issue different
sequences of collectives for the same call: one rank's 64-byte descriptor
exchange meets another's all-gather of a unit, which gloo answers with a
timeout, an abort of the process (``gloo::EnforceNotMet``) or the wrong bytes.
So before its first data collective every rank agrees on the settings as it
reads them, and again before the first collective after they change (every rank
must change them at the same point, between the same two collectives, as a test
that sets them for one call does), and ranks that differ raise
:class:`DesyncError` naming each variable and every rank's value. A value that
names no algorithm is agreed on as written: where every rank has it, the
collective then refuses it with the same error on every rank.

**The ledger** counts the bytes every collective moves, per rank, by operation
and mesh axes.

Counts follow the bandwidth-optimal (ring) algorithms, which is what a step costs
on a real interconnect whatever the backend does internally: over a group of
``g`` ranks and a full buffer of ``B`` bytes, an all-gather and a
reduce-scatter each send ``(g - 1) / g * B`` bytes per rank and an all-reduce
twice that. A gather to one rank sends ``B / g`` from every other rank.

What "sent" means per algorithm: the rings send exactly these counts; gloo's
own reduce-scatter (an all-reduce) moves twice its count. Through shared memory
(``shm/__init__.py``) a rank sends nothing over a link: its peers read what it published,
``(g - 1) / g * B`` for an all-gather or a reduce-scatter as counted, and for an
all-reduce ``(g - 1) * B`` (each peer reads the whole buffer), which equals the
count at ``g = 2``.
"""

from __future__ import annotations

import datetime
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from funcshard._src.comm import channel, runtime, transport
from funcshard._src.comm.channel import Kind
from funcshard._src.comm.groups import BoundMesh
from funcshard._src.comm.runtime import CollectiveError, wait_work
from funcshard._src.comm.transport import (
    ALL_GATHER,
    REDUCE_SCATTER,
    TORCH,
    Each,
)


@dataclass
class Ledger:
    """A running count of bytes sent per rank, keyed by ``(op, axes)``.

    Example:
        >>> ledger = Ledger()
        >>> ledger.record("all_gather", ("fsdp",), group_size=2, full_bytes=1024)
        >>> ledger.total()
        512
    """

    bytes_by_key: Counter[tuple[str, tuple[str, ...]]] = field(default_factory=Counter)

    def record(self, op: str, axes: tuple[str, ...], *, group_size: int, full_bytes: int) -> None:
        """Counts one collective of ``op`` over ``axes`` on a full buffer of ``full_bytes``."""
        self.bytes_by_key[(op, axes)] += sent_bytes(op, group_size, full_bytes)

    def total(self, op: str | None = None) -> int:
        """Bytes sent, over every op or only ``op``."""
        return sum(n for (o, _), n in self.bytes_by_key.items() if op is None or o == op)

    def reset(self) -> None:
        """Forgets everything counted so far; mutates the ledger."""
        self.bytes_by_key.clear()


def sent_bytes(op: str, group_size: int, full_bytes: int) -> int:
    """Bytes one rank sends for ``op`` over ``group_size`` ranks on ``full_bytes``.

    ``full_bytes`` is the gathered output of an all-gather, the input of a
    reduce-scatter or all-reduce, and the gathered result of a gather.
    """
    g = group_size
    if op in ("all_gather", "reduce_scatter"):
        return full_bytes * (g - 1) // g
    if op == "all_reduce":
        return 2 * full_bytes * (g - 1) // g
    if op == "gather":
        return full_bytes // g
    raise ValueError(f"unknown collective {op!r}")


_all_gather_single = channel.all_gather_single
_reduce_scatter_single = channel.reduce_scatter_single


def group_size(bound: BoundMesh, axes: tuple[str, ...], /) -> int:
    """Number of ranks in a group over ``axes``."""
    return resolve(bound, axes)[1]


def group_rank(bound: BoundMesh, axes: tuple[str, ...], /) -> int:
    """This rank's index in its group over ``axes``: the row of a reduce-scatter's input it gets the sum of."""
    return resolve(bound, axes)[2]


def resolve(
    bound: BoundMesh, axes: tuple[str, ...], /
) -> tuple[dist.ProcessGroup | None, int, int]:
    """The process group over ``axes`` (``None``: one rank), its size and this rank's index in it.

    Looked up in ``comm/groups.py`` once per bound mesh and axes, then read from
    what the bound mesh remembers (a collective asks for its group every time).

    Raises:
        RuntimeError: the group was destroyed (``destroy_process_group``).
    """
    known = bound.resolved.get(axes)
    if known is not None:
        ref, size, rank = known
        if ref is None:
            return None, size, rank
        group = ref()
        if group is not None:
            return group, size, rank
    return bound.resolve(axes)  # the first time, or the group is gone: that raises


def all_gather(
    flat: torch.Tensor,
    bound: BoundMesh,
    axes: tuple[str, ...],
    /,
    *,
    out: torch.Tensor | None = None,
    ledger: Ledger | None = None,
    tag: str = "",
    algorithm: str | None = None,
    stable: bool = False,
) -> Pending:
    """Gathers every group member's ``flat`` into ``(group_size, numel)``, row = group rank.

    Over a group of one rank the result is ``flat`` itself viewed as one row (no
    copy) unless ``out`` is given.

    Args:
        flat: ``(numel,)``, this rank's part.
        bound: the bound mesh.
        axes: the mesh axes of the group.
        out: ``group_size * numel`` elements, filled with the result when given;
            it must not overlap ``flat``.
        ledger: counts ``(group_size - 1) / group_size`` of the bytes gathered.
        tag: the unit, for errors.
        algorithm: see ``transport.py``; ``None`` is ``FUNCSHARD_ALL_GATHER``, else
            ``"auto"``. Every rank must use the same. Anything but gloo always runs
            ``"native"``.
        stable: the caller promises that nothing frees or writes ``flat`` until its
            evaluation ends and :func:`settle` has returned; peers may then read it
            in place ([Note: shards read in place] in ``shm/regions.py``).

    Raises:
        CollectiveError: the collective could not start.
        ValueError: ``algorithm`` is unknown.
    """
    group, size, _ = resolve(bound, axes)
    if group is None:
        result = flat.view(1, -1) if out is None else out.view(1, -1).copy_(flat.view(1, -1))
        return Pending(result)
    if out is None:
        out = torch.empty(size * flat.numel(), dtype=flat.dtype, device=flat.device)
    target = out
    nbytes = out.numel() * out.element_size()
    backend = backend_of(group)
    requested = ALL_GATHER.default_algorithm() if algorithm is None else algorithm
    chosen = ALL_GATHER.resolve(requested, backend, size, nbytes)
    gloo = backend == "gloo"

    def call() -> Any:  # anything but gloo: the backend's own
        if gloo:
            return ALL_GATHER.start(
                chosen,
                flat,
                target.view(size, -1),
                group,
                fallback_to=ALL_GATHER.fallback(requested, size, nbytes),
                stable=stable,
            )
        return _all_gather_single(target.view(-1), flat, group=group, async_op=True)

    pending = issue("all_gather", tag, axes, bound, group, flat, call)
    if ledger is not None:
        # gloo's native and the rings alike: (W - 1) / W of the gathered bytes, see collectives.py
        ledger.record("all_gather", axes, group_size=size, full_bytes=nbytes)
    pending.result = out.view(size, -1)
    return pending


def all_gather_pieces(
    flat: torch.Tensor,
    bound: BoundMesh,
    axes: tuple[str, ...],
    pieces: Sequence[tuple[int, torch.Tensor]],
    /,
    *,
    ledger: Ledger | None = None,
    tag: str = "",
    stable: bool = False,
) -> Pending:
    """Gathers pieces of every group member's ``flat``, each into its own rows; writes them.

    A piece ``(offset, rows)``, ``rows`` of shape ``(group_size, n)``, gets group
    rank ``j``'s ``flat[offset : offset + n]`` in row ``j``: a unit's leaves, each
    into its full storage. Through shared memory (the plug-in of
    ``transport.py``) it is one collective for all of them; elsewhere one all-gather per piece, with
    ``ALL_GATHER.leaf_algorithm()`` on gloo. The ledger counts every piece as
    an all-gather of its rows. ``stable``: as for :func:`all_gather`.

    Raises:
        CollectiveError: the collective could not start.
    """
    group, size, _ = resolve(bound, axes)
    if group is None:
        for lo, rows in pieces:
            rows.view(-1).copy_(flat[lo : lo + rows.numel()])
        return Pending(flat)
    requested = ALL_GATHER.leaf_algorithm()
    itemsize = flat.element_size()
    nbytes = sum(rows.numel() for _, rows in pieces) * itemsize
    backend = backend_of(group)
    gloo = backend == "gloo"
    chosen = ALL_GATHER.resolve(requested, backend, size, nbytes)

    def call() -> Any:
        plugin = transport.shared_memory() if gloo and chosen == "shm" else None
        work = None if plugin is None else plugin.all_gather(group, flat, pieces, stable=stable)
        if work is not None:
            return work
        algorithm = chosen if chosen != "shm" else ALL_GATHER.fallback(requested, size, nbytes)
        each = []
        for lo, rows in pieces:
            piece = flat[lo : lo + rows.shape[1]]
            if gloo:
                each.append(ALL_GATHER.start(algorithm, piece, rows, group))
            else:
                each.append(_all_gather_single(rows.view(-1), piece, group=group, async_op=True))
        return Each(each)

    pending = issue("all_gather", tag, axes, bound, group, flat, call)
    if ledger is not None:
        for _, rows in pieces:
            ledger.record("all_gather", axes, group_size=size, full_bytes=rows.numel() * itemsize)
    return pending


def input_rows(
    bound: BoundMesh,
    axes: tuple[str, ...],
    numel: int,
    dtype: torch.dtype,
    /,
    *,
    all_reduce: bool = False,
) -> torch.Tensor | None:
    """An input that the next collective over ``axes`` sends as it is, or ``None``.

    A ``(group_size, numel)`` input of a reduce-scatter, or with ``all_reduce``
    a ``(numel,)`` input of an all-reduce whose sum goes to its ``out=``. Where
    the group's transport sends inputs in place (shared memory, once a
    collective has set it up on the group), a buffer of the transport's own:
    packing into it saves the copy of the input. Elsewhere ``None``: the caller
    packs into a buffer of its own. Start that collective before any other on
    the group.
    """
    group, size, _ = resolve(bound, axes)
    if group is None or backend_of(group) != "gloo":
        return None
    plugin = transport.shared_memory()
    if plugin is None:
        return None
    rows = 1 if all_reduce else size
    nbytes = rows * numel * dtype.itemsize
    if all_reduce:
        if nbytes < transport.SHM_MIN_BYTES:  # the test all_reduce makes
            return None
    elif REDUCE_SCATTER.resolve(REDUCE_SCATTER.default_algorithm(), "gloo", rows, nbytes) != "shm":
        return None
    held = plugin.input_rows(group, rows, numel, dtype)
    return held.view(-1) if held is not None and all_reduce else held


def settle() -> None:
    """Returns once every peer has read what this rank's gathers published in place.

    Called when an evaluation ends, before its caller may write the shards it
    gathered ([Note: shards read in place] in ``shm/regions.py``); at once where
    nothing was. The transport also gives back memory it holds for collectives every
    peer is done with (a step calls it again when it starts, once every rank is there).

    Raises:
        CollectiveError: a peer exited, or has not read within the collective timeout.

    Example:
        >>> settle()
    """
    transport.settle()


def drain() -> None:
    """Gives back memory the transport holds for collectives this rank has finished, once its peers have.

    Called where a step drains its staging pools ([Note: staging lifetimes] in
    ``execute/param_group.py``), every rank at the same point: the shared-memory
    transport may wait there for its peers' reads of collectives already posted
    ([Note: draining regions] in ``shm/regions.py``).

    Raises:
        CollectiveError: a peer exited, or has not read within the collective timeout.

    Example:
        >>> drain()
    """
    transport.drain()


def reduce_scatter(
    rows: torch.Tensor,
    bound: BoundMesh,
    axes: tuple[str, ...],
    /,
    *,
    out: torch.Tensor | None = None,
    ledger: Ledger | None = None,
    tag: str = "",
    algorithm: str | None = None,
    own: transport.OwnTerm | None = None,
) -> Pending:
    """Sums ``rows`` ``(group_size, numel)`` over the group; group rank ``i`` gets row ``i``'s sum.

    Over a group of one rank the result is the single row (no copy unless ``out``).
    On gloo ``rows`` is scratch space: its contents are unspecified afterwards.

    Args:
        rows: ``(group_size, numel)``, row ``i`` for group rank ``i``.
        bound: the bound mesh.
        axes: the mesh axes of the group.
        out: ``(numel,)``, filled with the result when given.
        ledger: counts ``(group_size - 1) / group_size`` of the bytes of ``rows``.
        tag: the unit, for errors.
        algorithm: see ``transport.py``; ``None`` is ``FUNCSHARD_REDUCE_SCATTER``, else ``"auto"``.
            Every rank must use the same. Anything but gloo always runs ``"native"``.
        own: makes this rank's row when summed, which ``rows`` then need not hold:
            ``rows`` from ``collectives.input_rows`` only ([Note: the own row
            from the leaves] in ``shard/flat.py``).

    Raises:
        CollectiveError: the collective could not start.
        ValueError: ``algorithm`` is unknown, or ``own`` is given where the
            collective does not run through shared memory.
    """
    group, size, _ = resolve(bound, axes)
    if group is None:
        if own is not None:
            raise ValueError("a reduce-scatter with its own row apart runs through shared memory")
        result = rows.view(-1) if out is None else out.copy_(rows.view(-1))
        return Pending(result)
    if out is None:
        out = torch.empty(rows.shape[1], dtype=rows.dtype, device=rows.device)
    target = out
    nbytes = rows.numel() * rows.element_size()
    backend = backend_of(group)
    requested = REDUCE_SCATTER.default_algorithm() if algorithm is None else algorithm
    chosen = REDUCE_SCATTER.resolve(requested, backend, size, nbytes)
    gloo = backend == "gloo"
    if own is not None:
        plugin = transport.shared_memory() if gloo and chosen == "shm" else None
        if plugin is None or not plugin.owns(group, rows):
            raise ValueError(
                "a reduce-scatter with its own row apart needs rows from "
                "collectives.input_rows, sent through shared memory"
            )

    def call() -> Any:  # anything but gloo: the backend's own
        if gloo:
            return REDUCE_SCATTER.start(
                chosen,
                rows,
                target,
                group,
                fallback_to=REDUCE_SCATTER.fallback(requested, size, nbytes),
                own=own,
            )
        return _reduce_scatter_single(target, rows.view(-1), group=group, async_op=True)

    pending = issue("reduce_scatter", tag, axes, bound, group, rows, call)
    if ledger is not None:
        # every algorithm but gloo's native and all_reduce sends exactly this; those two send
        # twice as much, which the ledger (like the cost model) does not count: see collectives.py
        ledger.record("reduce_scatter", axes, group_size=size, full_bytes=nbytes)
    pending.result = out
    return pending


def all_reduce(
    buf: torch.Tensor,
    bound: BoundMesh,
    axes: tuple[str, ...],
    /,
    *,
    ledger: Ledger | None = None,
    tag: str = "",
    out: torch.Tensor | None = None,
) -> Pending:
    """Sums ``buf`` over the group over ``axes``, in place or into ``out``; mutates ``buf``, and ``out`` when given.

    On gloo, ranks that share a host add from each other's memory (the plug-in
    of ``transport.py``); a ``buf`` from :func:`input_rows` (``all_reduce=True``)
    is sent from there as it is, and its sum must go to ``out``.
    """
    group, size, _ = resolve(bound, axes)
    if group is None:
        return Pending(buf if out is None else out.copy_(buf))
    nbytes = buf.numel() * buf.element_size()
    plugin = (
        transport.shared_memory()
        if backend_of(group) == "gloo" and transport.uses_shared_memory(nbytes)
        else None
    )

    def call() -> Any:  # on one host, gloo's ranks add from each other's memory
        work = None if plugin is None else plugin.all_reduce(group, buf, out=out)
        if work is not None:
            return work
        return TORCH.all_reduce(group, buf, out=out)

    pending = issue("all_reduce", tag, axes, bound, group, buf, call)
    pending.holds_copy = plugin is not None and plugin.holds_copy(pending.work)
    if ledger is not None:
        ledger.record(
            "all_reduce", axes, group_size=size, full_bytes=buf.numel() * buf.element_size()
        )
    pending.result = buf if out is None else out
    return pending


def sum_over_mesh(buf: torch.Tensor, bound: BoundMesh, what: str, /, **fields: Any) -> torch.Tensor:
    """Sums ``buf`` over every axis of ``bound``'s mesh once every rank agrees it is at ``what``; mutates ``buf``.

    An operation outside a step (clipping, a finiteness check, an optimizer's sums)
    that reduces over the mesh agrees first ([Note: agreements] in ``comm/channel.py``)
    on ``{"operation": what, **fields}``, so that a rank at another one raises
    ``DesyncError`` naming both instead of pairing its all-reduce with theirs. Waits for
    the sum.

    Raises:
        DesyncError: a rank is at another operation, or its ``fields`` differ.
        CollectiveError: a peer did not come in time.
    """
    channel.agree_on(Kind.REDUCE, what, {"operation": what, **fields})
    return all_reduce(buf, bound, bound.mesh.axis_names).wait()


def gather_to_rank0(
    flat: torch.Tensor, bound: BoundMesh, /, *, ledger: Ledger | None = None, tag: str = ""
) -> torch.Tensor | None:
    """Every rank's ``flat`` stacked into ``(world_size, numel)`` on global rank 0, ``None`` elsewhere."""
    if not bound.distributed:
        return flat.view(1, -1)
    world = bound.mesh.size
    # rank 0 receives into the rows of one buffer: no second copy to stack them
    out = (
        torch.empty(world, *flat.shape, dtype=flat.dtype, device=flat.device)
        if bound.rank == 0
        else None
    )
    rows = None if out is None else list(out.unbind(0))
    group = dist.distributed_c10d._get_default_group()
    pending = issue(
        "gather to rank 0",
        tag,
        bound.mesh.axis_names,
        bound,
        group,
        flat,
        lambda: dist.gather(flat, rows, dst=0, async_op=True),
    )
    pending.wait()
    if ledger is not None:
        ledger.record(
            "gather",
            bound.mesh.axis_names,
            group_size=world,
            full_bytes=world * flat.numel() * flat.element_size(),
        )
    return None if out is None else out.view(world, -1)


# -- a collective in flight, and how it is issued and fails ----------------------


@dataclass
class Pending:
    """A collective in flight; :meth:`wait` blocks until ``result`` holds the data."""

    result: torch.Tensor
    work: Any = None  # a torch.distributed Work handle, or None when already done
    # "all_gather of unit 'blocks/0' over ('fsdp',) on rank 1", for errors: a str, or an
    # object that formats as one when shown (issue)
    what: object = ""
    then: Callable[[], None] | None = None  # runs once the work is done (e.g. copy a chunk out)
    holds_copy: bool = False  # holds a copy of its input until done (shared memory: comm/shm/)
    backend: str | None = None  # the backend of its group: what its wait may pass (wait_for)
    # an event recorded on its side stream after it, for the consumer's stream to wait on
    # (see [Note: streams and buffer lifetimes] in ``execute/streams.py``); None on the CPU
    event: Any = None

    def wait(self) -> torch.Tensor:
        """Returns the result once the collective is done (on NCCL: once the current stream waits for it).

        Raises:
            CollectiveError: the collective failed or timed out.
        """
        if self.work is not None:
            try:
                wait_for(self.work, self.backend)
            except WaitError as e:
                channel.mark_out_of_step(f"{self.what} failed")
                raise failure(self.what, e.error, e.timeout) from e.error
            self.work = None
            if self.then is not None:
                self.then()
                self.then = None
        return self.result


class WaitError(Exception):
    """A wait of :func:`wait_for` raised ``error`` after waiting with ``timeout`` seconds."""

    def __init__(self, error: Exception, timeout: float | None) -> None:
        super().__init__(str(error))
        self.error, self.timeout = error, timeout


def wait_for(work: Any, backend: str | None, /) -> None:
    """Waits for ``work`` of a collective issued on ``backend``: with a timeout on gloo alone.

    See [Note: waits that never block the host]. On NCCL ``work.wait()`` gets no
    argument, so the host goes on and the current stream waits for the collective.

    Raises:
        WaitError: the wait raised; it carries the error and the timeout used.

    Example:
        >>> class Work:
        ...     def wait(self, **kwargs):
        ...         print(kwargs)
        >>> wait_for(Work(), "nccl")
        {}
    """
    timeout = runtime.wait_timeout_s(backend)
    try:
        wait_work(work, None if timeout is None else datetime.timedelta(seconds=timeout))
    except Exception as e:
        raise WaitError(e, timeout) from e


def issue(
    op: str,
    tag: str,
    axes: tuple[str, ...],
    bound: BoundMesh,
    group: dist.ProcessGroup,
    tensor: torch.Tensor,
    call: Callable[[], Any],
) -> Pending:
    """Issues the collective ``call()`` starts (``op`` of unit ``tag`` over ``axes``, reading ``tensor``); may agree first.

    Raises:
        CollectiveError: this process is out of step, or ``call()`` raised.
        DesyncError: the ranks' transport settings differ ([Note: transport settings]).
    """

    def what() -> str:  # for errors alone: formatted only when one is raised
        return f"{op}{f' of unit {tag!r}' if tag else ''} over mesh axes {list(axes)} on rank {bound.rank}"

    ch = channel.existing_channel()
    if ch is not None:
        if ch.out_of_step is not None:
            channel.ensure_in_step(what())
        ch.record_issued(op, tag, tensor.numel(), tensor.dtype)
    check_settings(ch, op, tag, group, tensor, what)  # [Note: transport settings]
    try:
        work = call()
    except Exception as e:
        channel.mark_out_of_step(f"{what()} failed")
        raise failure(what(), e, None) from e
    return Pending(tensor, work, _What(what), backend=backend_of(group))


class _What:
    """A collective's description for errors, formatted when first shown."""

    __slots__ = ("_format", "_text")

    def __init__(self, format: Callable[[], str]) -> None:
        self._format, self._text = format, None

    def __str__(self) -> str:
        if self._text is None:
            self._text = self._format()
        return self._text

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


_BACKENDS: weakref.WeakKeyDictionary[dist.ProcessGroup, str] = weakref.WeakKeyDictionary()


def backend_of(group: dist.ProcessGroup, /) -> str:
    """``group``'s backend (``"gloo"``, ``"nccl"``, ``"fake"``), looked up once per group."""
    backend = _BACKENDS.get(group)
    if backend is None:
        backend = _BACKENDS[group] = str(dist.get_backend(group))
    return backend


def failure(what: object, error: Exception, timeout: float | None) -> CollectiveError:
    timed_out = timeout is not None and "timed out" in str(error).lower()
    detail = f"the other ranks did not join within {timeout:g} s" if timed_out else str(error)
    return CollectiveError(
        f"{what} failed: {detail}. A peer rank died or is running other collectives (ranks out "
        f"of step); check the other ranks' logs, and FUNCSHARD_DEBUG=1 to compare the "
        f"collectives.{channel.peer_reports()}"
    )


# -- the transport settings every rank agrees on ---------------------------------


_HINT = (
    "These variables choose how each collective moves its bytes, so every rank must see the "
    "same values: set them (or leave them unset) alike for every rank of the job, in the "
    "launcher's environment rather than a per-node or per-rank script"
)


def settings() -> dict[str, str]:
    """The transport settings as this rank reads them, by variable; see [Note: transport settings].

    Inside a step, the settings it holds, read once ([Note: settings held through a step]
    in ``comm/runtime.py``).

    Example:
        >>> sorted(settings())
        ['FUNCSHARD_ALL_GATHER', 'FUNCSHARD_DEBUG', 'FUNCSHARD_REDUCE_SCATTER', 'FUNCSHARD_SHM']
    """
    global _read
    held = runtime.held()
    if held is not None and _read is not None and _read[0] is held:
        return _read[1]
    mine = {
        transport.SHM_ENV: "on" if transport.shm_enabled() else "off",
        ALL_GATHER.ALGORITHM_ENV: runtime.setting(ALL_GATHER.ALGORITHM_ENV, "auto"),
        REDUCE_SCATTER.ALGORITHM_ENV: runtime.setting(REDUCE_SCATTER.ALGORITHM_ENV, "auto"),
        runtime.DEBUG_ENV: "on" if runtime.debug_collectives() else "off",
    }
    _read = None if held is None else (held, mine)
    return mine


_read: tuple[dict[str, str], dict[str, str]] | None = None  # a step's snapshot, and its settings


def check_settings(
    ch: channel.Channel | None,
    op: str,
    tag: str,
    group: dist.ProcessGroup,
    tensor: torch.Tensor,
    what: Callable[[], str],
    /,
) -> None:
    """Agrees before the data collective ``what()``: the settings if they changed, under FUNCSHARD_DEBUG the collective; collective.

    Raises:
        DesyncError: the ranks' transport settings differ, or (FUNCSHARD_DEBUG)
            they issue different collectives here.
    """
    mine = settings()
    if ch is not None and ch.agreed_settings != mine:
        channel.agree_on(Kind.SETTINGS, f"the transport settings before {what()}", mine, hint=_HINT)
        ch.agreed_settings = mine
    if mine[runtime.DEBUG_ENV] == "on":
        _check_same_collective(op, tag, group, tensor, what())


def _check_same_collective(
    op: str, tag: str, group: dist.ProcessGroup, tensor: torch.Tensor, what: str
) -> None:
    """FUNCSHARD_DEBUG: every rank agrees on (op, tag, shape, dtype) first; see [Note: agreements] in ``comm/channel.py``."""
    mine = [op, tag, list(tensor.shape), str(tensor.dtype)]
    members = dist.get_process_group_ranks(group)
    everyone = channel.all_gather_json(mine, f"the debug check before {what}")
    if any(everyone[r] != everyone[members[0]] for r in members):
        listing = "; ".join(
            f"rank {r}: ({sig[0]!r}, {sig[1]!r}, {tuple(sig[2])}, {sig[3]!r})"
            for r, sig in enumerate(everyone)
            if r in members
        )
        raise runtime.DesyncError(
            f"ranks issue different collectives at {what}: {listing}. "
            f"Every rank must call the same units in the same order"
        )
