"""Gradient reduction: from one call's full gradients to the sharded mean over every rank.

A :class:`Reducer` lives for one call of a step (all its micro-batches): it
packs each unit's full gradients into a ``(group_size, numel)`` buffer, divided
by the world size while packing, and starts their reduce-scatter (then an
all-reduce across replicas for ``hybrid_shard``; an all-reduce alone for
``no_shard``); with ``defer`` it keeps the packed gradients locally instead,
to add them to a later micro-batch's (gradient accumulation without
communication, like FSDP's ``no_sync``). The reduced gradients are keyed by
the :class:`FlatLayout` of the flat buffer they belong to. Buffers donated by
the last call (see [Note: donation] in ``shard/flat_shard.py``) receive this
call's results instead of fresh memory.

A part's gradients are packed (:func:`pack_rows`) into every row, or every row
but this rank's own: see [Note: the own row from the leaves] in
``shard/own_row.py``. Where the rows
are in shared memory and go to a reduce-scatter alone (not deferred, nothing
kept to add, the plain row order of a flat layout, a power-of-two mean), this
rank's row is left out and summed from the leaves instead.

[Note: reductions in chunks]
On gloo, a reduce-scatter's input is packed straight into a shared-memory region
(``comm/collectives.py: input_rows``), and that transport gives a region of
``LARGE_BYTES`` or more its pages back while it is free, so that a root unit's embeddings
are not resident all step twice over. Packing into such a region faults every page
in again, every step: about 25 ms for the 32.5 MiB of the benchmark's root unit, 3 %
of its step. A flat part whose packed gradients pass ``LARGE_BYTES`` is therefore
reduced a range of columns at a time, each of at most ``chunk_bytes``: the largest
reduce-scatter input of the other units, and at most half of ``LARGE_BYTES``. Each
range is packed (``shard/flat_rows.pack_flat_columns``), reduce-scattered into its
columns of the gradient and waited for before the next, so the ranges reuse the
warm regions the other units' reductions leave free, and no large region is made.
Each element's sum is the same as the whole reduce-scatter's, in the same order:
the gradient is bitwise that of one reduce-scatter, and the ledger counts the same
bytes. The ranges start after every reduction in flight is done and run one after
another, so they give up overlapping the backward that follows: nothing is lost for
a root unit's embeddings (the usual such part), whose reduction ends backward, but a
unit of more than ``LARGE_BYTES`` of gradients elsewhere in the stack (a very wide
block) waits here too; ``chunk_columns`` checks only the size. Whether a part is reduced in chunks follows from the plan alone
(a CPU device, a group of several ranks, a flat part, exact gradients, no replica
axes, not two-hop, not deferred), so every rank issues the same collectives.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from funcshard._src.comm import collectives
from funcshard._src.comm.collectives import Pending
from funcshard._src.comm.transport import LARGE_BYTES
from funcshard._src.execute.gradients import Gradients
from funcshard._src.execute.param_group import BufferPool, ParamGroup, Reduction
from funcshard._src.execute.partial_gradient import PartialGradient
from funcshard._src.execute.unit_state import Part, UnitRuntime
from funcshard._src.shard.flat import FlatLayout, pack_into
from funcshard._src.shard.flat_rows import pack_flat_columns, row_order
from funcshard._src.shard.own_row import OwnRow, exact_scale

# reductions in flight that hold packed gradients (a staging buffer) when the next unit's
# gradients are packed: the older ones are waited for first. One reducing while the next
# unit's backward computes is all the overlap there is (a group runs its collectives one
# after the other). An all-reduce in place on sockets (no_shard) holds nothing but the
# gradient it becomes, so those queue without a wait, as DDP's buckets do; one through
# shared memory holds a copy of its input until done (comm/shm/__init__.py) and counts.
MAX_PENDING = 1


class Reducer:
    """The gradients of one call of a step; per-step state, never kept across calls."""

    def __init__(
        self,
        *,
        world_size: int,
        spares: dict[FlatLayout, torch.Tensor],
        pool: BufferPool | None = None,
        hold_leaves: bool = False,
        chunk_bytes: int = 0,
    ) -> None:
        self.world_size = world_size
        self.chunk_bytes = chunk_bytes  # see [Note: reductions in chunks]
        self.pool = (
            BufferPool() if pool is None else pool
        )  # see [Note: staging lifetimes] in ``execute/param_group.py``
        # the result, what is kept across micro-batches, donated buffers: gradients.py
        self.gradients = Gradients(spares=spares, hold_leaves=hold_leaves)
        self.deferring: dict[str, tuple[ParamGroup, UnitRuntime]] = {}  # units that deferred
        # reductions in flight, oldest first, each with the group that waits for it
        self.pending: list[tuple[ParamGroup, Reduction]] = []
        # buckets this call packed gradients into: their groups hold the rounds
        self.bucketed: dict[ParamGroup, None] = {}
        self.rounds_opened = 0  # rounds opened so far: their order
        # two-hop units' partial gradients, by layout: [Note: two-hop reductions] in ``execute/partial_gradient.py``
        self.partial_sums: dict[FlatLayout, PartialGradient] = {}
        self.partial_bytes = 0  # partial gradients alive (stored dtype), and their peak
        self.partial_peak = 0

    def reduce(
        self,
        group: ParamGroup,
        unit: UnitRuntime,
        grads: Sequence[torch.Tensor | None],
        /,
        *,
        defer: bool,
        final: bool = False,
    ) -> None:
        """Packs one call's full gradients of ``unit`` (in its leaf order) and has ``group`` reduce them; mutates.

        With ``defer``, packs and keeps them (added to what earlier deferred calls
        kept) to be reduced by a later call without ``defer``. ``final``: the
        unit's last reduction of the step, after which a two-hop unit's partial
        gradient takes its second hop ([Note: two-hop reductions] in ``partial_gradient.py``).
        """
        if defer:
            self.deferring[unit.name] = (group, unit)
        for j, (part, mine) in enumerate(zip(unit.parts, unit.split(grads))):
            if part.layout.dtype.is_floating_point and not part.layout.frozen:
                while self._staged() >= MAX_PENDING:  # before packing: bounded memory
                    self._finish_oldest()
                if group.shared and not defer:
                    self._reduce_in_round(group, unit, j, part, mine)
                else:
                    self._reduce_part(group, unit, part, mine, defer=defer, final=final)

    def reduce_deferred(self) -> None:
        """After the last micro-batch's calls: reduces what units kept and did not reduce since; mutates.

        A unit called in an earlier micro-batch and not in the last one still holds
        its deferred gradients; they are reduced here with zeros for this
        micro-batch, unit by unit in name order. Every rank called the same units in
        every micro-batch (the end of forward agrees on it), so every rank reduces
        the same units here.
        """
        for name in sorted(self.deferring):
            group, unit = self.deferring[name]
            if any(self.gradients.keeps(p.layout) for p in unit.parts):
                self.reduce(group, unit, [None] * len(unit.slots), defer=False, final=True)
        self.deferring.clear()

    def finish(self, *, last: bool = True) -> None:
        """Reduces the buckets' open rounds, waits for every reduction and adds it into :attr:`grads`; mutates.

        After the step's last micro-batch (``last``) the partial gradients take
        their second hop ([Note: two-hop reductions] in ``execute/partial_gradient.py``).
        """
        while rounds := self._open_rounds():
            group, j = rounds[0]
            while self._staged() >= MAX_PENDING:
                self._finish_oldest()
            self._flush(group, j)
        while self.pending:
            self._finish_oldest()
        if not last:
            return
        # units whose last reduction came in an earlier micro-batch, in the order started
        for layout in list(self.partial_sums):
            self._across(layout)
        while self.pending:
            self._finish_oldest()

    def _across(self, layout: FlatLayout, /) -> None:
        """Starts the second hop of ``layout``'s partial gradient ([Note: two-hop reductions] in ``execute/partial_gradient.py``); mutates."""
        p = self.partial_sums.pop(layout)
        sums = p.sums if p.sums.dtype == p.part.grad_dtype else p.sums.to(p.part.grad_dtype)
        out = self.gradients.spare(layout, p.part.grad_dtype)
        reduction = p.group.reduce_across(p.unit, p.part, sums, out=out)
        reduction.partial_bytes = p.sums.numel() * p.sums.element_size()
        self.pending.append((p.group, reduction))

    def abandon(self) -> list[Pending]:
        """After an error: forgets every reduction, returning those in flight (for the caller to drain)."""
        inflight = [r.stage for _, r in self.pending]
        self.pending.clear()
        self.gradients.clear()
        self.deferring.clear()
        self.partial_sums.clear()
        self.bucketed.clear()  # the groups forget their rounds in ParamGroup.discard
        return inflight

    def _reduce_in_round(
        self,
        group: ParamGroup,
        unit: UnitRuntime,
        j: int,
        part: Part,
        mine: Sequence[torch.Tensor | None],
    ) -> None:
        """Packs ``unit``'s gradients of part ``j`` into its bucket's round; the last member reduces it."""
        layout = part.layout
        self.gradients.drop_spare(layout)  # a bucket's result is one buffer: no donated one fits
        self.bucketed[group] = None
        columns, flushed = group.columns(unit, j, part.grad_dtype, opened=self.rounds_opened)
        self.rounds_opened += 1
        if flushed is not None:  # a unit reported twice in this round: that round is reducing
            self.pending.append((group, flushed))
        kept = self.gradients.take_kept(layout)
        pack_into(  # casts to the reduce dtype: [Note: cast while packing] in ``shard/flat_rows.py``
            layout,
            mine,
            columns,
            unit.axes,
            scale=1.0 if kept is not None else 1.0 / self.world_size,
        )
        if kept is not None:
            columns.add_(kept)
            self.pool.give(kept)
            columns.div_(self.world_size)
        if group.complete(j):
            self._flush(group, j)

    def _flush(self, group: ParamGroup, j: int) -> None:
        """Has ``group`` start reducing its open round of part ``j``."""
        self.pending.append((group, group.flush(j)))

    def _open_rounds(self) -> list[tuple[ParamGroup, int]]:
        """The buckets' rounds not yet reduced, in the order they opened: (group, part)."""
        rounds = [(opened, g, j) for g in self.bucketed for opened, j in g.open_rounds()]
        return [(g, j) for _, g, j in sorted(rounds, key=lambda r: r[0])]

    def _reduce_part(
        self,
        group: ParamGroup,
        unit: UnitRuntime,
        part: Part,
        mine: Sequence[torch.Tensor | None],
        *,
        defer: bool,
        final: bool,
    ) -> None:
        """Packs one part of a group of one (or keeps it, deferred) and has ``group`` reduce it."""
        layout = part.layout
        device = unit.device(part)
        if (
            self.gradients.hold_leaves
            and unit.group_size == 1
            and unit.replica_size == 1
            and part.grad_dtype == layout.dtype
            and self.gradients.keep_as_leaves(layout, mine, device)
        ):
            return
        # a two-hop unit's donated buffer receives its second hop ([Note: two-hop reductions] in ``execute/partial_gradient.py``)
        spare = None if defer or unit.two_hop else self.gradients.spare(layout, part.grad_dtype)
        kept = self.gradients.take_kept(layout)  # packed by earlier micro-batches' calls
        dtype = part.grad_dtype
        columns = chunk_columns(unit, part, self.chunk_bytes, defer=defer)
        if columns:  # [Note: reductions in chunks]
            while self.pending:  # the ranges reuse the regions these hold
                self._finish_oldest()
            pool = group.pool  # as the root's whole rows: not kept for the next step
            reduced = reduce_in_chunks(
                group,
                unit,
                part,
                _cast(mine, dtype),
                kept,
                pool,
                out=spare,
                columns=columns,
                world_size=self.world_size,
            )
            if kept is not None:
                self.pool.give(kept)
            self.gradients.add(layout, reduced)
            return
        shared = None
        if spare is not None and unit.group_size == 1:
            rows = spare.view(1, -1)  # no_shard: reduced in place, this becomes the gradient
            spare = None
        else:
            if (
                unit.group_size > 1
                and not defer
                and device.type == "cpu"
                and not unit.grad_block
                and not unit.two_hop
            ):
                # packed straight into shared memory, which the reduce-scatter sends as it is
                shared = collectives.input_rows(unit.bound, unit.axes, layout.numel, dtype)
            pool = group.pool if unit.is_root else self.pool  # the root's: not kept
            rows = (
                shared
                if shared is not None
                else pool.take(unit.group_size * layout.numel, dtype, device).view(
                    unit.group_size, layout.numel
                )
            )
        # the mean over every data-parallel rank: divide while packing, unless gradients
        # kept from earlier micro-batches are still to be added
        direct = kept is None and not defer
        replica = unit.all_reduce_axes
        packed = rows
        if unit.group_size == 1 and replica and not defer and device.type == "cpu":
            # no_shard: packed straight into shared memory, summed from there into rows
            into = collectives.input_rows(unit.bound, replica, layout.numel, dtype, all_reduce=True)
            packed = rows if into is None else into.view(1, -1)
        # a two-hop unit's rows come last axis major ([Note: two-hop reductions] in ``execute/partial_gradient.py``)
        order = unit.partial.order if unit.two_hop else unit.axes
        scale = 1.0 / self.world_size if direct else 1.0
        own_row = direct and shared is not None
        # the packing casts ([Note: cast while packing] in ``shard/flat_rows.py``), but the own
        # row sums from leaves in the reduce dtype
        leaves = _cast(mine, dtype) if own_row else mine
        own = pack_rows(unit, layout, leaves, packed, order, scale=scale, shared=own_row)
        if kept is not None:
            packed.add_(kept)
            self.pool.give(kept)
        if defer:
            self.gradients.keep(layout, rows)
            return
        if not direct:
            packed.div_(self.world_size)
        # over one rank, rows is the result; the root's rows are not kept for the next
        # step; shared rows belong to the group's regions
        keep = unit.group_size > 1 and not unit.is_root and shared is None
        reduction = group.reduce(unit, part, rows, packed, out=spare, keep_rows=keep, own=own)
        reduction.then_across = reduction.first_hop and final
        self.pending.append((group, reduction))

    def _staged(self) -> int:
        """Reductions in flight that hold packed gradients beside their result."""
        return sum(r.packed for _, r in self.pending)

    def _finish_oldest(self) -> None:
        """Waits for the oldest reduction; its result goes into the gradients (``gradients.py``)."""
        group, reduction = self.pending.pop(0)
        reduced = group.wait(reduction, self.pool)
        self.partial_bytes -= reduction.partial_bytes
        if reduction.first_hop:  # into the partial gradient: [Note: two-hop reductions] in ``execute/partial_gradient.py``
            ((layout, _, _),) = reduction.pieces
            partial = self.partial_sums.get(layout)
            if partial is None:
                unit = group.members[0]
                part = unit.parts[[p.layout for p in unit.parts].index(layout)]
                sums = reduced if reduced.dtype == layout.dtype else reduced.to(layout.dtype)
                self.partial_sums[layout] = PartialGradient(group, unit, part, sums)
                self.partial_bytes += sums.numel() * sums.element_size()
                self.partial_peak = max(self.partial_peak, self.partial_bytes)
            else:
                partial.sums.add_(reduced)
            if reduction.then_across:
                self._across(layout)
            return
        for layout, a, b in reduction.pieces:
            self.gradients.add(layout, reduced if (a, b) == (0, reduced.numel()) else reduced[a:b])


# -- packing one part's gradients --------------------------------------------------------


def _cast(
    leaves: Sequence[torch.Tensor | None], dtype: torch.dtype, /
) -> list[torch.Tensor | None]:
    """``leaves`` in ``dtype``, each cast on its own: where the packing cannot cast them."""
    return [g if g is None or g.dtype == dtype else g.to(dtype) for g in leaves]


def pack_rows(
    unit: UnitRuntime,
    layout: FlatLayout,
    leaves: Sequence[torch.Tensor | None],
    rows: torch.Tensor,
    order: Sequence[str],
    /,
    *,
    scale: float,
    shared: bool,
    start: int = 0,
) -> OwnRow | None:
    """Packs ``leaves`` times ``scale`` into ``rows`` ``(group_size, width)``, columns from ``start``; mutates ``rows``.

    Returns the :class:`OwnRow` the reduce-scatter sums this rank's row from, where
    ``rows`` (``shared``: in shared memory) are packed without it, else ``None``.
    """
    width = rows.shape[1]
    if (
        shared
        and layout.flat
        and tuple(order) == unit.axes
        and row_order(layout.mesh, unit.axes) is None
        and exact_scale(scale)
    ):
        me = unit.bound.group_rank(unit.axes)
        pack_flat_columns(layout, leaves, rows, start, scale, skip=me)
        return OwnRow(layout, leaves, me * layout.numel + start, width, scale)
    if start or width != layout.numel:
        pack_flat_columns(layout, leaves, rows, start, scale)
    else:
        pack_into(layout, leaves, rows, order, scale=scale)
    return None


# -- reductions in chunks ---------------------------------------------------------------


def _input_bytes(unit: UnitRuntime, part: Part, /) -> int:
    """Bytes of ``part``'s packed gradients, ``(group_size, numel)`` in the reduce dtype."""
    return unit.group_size * part.layout.numel * part.grad_dtype.itemsize


def chunk_bytes_for(units: Iterable[UnitRuntime], /) -> int:
    """The most bytes a range of a reduction in chunks packs: see [Note: reductions in chunks].

    The largest reduce-scatter input of the units other than the root, at most half
    of ``LARGE_BYTES``; 0 where no such unit reduces (nothing is chunked).
    """
    sizes = [
        _input_bytes(u, p)
        for u in units
        if not u.is_root and u.group_size > 1
        for p in u.parts
        if p.layout.dtype.is_floating_point and not p.layout.frozen
    ]
    return min(max(sizes, default=0), LARGE_BYTES // 2)


def chunk_columns(unit: UnitRuntime, part: Part, chunk_bytes: int, /, *, defer: bool) -> int:
    """Columns a range of ``part``'s reduction holds, or 0 where it is reduced whole."""
    layout = part.layout
    if (
        defer
        or not layout.flat
        or unit.group_size == 1
        or unit.all_reduce_axes
        or unit.grad_format
        or unit.two_hop
        or unit.device(part).type != "cpu"
        or _input_bytes(unit, part) <= LARGE_BYTES
    ):
        return 0
    columns = chunk_bytes // (unit.group_size * part.grad_dtype.itemsize)
    return columns if 0 < columns < layout.numel else 0


def reduce_in_chunks(
    group: ParamGroup,
    unit: UnitRuntime,
    part: Part,
    leaves: Sequence[torch.Tensor | None],
    kept: torch.Tensor | None,
    pool: BufferPool,
    /,
    *,
    out: torch.Tensor | None,
    columns: int,
    world_size: int,
) -> torch.Tensor:
    """Reduces ``part``'s gradients ``columns`` at a time; returns this rank's ``(numel,)`` of the mean.

    ``leaves`` are this call's full gradients (in the reduce dtype); ``kept``, the
    packed gradients earlier micro-batches deferred. Writes into ``out`` where
    given. See [Note: reductions in chunks].
    """
    layout, dtype = part.layout, part.grad_dtype
    n, g = layout.numel, unit.group_size
    device = unit.device(part)
    result = out if out is not None else torch.empty(n, dtype=dtype, device=device)
    for start in range(0, n, columns):
        width = min(columns, n - start)
        rows = collectives.input_rows(unit.bound, unit.axes, width, dtype)
        staged = None
        if rows is None:  # no shared memory: a buffer of the pool's
            staged = rows = pool.take(g * width, dtype, device).view(g, width)
        scale = 1.0 / world_size if kept is None else 1.0
        shared = staged is None and kept is None
        own = pack_rows(
            unit, layout, leaves, rows, unit.axes, scale=scale, shared=shared, start=start
        )
        if kept is not None:
            rows.add_(kept[:, start : start + width]).div_(world_size)
        into = result[start : start + width]
        group.wait_columns(group.reduce_columns(unit, rows, into, first=start == 0, own=own))
        if staged is not None:
            pool.give(staged)
    return result
