"""Parameter groups: the one owner of the collectives that gather parameters and reduce gradients.

A :class:`ParamGroup` is one or more units whose parameters are all-gathered
together, freed and whose gradients are reduced together. A unit alone is a
group of one; consecutive small units form a bucket (:func:`make_groups`), a
group of several. Every group runs the same code: its members' columns side by
side (:class:`Columns`) in each all-gather and each round of gradients, a
group of one's being the whole of its part.

[Note: one owner per collective]
Every all-gather, reduce-scatter and all-reduce of a step is issued and waited
for by the group of the units it moves, here and nowhere else, which also counts
it in the ledger and takes and gives back its staging buffers; the bytes of
gathered parameters alive (``GatheredMemory``) are counted here for the staging
of a collective in flight and by the unit transitions the group calls
(``unit_state.py``) for a unit's storage. ``Run`` asks a group for one of its
units (:meth:`ParamGroup.prefetch`, :meth:`~ParamGroup.acquire`,
:meth:`~ParamGroup.release`, :meth:`~ParamGroup.drop_unused`); the group moves
its members through their states (``unit_state.py``), which check each transition
and never call back. The :class:`Reducer` (below) packs a call's gradients into
its unit's columns of a round (:meth:`~ParamGroup.columns`) and has the group
reduce the round once every member reported (:meth:`~ParamGroup.flush`: at once,
for a group of one); the group holds each reduction it starts until the Reducer
asks it to finish its oldest (:meth:`~ParamGroup.finish_oldest`). Open rounds are
the group's alone (:meth:`~ParamGroup.open_rounds`).

Sharing is per collective, state is per unit: a group's first member that needs
its parameters gathers every member still SHARDED in one all-gather per part, and
each member unpacks its own columns when acquired; members are freed one by one as
their calls end. Gradients are packed side by side and reduced once every member
has reported; a member that reports twice (a unit called twice) first flushes the
round with the columns not yet reported left at zero. What only a unit alone can
have (a partial copy, a part gathered in place, quantized collectives, two-hop
or chunked reductions) follows from its part and unit, which :func:`plan_groups`
keeps out of buckets; no code asks whether a group is a bucket. The one thing
asked of a round is whether it holds one part alone, as a group of one's does:
then a donated buffer can be its result and its own row can be left out.

[Note: bucket order]
Which members join a collective depends only on unit states and the order of
reports, the same on every rank for the same calls (see [Note: collective
order] in ``run.py``), so every rank issues the same bucketed collectives. The
ledger counts every member's bytes as if it had its own collective, so it equals
the cost model (which counts per unit) for every bucket size.

[Note: a group lives for one step]
A step makes its groups afresh (:func:`make_groups`) from the membership decided
once with the units (:func:`plan_groups`), and drops them at its end: everything a
group holds is that step's, the all-gathers in flight (:attr:`ParamGroup.inflight`,
by part, and the collectives behind them), the open rounds, the reductions in flight
(:attr:`ParamGroup.reductions`, oldest first) and two-hop partial gradients
(:attr:`ParamGroup.partial_sums`). What outlives a step is the units' (their shards'
bindings, gathered storage and state, ``unit_state.py``) and the staging pools'.
The :class:`Reducer` (per step too) keeps the order in which groups started
their reductions, to wait for the oldest first across groups, the gradients, and
which units deferred theirs, which groups hold open rounds and which hold
partial gradients (with the bytes of those alive).

Buckets: a collective over a few hundred kilobytes costs its latency, not its
bytes: on gloo at W=2 a round trip is about as long as moving a megabyte.
:func:`make_groups` joins consecutive units of the plan (same strategy, same
collective axes, same parts by dtype) up to ``bucket_bytes`` of gathered
parameters into one group, as DDP buckets its all-reduces; every other unit is a
group of its own.

A two-hop unit's partial gradient is its gradients reduced over the last mesh
axis, before the others.

[Note: two-hop reductions]
A hybrid_shard_optimizer unit (HFSDP) keeps its partial copy, sharded over the last
mesh axis, for the whole step ([Note: partial copies] in plan/strategy.py); its
gradients are reduced the same way, so that only one reduction a step crosses the
other axes. Each micro-batch packs the unit's gradients with the last axis major
(``unit.partial.order``) and reduce-scatters them over the last axis alone: a rank
gets the sum over its last-axis group of the rows its copy holds, ``copy rows *
numel``, which it adds into a partial gradient in the stored dtype. Once the unit's
last reduction of the step is in (its last call's, in the last micro-batch: ``Run``
says which), the partial gradient is reduce-scattered over the other axes (in the
reduce dtype) while backward goes on; one whose unit was last called in an earlier
micro-batch goes at the step's end, in the order started. Every rank reduces the same
units in the same order, so every rank starts the same second hops in the same order.
The result is the rank's shard of the mean, as one reduce-scatter over every rank
would give, and the two hops send its bytes, (g - 1) / g of the unit, with only
1 / (last axis size) of them across the other axes, once a step. A partial gradient
is alive from its first reduction of the step to its second hop: across micro-batches
every unit's, within one micro-batch (or with ``accumulate="unsharded"``) one unit's at
a time, since a second hop is waited for before the next first hop finishes. Quantized
gradients are quantized on both hops (qgZ's two hops).

**Gradient reduction**, from one call's full gradients to the sharded mean over
every rank. A :class:`Reducer` lives for one call of a step (all its micro-batches): it
packs each unit's full gradients into a ``(group_size, numel)`` buffer, divided
by the world size while packing, and starts their reduce-scatter (then an
all-reduce across replicas for ``hybrid_shard``; an all-reduce alone for
``no_shard``); with ``defer`` it keeps the packed gradients locally instead,
to add them to a later micro-batch's (gradient accumulation without
communication, like FSDP's ``no_sync``). The reduced gradients are kept by the
:class:`Part` (a unit's buffer of one dtype) they belong to (``gradients.py``). Buffers donated by
the last call (see [Note: donation] in ``shard/sharded.py``) receive this
call's results instead of fresh memory.

A part's gradients are packed (:func:`pack_rows`) into every row, or every row
but this rank's own: see [Note: the own row from the leaves] in
``shard/flat.py``. Where the rows
are in shared memory and go to a reduce-scatter alone (not deferred, nothing
kept to add, the plain row order of a flat layout, a power-of-two mean), this
rank's row is left out and summed from the leaves instead.

[Note: reductions in chunks]
On gloo, a reduce-scatter's input is packed straight into a shared-memory region
(``comm/collectives.py: input_rows``), and that transport gives a region of
``LARGE_BYTES`` or more its pages back while it is free, so that a root unit's
embeddings are not resident all step twice over. Packing into such a region faults every
page in again, every step: about 25 ms for the 32.5 MiB of the benchmark's root unit, 3
% of its step. And a root unit's reduction comes at the end of backward, where a step's
memory peaks: its packed gradients, as large as the embeddings, would stand beside the
embeddings' full gradients (at eight ranks, 491 MiB for the untied head and embeddings
of a 601M GPT, whose peak growth fell from 2360 to 2212 MiB in chunks;
``bench/results/memory_shapes/``). A part whose packed gradients pass ``LARGE_BYTES`` is
therefore reduced a range of columns at a time, each of at most ``chunk_bytes``: the
largest reduce-scatter input of the other units, and at most half of ``LARGE_BYTES``. A
flat part's ranges are any columns. In the leaf layout, only the root unit's parts are
reduced in chunks: a block's reduction overlaps the backward of the blocks before it,
which ranges waited for one by one would give up. Their ranges
(``shard/flat.leaf_column_ranges``) are whole slots side by side, or whole rows along
dim 0 of one slot's chunk, which its chunk grid packs as views (one chunk row wider than
``chunk_bytes`` is a range of its own). Each range is packed
(``shard/flat.pack_flat_columns``, ``pack_leaf_columns``), reduce-scattered into its
columns of the gradient and waited for before the next, so the ranges reuse the warm
regions the other units' reductions leave free, and no large region is made; without
shared memory each range takes a buffer of at most ``chunk_bytes`` from its group's
gather pool (the root's keeps none between ranges: :func:`make_groups`), and no buffer
as large as the part is made.
Each element's sum is the same as the whole reduce-scatter's, in the same order: the
gradient is bitwise that of one reduce-scatter, and the ledger counts the same bytes.
The ranges start after every reduction in flight is done and run one after another, so
they give up overlapping the backward that follows: nothing is lost for a root unit's
embeddings (the usual such part), whose reduction ends backward, but a flat unit of more
than ``LARGE_BYTES`` of gradients elsewhere in the stack (a very wide block) waits here
too; ``chunk_ranges`` checks only the size of a flat part. Whether a part is reduced in
chunks follows from the plan alone (a CPU device, a group of several ranks, a flat part
or a root unit's part whose leaves divide evenly into their chunks, exact gradients, no
replica axes, not two-hop, not deferred), so every rank issues the same collectives.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from funcshard._src.comm import collectives, quantized
from funcshard._src.comm.collectives import Ledger, Pending
from funcshard._src.comm.transport import ALL_GATHER, LARGE_BYTES
from funcshard._src.execute.gradients import Gradients, PartKey
from funcshard._src.execute.streams import Streams, streams_for
from funcshard._src.execute.unit_state import Part, UnitRuntime, UnitState
from funcshard._src.shard.flat import (
    FlatLayout,
    OwnRow,
    exact_scale,
    layout_row_order,
    leaf_column_ranges,
    pack_flat_columns,
    pack_into,
    pack_leaf_columns,
    unpack_into,
)

# -- staging buffers ------------------------------------------------------------------
# Staging buffers reused across calls: all-gather outputs and reduce-scatter inputs.
#
# Every unit's all-gather writes into a ``(group_size * numel,)`` buffer that is
# unpacked into the unit's full leaves and then no longer needed, and every
# unit's gradients are packed into a ``(group_size, numel)`` buffer that is only
# read by its reduce-scatter. Allocating them afresh for every unit and step
# costs more than the copies themselves where the allocator returns large blocks
# to the system (fresh pages are faulted in and zeroed: 7.4 ms for 12 MiB against
# 0.9 ms into memory in use, measured on the benchmark's machine). A
# :class:`BufferPool` keeps what was given back, per size and dtype, and hands it
# out again.
#
# [Note: staging lifetimes]
# A buffer is given back only once no collective uses it: an all-gather output
# after its wait and its unpacking, a reduce-scatter input after its wait. The
# executor needs at most ``prefetch`` all-gather outputs and one reduce-scatter
# input in flight at once (the next unit's gradients are packed only after the
# reduction before them finished, see ``MAX_PENDING`` in ``param_group.py``; a
# deferred micro-batch holds each unit's packed rows until the last one adds them),
# so a step keeps two pools shared by its groups, one of that depth for all-gather
# outputs and one of depth one for reduce-scatter inputs, and they serve every unit
# of a stack of identical blocks with one allocation of each kind per step. The root
# unit's group has a third of its own, of depth 0 (:func:`make_groups`): its staging
# is used once a step and is as large as the embeddings. Once the step's last call but the
# root's is reduced (on the last micro-batch), ``Run`` drains both pools
# (:meth:`BufferPool.drain`): nothing gathers again in that step, and the peak of a
# step with tied or large embeddings is at its very end, while autograd sums the
# root's gradients, where a kept block's all-gather output and packed gradients
# would add to it (``bench/results/memory_shapes/``); between steps they would add
# to the optimizer's peak. The next step refills them (:meth:`BufferPool.refill`).
# What the pools keep between calls (:attr:`BufferPool.held_bytes`, nothing after a
# training step, up to the depths after an evaluation) is
# ``Step.stats.staging_bytes``, and the cost model counts a step's staging at its
# peak. After an error, buffers of collectives in flight are dropped, never given
# back (the collective may still write).


_Key = tuple[int, torch.dtype, torch.device]


class BufferPool:
    """Free staging buffers by (numel, dtype, device), at most ``depth`` of each; mutates.

    ``depth=0`` keeps nothing: the root unit's staging, used once a step and as large
    as the embeddings, would otherwise be held through every forward.
    """

    def __init__(self, depth: int = 1) -> None:
        if depth < 0:
            raise ValueError(f"a buffer pool needs a depth of at least 0, got {depth}")
        self.depth = depth
        self.allocations = 0  # buffers made because none of the kind was free
        self._free: dict[_Key, list[torch.Tensor]] = {}
        self._draining = False  # drain(): keep nothing given back until refill()

    @property
    def held_bytes(self) -> int:
        """Bytes of the free buffers the pool keeps."""
        return sum(t.numel() * t.element_size() for ts in self._free.values() for t in ts)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A ``(numel,)`` buffer of uninitialized values: one given back before, or a new one.

        Example:
            >>> pool = BufferPool()
            >>> a = pool.take(4, torch.float32, torch.device("cpu"))
            >>> pool.give(a)
            >>> pool.take(4, torch.float32, torch.device("cpu")) is a
            True
        """
        free = self._free.get((numel, dtype, device))
        if free:
            return free.pop()
        self.allocations += 1
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, buffer: torch.Tensor, /) -> None:
        """Takes ``buffer`` back for reuse; the caller must not use it again (no collective may).

        Only whole buffers from :meth:`take` (or views of all of one) are kept;
        beyond ``depth`` of a kind, the buffer is dropped.
        """
        if self._draining:
            return
        base = buffer if buffer._base is None else buffer._base
        if base.dim() != 1 or base.numel() != buffer.numel():
            return
        free = self._free.setdefault((base.numel(), base.dtype, base.device), [])
        if len(free) < self.depth:
            free.append(base)

    def clear(self) -> None:
        """Drops every free buffer; mutates."""
        self._free.clear()

    def drain(self) -> None:
        """Drops every free buffer and keeps none given back until :meth:`refill`; mutates.

        See [Note: staging lifetimes]: a step drains its pools once its last unit
        but the root is reduced.

        Example:
            >>> pool = BufferPool()
            >>> a = pool.take(4, torch.float32, torch.device("cpu"))
            >>> pool.drain()
            >>> pool.give(a)
            >>> pool.held_bytes
            0
            >>> pool.refill()
            >>> pool.give(a)
            >>> pool.held_bytes
            16
        """
        self.clear()
        self._draining = True

    def refill(self) -> None:
        """Keeps buffers given back again, up to ``depth`` of a kind (after :meth:`drain`); mutates."""
        self._draining = False


# -- a bucket's bookkeeping: members side by side ---------------------------------------


class Columns:
    """Per part: each member's column offset in the packed buffer, and the columns in all."""

    def __init__(self, members: Sequence[UnitRuntime]) -> None:
        self.offsets: list[list[int]] = []
        self.numels: list[int] = []
        for j in range(len(members[0].parts)):
            offsets, n = [], 0
            for member in members:
                offsets.append(n)
                n += member.parts[j].layout.numel
            self.offsets.append(offsets)
            self.numels.append(n)
        self.members = list(members)

    def span(self, member: int, part: int) -> tuple[int, int]:
        """Member ``member``'s columns ``[start, stop)`` of part ``part``."""
        a = self.offsets[part][member]
        return a, a + self.members[member].parts[part].layout.numel


@dataclass(eq=False)
class GatherOp:
    """One part's all-gather in flight for the members that joined it, and the staging it holds.

    ``pendings`` are the collectives behind it, in the order issued: one, or one per
    leaf where a part is gathered leaf by leaf (:attr:`Part.by_leaf`). ``staging``
    (the output rows and, where it was packed, the input) goes back to the pool once
    the op was waited for and every member in ``open`` unpacked its columns.
    """

    pendings: list[Pending]
    staging: tuple[torch.Tensor, ...]
    open: set[int]
    waited: bool = False

    def wait(self) -> None:
        """Waits for the collectives (once: a failed wait is not waited for again)."""
        if self.waited:
            return
        self.waited = True
        for pending in self.pendings:
            pending.wait()


@dataclass(eq=False)
class Gathering:
    """A member's part in an all-gather in flight: what :meth:`ParamGroup._finish` fills its leaves from.

    ``result`` is the member's columns of the op's ``(group_size, numel)`` rows, or,
    ``in_place``, the part's full storage itself, written by the collectives.
    """

    op: GatherOp
    result: torch.Tensor
    in_place: bool = False
    # in_place: the storage's version counter, put back once the collectives have written
    version: torch.autograd._unsafe_preserve_version_counter | None = None

    def wait(self) -> torch.Tensor:
        """Blocks until ``result`` is filled; returns it."""
        self.op.wait()
        return self.result


@dataclass(eq=False)
class Round:
    """One part's packed gradients of the members that reported so far, and where they go.

    ``rows`` ``(group_size, numel)`` are what the round's reduction reduces;
    ``packed``, where the members pack their columns: ``rows``, or for ``no_shard``
    the transport's input of the all-reduce that sums them into ``rows``.
    """

    rows: torch.Tensor
    packed: torch.Tensor
    opened: int  # when the round opened, in the step's count of rounds: the order to flush in
    in_region: bool  # ``rows`` are the transport's own input buffer (shared memory)
    out: torch.Tensor | None  # where the reduce-scatter writes, a donated buffer, or None
    reported: set[int] = field(default_factory=set)


# -- a reduction in flight --------------------------------------------------------------


@dataclass(eq=False)
class Reduction:
    """One part's reduction in flight: a round of the members' gradients, or a second hop.

    ``pieces`` says whose gradient each ``[start, stop)`` of the result is: one
    per member that reported in the round. The all-reduce across replicas is
    counted in the ledger per piece, as the cost model counts it per unit.
    """

    pieces: tuple[tuple[Part, int, int], ...]
    stage: Pending
    then_all_reduce: tuple[str, ...]
    tag: str
    staging: torch.Tensor | None  # the packed input, for the pool once the stage is done
    packed: bool = True  # holds packed gradients beside its result (not an all-reduce in place)
    # the first hop of a two-hop reduction: its result is summed into a partial gradient,
    # see [Note: two-hop reductions] in param_group.py
    first_hop: bool = False
    # the unit's last first hop of the step: the second starts once it is in
    then_across: bool = False
    partial_bytes: int = 0  # a second hop: the bytes of the partial gradient it reduces


@dataclass
class Finished:
    """What waiting for a group's oldest reduction finished (:meth:`ParamGroup.finish_oldest`).

    ``results``: each part's reduced gradient (this rank's shard, or a bucket
    member's piece of it), for ``gradients.py``; none for a first hop.
    ``partial_bytes``: the change in bytes of partial gradients alive;
    ``started``: a second hop was started (one more reduction in flight).
    """

    results: list[tuple[Part, torch.Tensor]]
    partial_bytes: int
    started: bool = False


class ParamGroup:
    """Units gathered, freed and reduced together in one step, and every collective that moves them; see [Note: one owner per collective]."""

    def __init__(
        self, members: Sequence[UnitRuntime], gather_pool: BufferPool, reduce_pool: BufferPool
    ) -> None:
        self.members = list(members)
        first = self.members[0]
        self.bound, self.axes, self.replica_axes = first.bound, first.axes, first.replica_axes
        self.group_size, self.replica_size = first.group_size, first.replica_size
        self.all_reduce_axes = first.all_reduce_axes
        self.ledger, self.memory = first.ledger, first.memory
        self.pool = gather_pool  # all-gather staging (and the root unit's packed gradients)
        self.reduce_pool = reduce_pool  # a bucket's rounds
        self.index = {m.name: i for i, m in enumerate(self.members)}
        # the members' columns side by side in each collective (plan_groups made a
        # bucket's members gather packed)
        self.columns_of = Columns(self.members)
        # -- the step's state: [Note: a group lives for one step]
        self.inflight: dict[Part, Gathering] = {}  # each GATHERING member's parts' all-gathers
        # all-gathers with members not yet unpacked: a later one may start for members
        # freed while others still wait on an earlier one (a unit called again)
        self._gathering: list[GatherOp] = []
        self.rounds: dict[int, Round] = {}  # a bucket's open reduction rounds, by part
        self.reductions: list[Reduction] = []  # in flight, oldest first
        # two-hop parts' partial gradients: [Note: two-hop reductions] in param_group.py
        self.partial_sums: dict[Part, torch.Tensor] = {}

    @property
    def name(self) -> str:
        """The unit's name, or ``first..last`` for a bucket: for errors and traces."""
        first, last = self.members[0].name, self.members[-1].name
        return first if first == last else f"{first}..{last}"

    # -- reducing: what the Reducer asks for ----------------------------------------

    def columns(
        self,
        unit: UnitRuntime,
        j: int,
        /,
        *,
        opened: int,
        into: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, bool, Reduction | None]:
        """Where ``unit`` packs its gradients of part ``j`` in this round: ``(columns, in_region, flushed)``; takes staging.

        ``columns`` are the unit's ``(group_size, numel)`` of the round's packed
        rows; ``in_region``: the rows are the transport's own input buffer (shared
        memory), so the rank's own row may be left out ([Note: the own row from the
        leaves] in ``shard/flat.py``). A round opened here records ``opened``
        (:meth:`open_rounds` orders by it); ``into`` is a donated buffer for a
        round that is ``unit``'s part alone: over one rank its rows, else the
        reduce-scatter's result. A member that already reported in this round
        flushes it first: that reduction is returned as ``flushed``.
        """
        member = self.index[unit.name]
        flushed = None
        round_ = self.rounds.get(j)
        if round_ is not None and member in round_.reported:
            flushed = self.flush(j)
            round_ = None
        if round_ is None:
            round_ = self.rounds[j] = self._open_round(unit, j, opened, into)
        round_.reported.add(member)
        a, b = self.columns_of.span(member, j)
        return round_.packed[:, a:b], round_.in_region, flushed

    def _open_round(
        self, unit: UnitRuntime, j: int, opened: int, into: torch.Tensor | None, /
    ) -> Round:
        """A round of part ``j``, its rows in the transport's input buffer where it has one, else staging.

        Over one rank a donated ``into`` is the rows (reduced in place, they become the
        gradient); else rows of the reduce pool (the root's keeps nothing: [Note:
        staging lifetimes]). Only a round that its first report completes (a group of
        one's) packs into the transport's input: a bucket's stays open while other
        collectives run on the group.
        """
        part = unit.parts[j]
        numel, dtype, device = self.columns_of.numels[j], part.grad_dtype, unit.device(part)
        cpu = device.type == "cpu"
        out = into if self.group_size > 1 else None
        # the transport's input is for the next collective on the group alone
        # (collectives.input_rows): a round one report completes, reduced at once
        at_once = len(self.members) == 1
        region = None
        if into is not None and out is None:
            rows = into.view(1, -1)
        else:
            if at_once and self.group_size > 1 and cpu and not unit.grad_block and not unit.two_hop:
                region = collectives.input_rows(self.bound, self.axes, numel, dtype)
            rows = (
                region
                if region is not None
                else self.reduce_pool.take(self.group_size * numel, dtype, device).view(
                    self.group_size, numel
                )
            )
        packed = rows
        if at_once and self.group_size == 1 and self.all_reduce_axes and cpu:
            summed = collectives.input_rows(
                self.bound, self.all_reduce_axes, numel, dtype, all_reduce=True
            )
            packed = rows if summed is None else summed.view(1, -1)
        return Round(rows, packed, opened, region is not None, out)

    def reduce_across(self, part: Part, /, *, out: torch.Tensor | None) -> None:
        """Starts the second hop of ``part``'s partial gradient over the other axes.

        See [Note: two-hop reductions] in ``param_group.py``: the partial gradient
        ``(copy rows * numel,)`` is reduce-scattered (in the reduce dtype) over the
        axes its copy does not span; the result (into ``out`` where given) is this
        rank's gradient shard.
        """
        unit = self.members[0]  # two-hop units are groups of one
        sums = self.partial_sums.pop(part)
        nbytes = sums.numel() * sums.element_size()
        if sums.dtype != part.grad_dtype:
            sums = sums.to(part.grad_dtype)
        copy = unit.partial
        replicated = tuple(a for a in self.axes if a not in copy.regather_axes)
        stage = self._reduce_scatter(
            unit, sums.view(copy.rows, -1), replicated, out=out, ledger=self.ledger
        )
        self.memory.log("reduce", unit.name)
        layout = part.layout
        # its input is the partial gradient, not packed rows: it does not count against
        # the reductions that hold packed gradients (MAX_PENDING in param_group.py)
        self.reductions.append(
            Reduction(
                ((part, 0, layout.numel),),
                stage,
                (),
                unit.name,
                None,
                packed=False,
                partial_bytes=nbytes,  # freed once it is done
            )
        )

    def reduce_columns(
        self,
        unit: UnitRuntime,
        rows: torch.Tensor,
        out: torch.Tensor,
        /,
        *,
        first: bool,
        own: OwnRow | None = None,
    ) -> Pending:
        """Starts reducing one range of columns of a reduction in chunks into ``out``.

        See [Note: reductions in chunks] in ``param_group.py``; the trace logs the unit's
        reduction at its ``first`` range.
        """
        if first:
            self.memory.log("reduce", unit.name)
        return self._reduce_scatter(unit, rows, self.axes, out=out, own=own, ledger=self.ledger)

    @staticmethod
    def wait_columns(pending: Pending, /) -> torch.Tensor:
        """Waits for a range of columns started by :meth:`reduce_columns`: the host on gloo, else the compute stream."""
        out = pending.wait()
        # see [Note: streams and buffer lifetimes] in ``execute/streams.py``
        if pending.event is not None:
            _wait_on_device(pending)
        return out

    def _reduce_scatter(
        self,
        unit: UnitRuntime,
        rows: torch.Tensor,
        axes: tuple[str, ...],
        /,
        *,
        out: torch.Tensor | None,
        own: OwnRow | None = None,
        ledger: Ledger | None = None,
    ) -> Pending:
        """Starts a reduce-scatter of ``rows`` over ``axes``, quantized where the unit's gradients are.

        Issued on the reduce-scatter stream once it has waited for the compute stream
        that made ``rows``; see [Note: streams and buffer lifetimes] in ``execute/streams.py``.
        ``ledger`` counts it (quantized: always the group's, in the bytes it sends).
        """
        return _on_side(
            rows.device,
            "reduce_scatter",
            lambda: self._reduce_scatter_now(unit, rows, axes, out=out, own=own, ledger=ledger),
            (rows,),
        )

    def _reduce_scatter_now(
        self,
        unit: UnitRuntime,
        rows: torch.Tensor,
        axes: tuple[str, ...],
        /,
        *,
        out: torch.Tensor | None,
        own: OwnRow | None,
        ledger: Ledger | None,
    ) -> Pending:
        if unit.grad_format:  # [Note: quantized collectives] in plan/quantize.py
            return quantized.reduce_scatter(
                rows,
                self.bound,
                axes,
                block=unit.grad_block,
                format=unit.grad_format,
                out=out,
                ledger=self.ledger,
                tag=self.name,
            )
        return collectives.reduce_scatter(
            rows, self.bound, axes, out=out, ledger=ledger, tag=self.name, own=own
        )

    def open_rounds(self) -> list[tuple[int, int]]:
        """This group's rounds not yet reduced, as ``(opened, part)``."""
        return [(r.opened, j) for j, r in self.rounds.items()]

    def complete(self, j: int, /) -> bool:
        """Whether every member reported in this round of part ``j``."""
        round_ = self.rounds.get(j)
        return round_ is not None and len(round_.reported) == len(self.members)

    def flush(self, j: int, /, *, own: OwnRow | None = None, final: bool = False) -> Reduction:
        """Starts reducing this round of part ``j``; columns not reported are zero. The ledger counts each member.

        ``no_shard``: all-reduces the packed columns into the rows, which become the
        gradient. Otherwise reduce-scatters the rows (into the round's donated buffer
        where it has one), and then, for ``hybrid_shard``, :meth:`finish_oldest`
        all-reduces across replicas; a two-hop unit's go over its last axis alone
        ([Note: two-hop reductions] in ``param_group.py``), and ``final`` (its last
        reduction of the step) has its finish start the second hop. With ``own``, the
        rows (shared memory) lack this rank's row, which ``own`` adds when summed
        ([Note: the own row from the leaves] in ``shard/flat.py``).
        """
        round_ = self.rounds.pop(j)
        rows, packed = round_.rows, round_.packed
        pieces = []
        for i, member in enumerate(self.members):
            a, b = self.columns_of.span(i, j)
            if i in round_.reported:
                pieces.append((member, member.parts[j], a, b))
            else:
                packed[:, a:b].zero_()
        unit = pieces[0][0]
        replica = self.all_reduce_axes
        # the rows go back to the reduce pool once reduced, unless they become the
        # gradient (over one rank) or are the transport's (shared memory)
        staging = None if self.group_size == 1 or round_.in_region else rows
        then: tuple[str, ...] = ()
        if self.group_size == 1:  # no_shard: in place, overlapped
            stage = _on_side(
                rows.device,
                "all_reduce",
                lambda: collectives.all_reduce(
                    packed.view(-1),
                    self.bound,
                    replica,
                    tag=self.name,
                    out=None if packed is rows else rows.view(-1),
                ),
                (packed, rows),
            )
            op, axes = "all_reduce", replica
        elif unit.two_hop:  # over the last axis: [Note: two-hop reductions] in param_group.py
            copy = unit.partial
            axes = copy.regather_axes
            stage = self._reduce_scatter(unit, rows.view(copy.regather_size, -1), axes, out=None)
            op = "reduce_scatter"
        else:  # the all-reduce across replicas (hybrid_shard) waits for the reduce-scatter
            stage = self._reduce_scatter(unit, rows, self.axes, out=round_.out, own=own)
            op, axes, then = "reduce_scatter", self.axes, replica
        size = collectives.group_size(self.bound, axes)
        itemsize = rows.element_size()
        for member, _, a, b in pieces:
            # quantized gradients are counted by their collective, in the bytes it sends
            if self.ledger is not None and size > 1 and not unit.grad_format:
                full = self.group_size * (b - a) * itemsize
                self.ledger.record(op, axes, group_size=size, full_bytes=full)
            self.memory.log("reduce", member.name)
        reduction = Reduction(
            tuple((part, a, b) for _, part, a, b in pieces),
            stage,
            then,
            self.name,
            staging,
            # an all-reduce in place through shared memory holds a copy of its input
            packed=self.group_size > 1 or stage.holds_copy,
            first_hop=unit.two_hop,
            then_across=unit.two_hop and final,
        )
        if then:
            self._all_reduce_now(reduction)
        self.reductions.append(reduction)
        return reduction

    def _all_reduce_now(self, reduction: Reduction, /) -> None:
        """With streams: issues ``reduction``'s all-reduce across replicas now, after its reduce-scatter.

        As FSDP2's HSDP, the all-reduce stream waits on the reduce-scatter stream and
        the all-reduce is issued at once, not when the host waits for the reduce-scatter
        (:meth:`finish_oldest`, where the CPU and gloo issue it, in the same order, with the same
        results). Needs the reduce-scatter queued on its stream (:meth:`Streams.issued`).
        """
        rs = reduction.stage
        if rs.event is None:  # the CPU, or gloo: the host waits, then issues it
            return
        streams = _side(rs.result.device)
        assert streams is not None
        rs.event = None  # the all-reduce stream orders after it; the compute stream waits on the all-reduce
        streams.after(streams.all_reduce, streams.reduce_scatter)
        streams.keep_for(rs.result, streams.all_reduce)
        with streams.use(streams.all_reduce):
            stage = self._issue_all_reduce(reduction, rs.result)
        streams.issued(stage, streams.all_reduce)
        reduction.stage = stage
        reduction.then_all_reduce = ()

    def _issue_all_reduce(self, reduction: Reduction, out: torch.Tensor, /) -> Pending:
        """Starts ``reduction``'s all-reduce across replicas of ``out``; counts it in the ledger."""
        then = reduction.then_all_reduce
        pending = collectives.all_reduce(out, self.bound, then, tag=reduction.tag)
        size = collectives.group_size(self.bound, then)
        if self.ledger is not None and size > 1:
            for _, a, b in reduction.pieces:
                nbytes = (b - a) * out.element_size()
                self.ledger.record("all_reduce", then, group_size=size, full_bytes=nbytes)
        return pending

    def staged(self) -> int:
        """Reductions in flight that hold packed gradients beside their result."""
        return sum(r.packed for r in self.reductions)

    def finish_oldest(self, spare: Callable[[Part], torch.Tensor | None], /) -> Finished:
        """Waits for this group's oldest reduction; what it finished (:class:`Finished`); mutates.

        A first hop is summed into its part's partial gradient, and the unit's last
        one of the step starts the second hop into ``spare(part)`` ([Note: two-hop
        reductions] in ``param_group.py``).
        """
        reduction = self.reductions.pop(0)
        reduced = self._wait(reduction)
        freed = reduction.partial_bytes
        if not reduction.first_hop:
            return Finished(
                [
                    (part, reduced if (a, b) == (0, reduced.numel()) else reduced[a:b])
                    for part, a, b in reduction.pieces
                ],
                -freed,
            )
        ((part, _, _),) = reduction.pieces
        sums = self.partial_sums.get(part)
        added = 0
        if sums is None:
            dtype = part.layout.dtype
            sums = self.partial_sums[part] = (
                reduced if reduced.dtype == dtype else reduced.to(dtype)
            )
            added = sums.numel() * sums.element_size()
        else:
            sums.add_(reduced)
        if not reduction.then_across:
            return Finished([], added - freed)
        self.reduce_across(part, out=spare(part))
        return Finished([], added - freed, started=True)

    def _wait(self, reduction: Reduction, /) -> torch.Tensor:
        """Waits for ``reduction`` (and all-reduces across replicas if need be); the reduced ``(numel,)``.

        Gives the packed input back to the reduce pool once the first stage is done.
        """
        stage = reduction.stage
        out = stage.wait()
        # see [Note: streams and buffer lifetimes] in ``execute/streams.py``
        if stage.event is not None:
            _wait_on_device(stage)
        if reduction.staging is not None:
            self.reduce_pool.give(reduction.staging)
        if reduction.then_all_reduce:  # the CPU and gloo: issued once the reduce-scatter is in
            out = self._issue_all_reduce(reduction, out).wait()
        return out

    # -- gathering: what Run asks for ------------------------------------------------

    def prefetch(self, unit: UnitRuntime, /) -> None:
        """SHARDED -> GATHERING: issues the all-gathers of ``unit`` and every other member still SHARDED."""
        unit.expect(UnitState.SHARDED, "prefetch")
        if unit.collective:
            self._start()
        else:
            unit.mark_gathering()

    def acquire(self, unit: UnitRuntime, /) -> None:
        """-> GATHERED, held once more: waits for a prefetch, or gathers now."""
        if unit.state is UnitState.SHARDED:
            self.prefetch(unit)
        if unit.state is UnitState.GATHERING:
            self._finish(unit)
        unit.hold()

    def release(
        self, unit: UnitRuntime, /, *, keep: bool = False, keep_partial: bool = False
    ) -> None:
        """Drops one holder of ``unit``; the last one frees its storage (GATHERED -> SHARDED).

        With ``keep``, the unit stays GATHERED without holders, for the step's next
        micro-batch (see [Note: shard_optimizer] in ``plan/strategy.py``). Without
        ``keep_partial``, the last holder frees the partial copy too (see
        [Note: partial copies] in ``plan/strategy.py`` there).
        """
        if unit.unhold():
            if not keep:
                unit.free()
            if not keep_partial:
                unit.partial.free(unit.parts)

    def drop_unused(self, unit: UnitRuntime, /) -> None:
        """Frees ``unit`` if it was prefetched but no call holds it (GATHERING/GATHERED -> SHARDED)."""
        if unit.holders or unit.state is UnitState.SHARDED:
            return
        if unit.state is UnitState.GATHERING:
            self._finish(unit)
        unit.free()

    def release_all(self, *, keep: bool = False) -> None:
        """At the end of a micro-batch: drops every holder and frees every member (-> SHARDED).

        With ``keep`` (a micro-batch before the step's last), members that
        :attr:`~UnitRuntime.keeps_for_step` and are GATHERED stay so, and those that
        keep their partial copy for the step (``partial.for_step``).
        """
        for unit in self.members:
            unit.drop_holders()
            if not (keep and unit.keeps_for_step and unit.state is UnitState.GATHERED):
                self.drop_unused(unit)
            if not (keep and unit.partial.for_step):
                unit.partial.free(unit.parts)

    def discard(self) -> list[Pending]:
        """After an error: drops collectives in flight without waiting (returns them), frees storage, forgets the step's state."""
        dropped = [r.stage for r in self.reductions]
        dropped.extend(p for op in self._gathering if not op.waited for p in op.pendings)
        self.reductions.clear()
        self._gathering.clear()
        self.rounds.clear()
        self.partial_sums.clear()
        for unit in self.members:
            for part in unit.parts:
                inflight = self.inflight.pop(part, None)
                if inflight is None:
                    continue
                if inflight.in_place:
                    # the collectives write into the part's storage: forget it, free nothing
                    unit.forget(part)
                    continue
                self.memory.sub(inflight.result.numel() * inflight.result.element_size())
            unit.reset_after_error()
        return dropped

    # -- gathering: the collectives -----------------------------------------------------

    def _start(self) -> None:
        """SHARDED -> GATHERING for every member still SHARDED: one all-gather per part (or per leaf).

        The members' shards of a part go side by side into the all-gather's input
        (:meth:`_input`) and each member unpacks its own columns of the rows it fills
        (:meth:`_finish`); a group of one's part of one leaf, or a flat one, may be
        gathered straight into its storage (:attr:`Part.in_place`). A unit holding its
        partial copy all-gathers the copy over its regather axes instead of its shard
        over every shard axis: the same rows, fewer ranks (see [Note: partial copies]
        in ``plan/strategy.py``; a partial copy, an in-place part and quantized
        gathers are a group of one's: :func:`plan_groups`).
        """
        # who joins depends on unit states alone, the same on every rank: [Note: bucket order]
        joining = [i for i, m in enumerate(self.members) if m.state is UnitState.SHARDED]
        first = self.members[joining[0]]
        partial = first.partial.held
        axes = first.partial.regather_axes if partial else self.axes
        size = collectives.group_size(self.bound, axes)
        for j, part in enumerate(first.parts):
            if part.aliased:
                continue
            local, packed = self._input(j, partial)
            if part.in_place and not partial:
                full = first.materialize(part)
                # the refill is not an in-place change of tensors autograd saved: the
                # version is put back once the collective has written (after its wait)
                version = torch.autograd._unsafe_preserve_version_counter(full)
                pendings = self._gather_in_place(first, part, local, axes)
                op = GatherOp(pendings, (), set(joining))
                self._gathering.append(op)
                self.inflight[part] = Gathering(op, full, in_place=True, version=version)
                continue
            numel = self.columns_of.numels[j]
            # counted here, once per joining member ([Note: bucket order]), unless the
            # collective counts its own bytes (quantized)
            counted = self.ledger is not None and size > 1
            # (group_size * numel,); see [Note: staging lifetimes]
            out = self.pool.take(self.group_size * numel, local.dtype, local.device)
            if first.weight_format and not partial and local.dtype.is_floating_point:
                # blocks of a low-bit format: [Note: quantized collectives] in plan/quantize.py
                # (on the compute stream: its quantizing is compute), in the bytes it sends
                counted = False
                pending = quantized.all_gather(
                    local,
                    self.bound,
                    axes,
                    block=first.weight_block,
                    format=first.weight_format,
                    out=out,
                    ledger=self.ledger,
                    tag=self.name,
                )
            else:
                # a shard (or its cast) is stable until the evaluation settles; packed
                # staging goes back to the pool and a partial copy is freed by its unit
                # ([Note: shards read in place] in comm/shm/regions.py)
                pending = _on_side(
                    local.device,
                    "all_gather",
                    functools.partial(
                        collectives.all_gather,
                        local,
                        self.bound,
                        axes,
                        out=out,
                        tag=self.name,
                        stable=not (partial or packed),
                    ),
                    (local,),
                )
            op = GatherOp([pending], (out, local) if packed else (out,), set(joining))
            self._gathering.append(op)
            gathered = pending.result.view(self.group_size, numel)  # a partial copy's too
            for i in joining:
                a, b = self.columns_of.span(i, j)
                full = self.group_size * (b - a) * out.element_size()
                self.memory.add(full)
                if counted:
                    assert self.ledger is not None
                    self.ledger.record("all_gather", axes, group_size=size, full_bytes=full)
                self.inflight[self.members[i].parts[j]] = Gathering(op, gathered[:, a:b])
        for i in joining:
            self.members[i].mark_gathering(from_partial=partial)

    def _input(self, j: int, partial: bool, /) -> tuple[torch.Tensor, bool]:
        """Part ``j``'s all-gather input, and whether it was packed into staging (the pool's).

        The members' shards side by side in the compute dtype: a group of one's shard
        as it is (or its cast), several packed into one buffer (each member's, joining
        or not: the columns are fixed, :class:`Columns`); or a held partial copy.
        Casts and packs on the copy-in stream where there are streams
        ([Note: streams and buffer lifetimes] in ``execute/streams.py``).
        """
        first = self.members[0]
        part = first.parts[j]
        if partial:
            assert part.partial is not None
            return part.partial, False
        dtype, device = part.compute_dtype, first.device(part)
        side = _side(device)
        shards = [m.flats[j].data for m in self.members]
        if len(shards) == 1 and shards[0].dtype == dtype:
            return shards[0], False
        if side is not None:
            side.after_compute(side.copy_in)
        with _NULL if side is None else side.use(side.copy_in):
            if len(shards) == 1:
                return shards[0].to(dtype), False
            local = self.pool.take(self.columns_of.numels[j], dtype, device)
            for i, shard in enumerate(shards):
                a, b = self.columns_of.span(i, j)
                local[a:b].copy_(shard)  # casts to the compute dtype
        return local, True

    def _gather_in_place(
        self, unit: UnitRuntime, part: Part, local: torch.Tensor, axes: tuple[str, ...]
    ) -> list[Pending]:
        """The collectives writing ``part.full`` over ``axes``: one per leaf (``by_leaf``), else one.

        A flat part where the transport gathers leaf by leaf is gathered by a ring too, which
        writes its storage without the staging of gloo's own all-gather.
        """
        if not part.by_leaf:
            algorithm = ALL_GATHER.leaf_algorithm() if part.layout.flat and unit.leafwise else None
            pending = _on_side(
                local.device,
                "all_gather",
                lambda: collectives.all_gather(
                    local,
                    self.bound,
                    axes,
                    out=part.full,
                    ledger=self.ledger,
                    tag=unit.name,
                    algorithm=algorithm,
                    stable=True,  # the unit's shard, or its cast
                ),
                (local,),
            )
            return [pending]
        pieces = [
            (slot.offset, view.view(self.group_size, slot.numel))
            for slot, view in zip(part.layout.slots, part.views)
        ]
        pending = _on_side(
            local.device,
            "all_gather",
            lambda: collectives.all_gather_pieces(
                local, self.bound, self.axes, pieces, ledger=self.ledger, tag=unit.name, stable=True
            ),
            (local,),
        )
        return [pending]

    def _finish(self, unit: UnitRuntime) -> None:
        """GATHERING -> GATHERED: waits, then fills every full leaf; see [Note: persistent gathered storage] in ``execute/unit_state.py``."""
        unit.expect(UnitState.GATHERING, "finish gathering")
        for part in unit.parts:
            if part.aliased:
                continue
            inflight = self.inflight.pop(part)  # a failed wait is not waited for again
            try:
                gathered = inflight.wait()
            except BaseException:
                if inflight.in_place:  # the collectives may still write into its storage
                    unit.forget(part)
                raise
            member = self.index[unit.name]
            for pending in inflight.op.pendings:  # the compute stream waits on its event
                if pending.event is not None:
                    _wait_on_device(pending)
            if unit.partial.lifetime is not None and not unit.partial.in_flight:
                # the rows are the part's storage when gathered in place (flat, or one leaf)
                rows = part.full if part.in_place else gathered
                assert rows is not None
                unit.partial.keep(part, rows.view(self.group_size, -1))
            if inflight.in_place:  # the collective filled part.full
                assert inflight.version is not None
                inflight.version.__exit__(None, None, None)
                self._unpacked(inflight.op, member)
                continue
            full = unit.materialize(part)
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(full):
                if not unit.partial.in_flight:
                    assert part.unpack is not None  # made with the views (materialize)
                    part.unpack(gathered)
                else:  # [Note: a partial copy on the executor] in ``execute/unit_state.py``
                    _unpack_regathered(unit, part, full, gathered)
            self.memory.sub(gathered.numel() * gathered.element_size())
            self._unpacked(inflight.op, member)
        unit.mark_gathered()

    def _unpacked(self, op: GatherOp, member: int, /) -> None:
        """Member ``member`` is done with its columns of ``op``: the last one gives its staging back."""
        op.open.discard(member)
        if not op.open and op in self._gathering:
            self._gathering.remove(op)
            if op.waited:
                for t in op.staging:
                    self.pool.give(t)


_NULL = contextlib.nullcontext()


def _side(device: torch.device, /) -> Streams | None:
    """``device``'s side streams; ``None`` on the CPU, where nothing else is done."""
    if device.type == "cpu":
        return None
    streams = streams_for(device)
    return streams if streams.active else None


def _on_side(
    device: torch.device,
    which: str,
    issue: Callable[[], Pending],
    inputs: tuple[torch.Tensor, ...],
    /,
) -> Pending:
    """Calls ``issue`` (a collective reading ``inputs``) on ``device``'s side stream ``which``, after the compute stream.

    Records the event its consumer waits on (:func:`_wait_on_device`) and marks
    ``inputs`` in use on that stream. An all-gather's stream waits for the copy-in
    stream too. On the CPU: ``issue()``. See [Note: streams and buffer lifetimes]
    in ``execute/streams.py``.
    """
    side = _side(device)
    if side is None:
        return issue()
    stream = getattr(side, which)
    if which == "all_gather":
        side.after(stream, side.copy_in)
    side.after_compute(stream)
    with side.use(stream):
        pending = issue()
    for tensor in inputs:
        side.keep_for(tensor, stream)
    side.issued(pending, stream)
    return pending


def _wait_on_device(pending: Pending, /) -> None:
    """The current (compute) stream waits on ``pending``'s event."""
    side = _side(pending.result.device)
    assert side is not None, "an event without streams"
    side.wait_for(pending)


def _unpack_regathered(
    unit: UnitRuntime, part: Part, full: torch.Tensor, gathered: torch.Tensor
) -> None:
    """Fills ``part``'s full leaves from an all-gather of partial copies; mutates ``full``.

    The rows come row-major over ``unit.partial.order`` (the last mesh axis
    major). A flat part, or one gathered in place elsewhere, is its rows in mesh
    order: one transposing copy; any other part is unpacked in the regather order.
    """
    copy = unit.partial
    if part.in_place or part.layout.flat:
        n = part.layout.numel
        full.view(copy.rows, copy.regather_size, n).copy_(
            gathered.view(copy.regather_size, copy.rows, n).transpose(0, 1)
        )
    else:
        rows = gathered.view(unit.group_size, -1)
        unpack_into(part.layout, rows, part.views, copy.order)


# -- buckets: which consecutive units form one group -------------------------------------

# Gathered bytes below which a collective is latency-bound, per backend: on gloo at W=2
# here a reduce-scatter of 256 KiB took 2.7 ms and one of 16 MiB 19 ms
# (bench/reduce_scatter.py), so latency x bandwidth is about 2 MB; a bucket of twice that
# keeps the latency to about a third of its time. NCCL is not bucketed by default: the
# CUDA path is untested here; pass bucket_bytes to bucket there.
DEFAULT_BUCKET_BYTES = {"gloo": 4 << 20}


def default_bucket_bytes(backend: str | None, /) -> int:
    """The default ``bucket_bytes`` on ``backend`` (``None``: not distributed, no buckets).

    Example:
        >>> default_bucket_bytes("gloo"), default_bucket_bytes("nccl"), default_bucket_bytes(None)
        (4194304, 0, 0)
    """
    return 0 if backend is None else DEFAULT_BUCKET_BYTES.get(backend, 0)


def plan_groups(units: Sequence[UnitRuntime], bucket_bytes: int, /) -> list[list[UnitRuntime]]:
    """Which units form each parameter group, in ``units``' order: buckets of consecutive units up to ``bucket_bytes``.

    Decided once, with the units; each step makes its groups from it
    (:func:`make_groups`, [Note: a group lives for one step]). Units join when they
    have the same strategy, collective axes and parts (dtype, compute and gradient
    dtype, frozen, aliased), no part of one leaf gathered in place, no partial copy
    and not the root unit, and their full leaves together stay within
    ``bucket_bytes`` (``0``: no buckets). Every other unit is a group of one.
    Mutates a bucket's members: they gather their leaves packed
    (:meth:`UnitRuntime.pack_gathers`).
    """
    groups: list[list[UnitRuntime]] = []
    run: list[UnitRuntime] = []
    size = 0

    def close() -> None:
        if run:
            groups.append(list(run))
            if len(run) > 1:
                for member in run:  # a bucket gathers its members through one buffer
                    member.pack_gathers()
        run.clear()

    for unit in units:
        nbytes = unit.full_numel_bytes
        if not _eligible(unit) or nbytes > bucket_bytes:
            close()
            size = 0
            groups.append([unit])
            continue
        if run and (_signature(run[0]) != _signature(unit) or size + nbytes > bucket_bytes):
            close()
            size = 0
        run.append(unit)
        size += nbytes
    close()
    return groups


def make_groups(
    members: Sequence[Sequence[UnitRuntime]],
    gather_pool: BufferPool,
    reduce_pool: BufferPool,
    /,
) -> list[ParamGroup]:
    """One step's parameter groups of :func:`plan_groups`' ``members``, with the pools they stage through.

    The root unit's staging is as large as the embeddings and used once a step:
    pools that keep nothing, so it is not held from its gather to its reduction.

    Example:
        >>> make_groups([], BufferPool(), BufferPool())
        []
    """
    return [
        ParamGroup(m, BufferPool(depth=0), BufferPool(depth=0))
        if m[0].is_root
        else ParamGroup(m, gather_pool, reduce_pool)
        for m in members
    ]


def _eligible(unit: UnitRuntime) -> bool:
    if (
        unit.is_root
        or any(p.in_place and not p.by_leaf for p in unit.parts)
        or not unit.parts
        or unit.partial.lifetime is not None  # its partial copy is per unit
        or unit.weight_block  # quantized collectives are per unit
        or unit.grad_block
    ):
        return False
    if unit.group_size > 1:
        return True
    return unit.replica_size > 1 and all(p.aliased for p in unit.parts)  # no_shard: reductions


def _signature(unit: UnitRuntime) -> tuple[object, ...]:
    return (
        unit.unit.strategy,
        unit.axes,
        unit.replica_axes,
        tuple(
            (p.layout.dtype, p.compute_dtype, p.grad_dtype, p.layout.frozen, p.aliased)
            for p in unit.parts
        ),
    )


# reductions in flight that hold packed gradients (a staging buffer) when the next unit's
# gradients are packed: the older ones are waited for first. One reducing while the next
# unit's backward computes is all the overlap there is (a group runs its collectives one
# after the other). An all-reduce in place on sockets (no_shard) holds nothing but the
# gradient it becomes, so those queue without a wait, as DDP's buckets do; one through
# shared memory holds a copy of its input until done (comm/shm/__init__.py) and counts.
MAX_PENDING = 1


class Reducer:
    """The gradients of one call of a step, and the order its groups' reductions started in; per-step state.

    The groups issue, hold and wait for their reductions
    ([Note: a group lives for one step]); the Reducer packs a call's gradients
    through its group and has the group whose reduction started first finish it
    first, so that at most ``MAX_PENDING`` hold packed gradients at once.
    """

    def __init__(
        self,
        *,
        world_size: int,
        spares: dict[PartKey, torch.Tensor],
        hold_leaves: bool = False,
        chunk_bytes: int = 0,
    ) -> None:
        self.world_size = world_size
        self.chunk_bytes = chunk_bytes  # see [Note: reductions in chunks]
        # the staging the gradients are packed into is the groups' (ParamGroup.columns)
        # the result, what is kept across micro-batches, donated buffers: gradients.py
        self.gradients = Gradients(spares=spares, hold_leaves=hold_leaves)
        self.deferring: dict[str, tuple[ParamGroup, UnitRuntime]] = {}  # units that deferred
        # the group of each reduction in flight, in the order they started: the oldest is
        # waited for first (each group holds its own, oldest first)
        self.order: list[ParamGroup] = []
        # groups this call packed gradients into: they hold the rounds
        self.rounding: dict[ParamGroup, None] = {}
        self.rounds_opened = 0  # rounds opened so far: their order
        # groups holding two-hop partial gradients, in the order the first began:
        # [Note: two-hop reductions] in ``execute/param_group.py``
        self.two_hop: dict[ParamGroup, None] = {}
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
        gradient takes its second hop ([Note: two-hop reductions] in ``param_group.py``).
        """
        if defer:
            self.deferring[unit.name] = (group, unit)
        for j, (part, mine) in enumerate(zip(unit.parts, unit.split(grads))):
            if part.layout.dtype.is_floating_point and not part.layout.frozen:
                while self._staged() >= MAX_PENDING:  # before packing: bounded memory
                    self._finish_oldest()
                self._reduce_part(group, unit, j, mine, defer=defer, final=final)

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
            if any(self.gradients.keeps(p) for p in unit.parts):
                self.reduce(group, unit, [None] * len(unit.slots), defer=False, final=True)
        self.deferring.clear()

    def finish(self, *, last: bool = True) -> None:
        """Reduces the buckets' open rounds, waits for every reduction and adds it into :attr:`grads`; mutates.

        After the step's last micro-batch (``last``) the partial gradients take
        their second hop ([Note: two-hop reductions] in ``execute/param_group.py``).
        """
        while rounds := self._open_rounds():
            group, j = rounds[0]
            while self._staged() >= MAX_PENDING:
                self._finish_oldest()
            self._flush(group, j)
        while self.order:
            self._finish_oldest()
        if not last:
            return
        # units whose last reduction came in an earlier micro-batch, in the order started
        for group in self.two_hop:
            for part in list(group.partial_sums):
                group.reduce_across(part, out=self._spare(part))
                self.order.append(group)
        while self.order:
            self._finish_oldest()

    def abandon(self) -> None:
        """After an error: forgets what it holds; the groups drop their reductions (:meth:`ParamGroup.discard`)."""
        self.order.clear()
        self.gradients.clear()
        self.deferring.clear()
        self.two_hop.clear()
        self.rounding.clear()

    def _flush(
        self, group: ParamGroup, j: int, /, *, own: OwnRow | None = None, final: bool = False
    ) -> None:
        """Has ``group`` start reducing its open round of part ``j``."""
        if group.flush(j, own=own, final=final).first_hop:
            self.two_hop[group] = None
        self.order.append(group)

    def _spare(self, part: Part, /) -> torch.Tensor | None:
        """Where ``part``'s reduced gradient goes: a donated buffer, else ``None`` (fresh memory)."""
        return self.gradients.spare(part, part.grad_dtype)

    def _open_rounds(self) -> list[tuple[ParamGroup, int]]:
        """The groups' rounds not yet reduced, in the order they opened: (group, part)."""
        rounds = [(opened, g, j) for g in self.rounding for opened, j in g.open_rounds()]
        return [(g, j) for _, g, j in sorted(rounds, key=lambda r: r[0])]

    def _reduce_part(
        self,
        group: ParamGroup,
        unit: UnitRuntime,
        j: int,
        mine: Sequence[torch.Tensor | None],
        /,
        *,
        defer: bool,
        final: bool,
    ) -> None:
        """Packs ``unit``'s gradients of part ``j`` into its group's round (or keeps them, deferred); a complete round is reduced."""
        part = unit.parts[j]
        layout = part.layout
        device = unit.device(part)
        if (
            self.gradients.hold_leaves
            and unit.group_size == 1
            and unit.replica_size == 1
            and part.grad_dtype == layout.dtype
            and self.gradients.keep_as_leaves(part, mine, device)
        ):
            return
        kept = self.gradients.take_kept(part)  # packed by earlier micro-batches' calls
        dtype = part.grad_dtype
        # a two-hop unit's rows come last axis major ([Note: two-hop reductions] in ``execute/param_group.py``)
        order = unit.partial.order if unit.two_hop else unit.axes
        if defer:  # packed whole and kept, to add to the next call's
            rows = group.reduce_pool.take(unit.group_size * layout.numel, dtype, device)
            rows = rows.view(unit.group_size, layout.numel)
            pack_rows(unit, layout, mine, rows, order, scale=1.0, shared=False)
            if kept is not None:
                rows.add_(kept)
                group.reduce_pool.give(kept)
            self.gradients.keep(part, rows)
            return
        # a donated buffer fits a round of this part alone; a two-hop unit's receives its
        # second hop ([Note: two-hop reductions] in ``execute/param_group.py``)
        alone = group.columns_of.numels[j] == layout.numel
        spare = self._spare(part) if alone and not unit.two_hop else None
        if not alone:
            self.gradients.drop_spare(part)  # the result is the round's: no donated one fits
        ranges = chunk_ranges(unit, part, self.chunk_bytes)
        if ranges:  # [Note: reductions in chunks]
            while self.order:  # the ranges reuse the regions these hold
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
                ranges=ranges,
                world_size=self.world_size,
            )
            if kept is not None:
                group.reduce_pool.give(kept)
            self.gradients.add(part, reduced)
            return
        self.rounding[group] = None
        columns, in_region, flushed = group.columns(unit, j, opened=self.rounds_opened, into=spare)
        self.rounds_opened += 1
        if flushed is not None:  # a unit reported twice in this round: that round is reducing
            self.order.append(group)
        # the mean over every data-parallel rank: divide while packing, unless gradients
        # kept from earlier micro-batches are still to be added
        scale = 1.0 / self.world_size if kept is None else 1.0
        own_row = kept is None and in_region and alone
        # the packing casts ([Note: cast while packing] in ``shard/flat.py``), but the own
        # row sums from leaves in the reduce dtype
        leaves = _cast(mine, dtype) if own_row else mine
        own = pack_rows(unit, layout, leaves, columns, order, scale=scale, shared=own_row)
        if kept is not None:
            columns.add_(kept)
            group.reduce_pool.give(kept)
            columns.div_(self.world_size)
        if group.complete(j):
            self._flush(group, j, own=own, final=final)

    def _staged(self) -> int:
        """Reductions in flight that hold packed gradients beside their result."""
        return sum(g.staged() for g in dict.fromkeys(self.order))

    def _finish_oldest(self) -> None:
        """Waits for the oldest reduction of any group; its result goes into the gradients (``gradients.py``)."""
        group = self.order.pop(0)
        finished = group.finish_oldest(self._spare)
        self.partial_bytes += finished.partial_bytes
        self.partial_peak = max(self.partial_peak, self.partial_bytes)
        if (
            finished.started
        ):  # a second hop: [Note: two-hop reductions] in ``execute/param_group.py``
            self.order.append(group)
        for part, reduced in finished.results:
            self.gradients.add(part, reduced)


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
        and layout_row_order(layout, unit.axes) is None
        and exact_scale(scale)
    ):
        me = collectives.group_rank(unit.bound, unit.axes)
        pack_flat_columns(layout, leaves, rows, start, scale, skip=me)
        return OwnRow(layout, leaves, me * layout.numel + start, width, scale)
    if not start and width == layout.numel:
        pack_into(layout, leaves, rows, order, scale=scale)
    elif layout.flat:
        pack_flat_columns(layout, leaves, rows, start, scale)
    else:  # one of leaf_column_ranges: [Note: reductions in chunks] in execute/param_group.py
        pack_leaf_columns(layout, leaves, rows, start, order, scale=scale)
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


def chunk_ranges(unit: UnitRuntime, part: Part, chunk_bytes: int, /) -> Sequence[tuple[int, int]]:
    """The ranges ``[start, stop)`` of columns ``part``'s reduction goes in, one at a time; none where it goes whole.

    Asked of a reduction, never of deferred gradients (packed whole and kept). A flat
    part's ranges are ``chunk_bytes`` of packed gradients each; a root unit's part of
    the leaf layout has its :func:`~funcshard._src.shard.flat.leaf_column_ranges`
    (whole slots, or whole rows of one slot's chunk), where it has them. See
    [Note: reductions in chunks] in ``execute/param_group.py``.
    """
    layout = part.layout
    if (
        unit.group_size == 1
        or unit.all_reduce_axes
        or unit.grad_format
        or unit.two_hop
        or unit.device(part).type != "cpu"
        or _input_bytes(unit, part) <= LARGE_BYTES
    ):
        return ()
    columns = chunk_bytes // (unit.group_size * part.grad_dtype.itemsize)
    n = layout.numel
    if not 0 < columns < n:
        return ()
    if layout.flat:
        return [(a, min(a + columns, n)) for a in range(0, n, columns)]
    if not unit.is_root:  # a block's reduction overlaps the backward before it: kept whole
        return ()
    ranges = leaf_column_ranges(layout, unit.axes, columns)
    return ranges if ranges is not None and len(ranges) > 1 else ()


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
    ranges: Sequence[tuple[int, int]],
    world_size: int,
) -> torch.Tensor:
    """Reduces ``part``'s gradients a range of ``ranges`` (:func:`chunk_ranges`) at a time; returns this rank's ``(numel,)`` of the mean.

    ``leaves`` are this call's full gradients (in the reduce dtype); ``kept``, the
    packed gradients earlier micro-batches deferred. Writes into ``out`` where
    given. See [Note: reductions in chunks].
    """
    layout, dtype = part.layout, part.grad_dtype
    n, g = layout.numel, unit.group_size
    device = unit.device(part)
    result = out if out is not None else torch.empty(n, dtype=dtype, device=device)
    for start, stop in ranges:
        width = stop - start
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
