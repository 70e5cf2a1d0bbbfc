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
(``preflight.py``); with ``FUNCSHARD_DEBUG=1`` every collective first agrees on
(op, tag, shape, dtype) with every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from funcshard._src.comm import channel, transport
from funcshard._src.comm.groups import BoundMesh
from funcshard._src.comm.ledger import Ledger
from funcshard._src.comm.pending import Pending, backend_of, issue
from funcshard._src.comm.torch_transport import (
    ALL_GATHER,
    REDUCE_SCATTER,
    TORCH,
    AllGatherAlgorithm,
    Each,
    ReduceScatterAlgorithm,
)

_all_gather_single = channel.all_gather_single
_reduce_scatter_single = channel.reduce_scatter_single


def group_size(bound: BoundMesh, axes: tuple[str, ...], /) -> int:
    """Number of ranks in a group over ``axes``."""
    size = 1
    for a in axes:
        size *= bound.mesh.axis_size(a)
    return size


def all_gather(
    flat: torch.Tensor,
    bound: BoundMesh,
    axes: tuple[str, ...],
    /,
    *,
    out: torch.Tensor | None = None,
    ledger: Ledger | None = None,
    tag: str = "",
    algorithm: AllGatherAlgorithm | None = None,
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
        algorithm: see ``torch_transport.py``; ``None`` is ``FUNCSHARD_ALL_GATHER``, else
            ``"auto"``. Every rank must use the same. Anything but gloo always runs
            ``"native"``.
        stable: the caller promises that nothing frees or writes ``flat`` until its
            evaluation ends and :func:`settle` has returned; peers may then read it
            in place ([Note: shards read in place] in ``shm/cross_memory.py``).

    Raises:
        CollectiveError: the collective could not start.
        ValueError: ``algorithm`` is unknown.
    """
    size = group_size(bound, axes)
    group = bound.group(axes)
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
        # gloo's native and the rings alike: (W - 1) / W of the gathered bytes, see ledger.py
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
    size = group_size(bound, axes)
    group = bound.group(axes)
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
    group = bound.group(axes)
    if group is None or backend_of(group) != "gloo":
        return None
    plugin = transport.shared_memory()
    if plugin is None:
        return None
    rows = 1 if all_reduce else group_size(bound, axes)
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
    gathered ([Note: shards read in place] in ``shm/cross_memory.py``); at once where
    nothing was.

    Raises:
        CollectiveError: a peer exited, or has not read within the collective timeout.

    Example:
        >>> settle()
    """
    transport.settle()


def reduce_scatter(
    rows: torch.Tensor,
    bound: BoundMesh,
    axes: tuple[str, ...],
    /,
    *,
    out: torch.Tensor | None = None,
    ledger: Ledger | None = None,
    tag: str = "",
    algorithm: ReduceScatterAlgorithm | None = None,
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
        algorithm: see ``torch_transport.py``; ``None`` is ``FUNCSHARD_REDUCE_SCATTER``, else ``"auto"``.
            Every rank must use the same. Anything but gloo always runs ``"native"``.
        own: makes this rank's row when summed, which ``rows`` then need not hold:
            ``rows`` from ``collectives.input_rows`` only ([Note: the own row
            from the leaves] in ``shard/own_row.py``).

    Raises:
        CollectiveError: the collective could not start.
        ValueError: ``algorithm`` is unknown, or ``own`` is given where the
            collective does not run through shared memory.
    """
    size = group_size(bound, axes)
    group = bound.group(axes)
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
        # twice as much, which the ledger (like the cost model) does not count: see ledger.py
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
    size = group_size(bound, axes)
    group = bound.group(axes)
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
