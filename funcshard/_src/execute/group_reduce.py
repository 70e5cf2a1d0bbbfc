"""The reducing half of a gather group, and what its two halves share.

:class:`ReducingGroup` holds a group's members, mesh, ledger, memory count and
pools, and starts and waits for every reduction of its members' gradients; the
``Reducer`` (``reduce.py``) packs the gradients and keeps the reductions in order.
:class:`~funcshard._src.execute.gather_group.GatherGroup` adds the gathering
half. Together they are the one owner of the executor's collectives: see
[Note: one owner per collective] in ``gather_group.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from funcshard._src.comm import collectives, quantized
from funcshard._src.comm.pending import Pending
from funcshard._src.execute.buffers import BufferPool
from funcshard._src.execute.packed import Columns, Round
from funcshard._src.execute.part import Part
from funcshard._src.execute.reduction import Reduction
from funcshard._src.execute.unit_state import UnitRuntime
from funcshard._src.shard.own_row import OwnRow


class ReducingGroup:
    """A gather group's members and shared fields, and the reductions of their gradients."""

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
        # several members share each collective: their columns side by side
        self.shared = len(self.members) > 1
        if self.shared:
            for member in self.members:  # a bucket gathers its members through one buffer
                member.pack_gathers()
        self.columns_of = Columns(self.members)
        self.rounds: dict[int, Round] = {}  # a bucket's open reduction rounds, by part

    @property
    def name(self) -> str:
        """The unit's name, or ``first..last`` for a bucket: for errors and traces."""
        if not self.shared:
            return self.members[0].name
        return f"{self.members[0].name}..{self.members[-1].name}"

    def reduce(
        self,
        unit: UnitRuntime,
        part: Part,
        rows: torch.Tensor,
        packed: torch.Tensor,
        /,
        *,
        out: torch.Tensor | None,
        keep_rows: bool,
        own: OwnRow | None = None,
    ) -> Reduction:
        """Starts reducing one part of a group of one, packed in ``packed`` (``rows``, or shared memory).

        ``no_shard``: all-reduces ``packed`` into ``rows``, which become the gradient.
        Otherwise reduce-scatters ``rows`` (into ``out`` where given), and then, for
        ``hybrid_shard``, :meth:`wait` all-reduces across replicas. With ``keep_rows``
        the rows go back to the reduce pool once reduced. With ``own``, ``rows``
        (shared memory) lack this rank's row, which ``own`` adds when summed
        ([Note: the own row from the leaves] in ``shard/own_row.py``).
        """
        layout = part.layout
        replica = self.all_reduce_axes
        if self.group_size == 1 and replica:  # no_shard: in place, overlapped
            stage = collectives.all_reduce(
                packed.view(-1),
                self.bound,
                replica,
                ledger=self.ledger,
                tag=unit.name,
                out=None if packed is rows else rows.view(-1),
            )
            then: tuple[str, ...] = ()
            staging = None  # reduced in place: it becomes the gradient
        elif unit.two_hop:  # over the last axis: [Note: two-hop reductions] in partial_gradient.py
            copy = unit.partial
            stage = self._reduce_scatter(
                unit, rows.view(copy.regather_size, -1), copy.regather_axes, out=None
            )
            then = ()
            staging = rows if keep_rows else None
        else:  # the all-reduce across replicas (hybrid_shard) waits for the reduce-scatter
            stage = self._reduce_scatter(unit, rows, self.axes, out=out, own=own)
            then = replica
            staging = rows if keep_rows else None
        self.memory.log("reduce", unit.name)
        return Reduction(
            ((layout, 0, layout.numel),),
            stage,
            then,
            unit.name,
            staging,
            # an all-reduce in place through shared memory holds a copy of its input
            packed=self.group_size > 1 or stage.holds_copy,
            first_hop=unit.two_hop,
        )

    def reduce_across(
        self, unit: UnitRuntime, part: Part, sums: torch.Tensor, /, *, out: torch.Tensor | None
    ) -> Reduction:
        """Starts the second hop of a two-hop reduction: ``sums`` ``(copy rows * numel,)`` over the other axes.

        See [Note: two-hop reductions] in ``partial_gradient.py``; the result (into ``out``
        where given) is this rank's gradient shard.
        """
        copy = unit.partial
        replicated = tuple(a for a in self.axes if a not in copy.regather_axes)
        stage = self._reduce_scatter(unit, sums.view(copy.rows, -1), replicated, out=out)
        self.memory.log("reduce", unit.name)
        layout = part.layout
        # its input is the partial gradient, not packed rows: it does not count against
        # the reductions that hold packed gradients (MAX_PENDING in reduce.py)
        return Reduction(((layout, 0, layout.numel),), stage, (), unit.name, None, packed=False)

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

        See [Note: reductions in chunks] in ``chunks.py``; the trace logs the unit's
        reduction at its ``first`` range.
        """
        if first:
            self.memory.log("reduce", unit.name)
        return self._reduce_scatter(unit, rows, self.axes, out=out, own=own)

    def _reduce_scatter(
        self,
        unit: UnitRuntime,
        rows: torch.Tensor,
        axes: tuple[str, ...],
        /,
        *,
        out: torch.Tensor | None,
        own: OwnRow | None = None,
    ) -> Pending:
        """Starts a reduce-scatter of ``rows`` over ``axes``, quantized where the unit's gradients are."""
        if unit.grad_format:  # [Note: quantized collectives] in plan/quantize.py
            return quantized.reduce_scatter(
                rows,
                self.bound,
                axes,
                block=unit.grad_block,
                format=unit.grad_format,
                out=out,
                ledger=self.ledger,
                tag=unit.name,
            )
        return collectives.reduce_scatter(
            rows, self.bound, axes, out=out, ledger=self.ledger, tag=unit.name, own=own
        )

    def columns(
        self, unit: UnitRuntime, j: int, grad_dtype: torch.dtype, /
    ) -> tuple[torch.Tensor, Reduction | None]:
        """A bucket: ``unit``'s columns of this round's rows of part ``j``, for its gradients.

        A member that already reported in this round flushes it first: that
        reduction is returned beside the columns of the next round.
        """
        member = self.index[unit.name]
        flushed = None
        round_ = self.rounds.get(j)
        if round_ is not None and member in round_.reported:
            flushed = self.flush(j)
            round_ = None
        if round_ is None:
            numel = self.columns_of.numels[j]
            device = unit.device(unit.parts[j])
            rows = self.reduce_pool.take(self.group_size * numel, grad_dtype, device)
            round_ = self.rounds[j] = Round(rows.view(self.group_size, numel))
        round_.reported.add(member)
        a, b = self.columns_of.span(member, j)
        return round_.rows[:, a:b], flushed

    def complete(self, j: int, /) -> bool:
        """Whether every member reported in this round of part ``j``."""
        round_ = self.rounds.get(j)
        return round_ is not None and len(round_.reported) == len(self.members)

    def flush(self, j: int, /) -> Reduction:
        """Starts reducing this round of part ``j``; columns not reported are zero. The ledger counts each member."""
        round_ = self.rounds.pop(j)
        rows = round_.rows
        pieces = []
        for i, member in enumerate(self.members):
            a, b = self.columns_of.span(i, j)
            if i in round_.reported:
                pieces.append((member, member.parts[j].layout, a, b))
            else:
                rows[:, a:b].zero_()
        replica = self.all_reduce_axes
        if self.group_size == 1:  # no_shard: all-reduced in place, the rows become the gradients
            stage = collectives.all_reduce(rows.view(-1), self.bound, replica, tag=self.name)
            op, axes, size, then, staging = "all_reduce", replica, self.replica_size, (), None
        else:
            stage = collectives.reduce_scatter(rows, self.bound, self.axes, tag=self.name)
            op, axes, size, then, staging = (
                "reduce_scatter",
                self.axes,
                self.group_size,
                replica,
                rows,
            )
        itemsize = rows.element_size()
        for member, _, a, b in pieces:
            if self.ledger is not None:
                full = rows.shape[0] * (b - a) * itemsize
                self.ledger.record(op, axes, group_size=size, full_bytes=full)
            self.memory.log("reduce", member.name)
        return Reduction(
            tuple((layout, a, b) for _, layout, a, b in pieces),
            stage,
            then,
            self.name,
            staging,
            per_piece=True,
            packed=self.group_size > 1,
        )

    def wait(self, reduction: Reduction, pool: BufferPool, /) -> torch.Tensor:
        """Waits for ``reduction`` (and all-reduces across replicas if need be); the reduced ``(numel,)``.

        Gives the packed input back to ``pool`` once the first stage is done.
        """
        out = reduction.stage.wait()
        if reduction.staging is not None:
            pool.give(reduction.staging)
        then = reduction.then_all_reduce
        if then:
            per_piece = reduction.per_piece
            ledger = None if per_piece else self.ledger
            out = collectives.all_reduce(out, self.bound, then, ledger=ledger, tag=reduction.tag)
            out = out.wait()
            if per_piece and self.ledger is not None:
                size = collectives.group_size(self.bound, then)
                for _, a, b in reduction.pieces:
                    nbytes = (b - a) * out.element_size()
                    self.ledger.record("all_reduce", then, group_size=size, full_bytes=nbytes)
        return out
