"""Gradient reduction: from one call's full gradients to the sharded mean over every rank.

A :class:`Reducer` lives for one call of a step (all its micro-batches): it
packs each unit's full gradients into a ``(group_size, numel)`` buffer, divided
by the world size while packing, and starts their reduce-scatter (then an
all-reduce across replicas for ``hybrid_shard``; an all-reduce alone for
``no_shard``); with ``defer`` it keeps the packed gradients locally instead,
to add them to a later micro-batch's (gradient accumulation without
communication, like FSDP's ``no_sync``). The reduced gradients are keyed by
the :class:`FlatLayout` of the flat buffer they belong to. Buffers donated by
the last call (see [Note: donation] in ``shard/sharded.py``) receive this
call's results instead of fresh memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from funcshard._src.comm import collectives
from funcshard._src.comm.collectives import Pending
from funcshard._src.comm.groups import BoundMesh
from funcshard._src.comm.ledger import Ledger
from funcshard._src.execute.buffers import BufferPool
from funcshard._src.execute.unit_state import Part, UnitRuntime
from funcshard._src.shard.flat import FlatLayout, pack_into

# reductions in flight when the next unit's gradients are packed: the older ones are
# waited for first. One reducing while the next unit's backward computes is all the
# overlap there is (a group runs its collectives one after the other), and each
# reduction in flight holds a unit's packed gradients.
MAX_PENDING = 1


@dataclass(eq=False)
class Reduction:
    """One part's reduction in flight; :meth:`finish` waits for it and returns the sharded gradient."""

    layout: FlatLayout
    stage: Pending
    then_all_reduce: tuple[str, ...]
    bound: BoundMesh
    ledger: Ledger | None
    tag: str
    staging: torch.Tensor | None  # the packed input, for the pool once the stage is done

    def finish(self, pool: BufferPool) -> torch.Tensor:
        """Waits (and all-reduces across replicas if need be); the reduced gradient, ``(numel,)``.

        Gives the packed input back to ``pool`` once the first stage is done.
        """
        out = self.stage.wait()
        if self.staging is not None:
            pool.give(self.staging)
        if self.then_all_reduce:
            out = collectives.all_reduce(
                out, self.bound, self.then_all_reduce, ledger=self.ledger, tag=self.tag
            ).wait()
        return out


class Reducer:
    """The gradients of one call of a step; per-step state, never kept across calls."""

    def __init__(
        self,
        *,
        world_size: int,
        spares: dict[FlatLayout, torch.Tensor],
        pool: BufferPool | None = None,
    ) -> None:
        self.world_size = world_size
        self.pool = BufferPool() if pool is None else pool  # see [Note: staging lifetimes]
        self.spares = spares  # donated buffers of the last call, by layout
        self.grads: dict[FlatLayout, torch.Tensor] = {}  # the result, in the stored dtype
        self.deferred: dict[FlatLayout, torch.Tensor] = {}  # packed, (group_size, numel)
        self.pending: list[Reduction] = []

    def reduce(
        self, unit: UnitRuntime, grads: Sequence[torch.Tensor | None], /, *, defer: bool
    ) -> None:
        """Starts reducing one call's full gradients of ``unit`` (in its leaf order); mutates.

        With ``defer``, packs and keeps them (added to what earlier deferred calls
        kept) to be reduced by a later call without ``defer``.
        """
        for part, mine in zip(unit.parts, unit.split(grads)):
            if part.layout.dtype.is_floating_point and not part.layout.frozen:
                while len(self.pending) >= MAX_PENDING:  # before packing: bounded memory
                    self._finish_oldest()
                self._reduce_part(unit, part, mine, defer=defer)

    def finish(self) -> None:
        """Waits for every reduction in flight and adds it into :attr:`grads`; mutates."""
        while self.pending:
            self._finish_oldest()

    def abandon(self) -> list[Pending]:
        """After an error: forgets every reduction, returning those in flight (for the caller to drain)."""
        inflight = [r.stage for r in self.pending]
        self.pending.clear()
        self.deferred.clear()
        return inflight

    def _reduce_part(
        self, unit: UnitRuntime, part: Part, mine: Sequence[torch.Tensor | None], *, defer: bool
    ) -> None:
        layout = part.layout
        device = unit.flats[unit.parts.index(part)].data.device
        spare = None if defer else self.spares.pop(layout, None)
        if spare is not None and spare.dtype != part.grad_dtype:
            spare = None
        if spare is not None and unit.group_size == 1:
            rows = spare.view(1, -1)  # no_shard: reduced in place, this becomes the gradient
            spare = None
        else:
            rows = self.pool.take(unit.group_size * layout.numel, part.grad_dtype, device)
            rows = rows.view(unit.group_size, layout.numel)
        kept = self.deferred.pop(layout, None)
        # the mean over every data-parallel rank: divide while packing, unless gradients
        # kept from earlier micro-batches are still to be added
        direct = kept is None and not defer
        dtype = part.grad_dtype
        leaves = [g if g is None or g.dtype == dtype else g.to(dtype) for g in mine]
        pack_into(layout, leaves, rows, unit.axes, scale=1.0 / self.world_size if direct else 1.0)
        if kept is not None:
            rows.add_(kept)
            self.pool.give(kept)
        if defer:
            self.deferred[layout] = rows
            return
        if not direct:
            rows.div_(self.world_size)
        replica = unit.replica_axes if unit.replica_size > 1 else ()
        if unit.group_size == 1 and replica:  # no_shard: start the all-reduce now, overlapped
            stage = collectives.all_reduce(
                rows.view(-1), unit.bound, replica, ledger=unit.ledger, tag=unit.name
            )
            then: tuple[str, ...] = ()
            staging = None  # reduced in place: it becomes the gradient
        else:  # the all-reduce across replicas (hybrid_shard) waits for the reduce-scatter
            stage = collectives.reduce_scatter(
                rows, unit.bound, unit.axes, out=spare, ledger=unit.ledger, tag=unit.name
            )
            then = replica
            staging = rows if unit.group_size > 1 else None  # over one rank, rows is the result
        unit.memory.log("reduce", unit.name)
        self.pending.append(
            Reduction(layout, stage, then, unit.bound, unit.ledger, unit.name, staging)
        )

    def _finish_oldest(self) -> None:
        """The first reduction of a layout becomes its gradient buffer as it is: no zero-filled
        buffer and no extra pass (cast to the stored dtype if need be)."""
        reduction = self.pending.pop(0)
        out = reduction.finish(self.pool)
        layout = reduction.layout
        out = out if out.dtype == layout.dtype else out.to(layout.dtype)
        if layout in self.grads:
            self.grads[layout].add_(out)
        else:
            self.grads[layout] = out
