"""Gather groups: the one owner of the collectives that gather parameters and reduce gradients.

A :class:`GatherGroup` is one or more units whose parameters are all-gathered
together and whose gradients are reduced together. A unit alone is a group of
one; consecutive small units form a bucket (``bucket.py``), a group whose members
share their collectives (``packed.py`` lays them side by side).

[Note: one owner per collective]
Every all-gather, reduce-scatter and all-reduce of a step is issued, waited for
and counted (the ledger, the gathered memory, the staging pools) by the group of
the units it moves, here and nowhere else. ``Run`` asks a group for one of its
units (:meth:`GatherGroup.prefetch`, :meth:`~GatherGroup.acquire`,
:meth:`~GatherGroup.release`, :meth:`~GatherGroup.drop_unused`); the group moves
its members through their states (``unit_state.py``), which check each transition
and never call back. The ``Reducer`` (``reduce.py``) packs a call's gradients and
hands them to :meth:`~GatherGroup.reduce` (a group of one) or into a round
(:meth:`~GatherGroup.columns`, a bucket), and waits through :meth:`~GatherGroup.wait`.

Sharing is per collective, state is per unit: a bucket's first member that needs
its parameters gathers every member still SHARDED in one all-gather per part, and
each member unpacks its own columns when acquired; members are freed one by one as
their calls end. Gradients are packed side by side and reduced once every member
has reported; a member that reports twice (a unit called twice) first flushes the
round with the columns not yet reported left at zero.

[Note: bucket order]
Which members join a collective depends only on unit states and the order of
reports, the same on every rank for the same calls (see [Note: collective
order] in ``run.py``), so every rank issues the same bucketed collectives. The
ledger counts every member's bytes as if it had its own collective, so it equals
the cost model (which counts per unit) for every bucket size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from funcshard._src.comm import all_gather as _ag
from funcshard._src.comm import collectives, quantized
from funcshard._src.comm.pending import Pending
from funcshard._src.execute.buffers import BufferPool
from funcshard._src.execute.group_reduce import ReducingGroup
from funcshard._src.execute.packed import Share, SharedGathering
from funcshard._src.execute.part import LeafGathers, Part
from funcshard._src.execute.unit_state import UnitRuntime, UnitState
from funcshard._src.shard.flat import unpack_into


class GatherGroup(ReducingGroup):
    """Units gathered and reduced together, and every collective that moves them; see the module docstring.

    The gathering half is here; the reducing half, and what both share, is
    :class:`ReducingGroup` (``group_reduce.py``).
    """

    def __init__(
        self, members: Sequence[UnitRuntime], gather_pool: BufferPool, reduce_pool: BufferPool
    ) -> None:
        super().__init__(members, gather_pool, reduce_pool)
        # shared all-gathers with shares not yet unpacked: a later one may start for members
        # freed while others still wait on an earlier one (a unit called again)
        self._gathering: list[SharedGathering] = []

    # -- gathering: what Run asks for -------------------------------------------------

    def prefetch(self, unit: UnitRuntime, /) -> None:
        """SHARDED -> GATHERING: issues ``unit``'s all-gathers (a bucket's: of every member still SHARDED)."""
        unit.expect(UnitState.SHARDED, "prefetch")
        if not unit.collective:
            unit.mark_gathering()
        elif self.shared:
            self._start_shared()
        else:
            self._start(unit)

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
        [Note: partial copies] there).
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
        """After an error: drops collectives in flight without waiting (returns them), frees storage, forgets rounds."""
        dropped = [g.pending for g in self._gathering if not g.waited]
        self._gathering.clear()
        self.rounds.clear()
        for unit in self.members:
            for part in unit.parts:
                inflight, part.inflight = part.inflight, None
                if isinstance(inflight, LeafGathers):
                    # the collectives write into the part's storage: forget it, free nothing
                    dropped.extend(inflight.pendings)
                    unit.forget(part)
                elif inflight is not None:
                    self.memory.sub(inflight.result.numel() * inflight.result.element_size())
                    if isinstance(inflight, Pending):  # a share: its gathering is dropped above
                        dropped.append(inflight)
            unit.reset_after_error()
        return dropped

    # -- gathering: the collectives -----------------------------------------------------

    def _start(self, unit: UnitRuntime) -> None:
        """SHARDED -> GATHERING for a group of one: one all-gather per part (or per leaf).

        A unit holding its partial copy all-gathers the copy over its regather axes
        instead of its shard over every shard axis: the same rows, fewer ranks (see
        [Note: partial copies] in ``plan/strategy.py``).
        """
        partial = unit.partial.held
        axes = unit.partial.regather_axes if partial else self.axes
        for part, flat in zip(unit.parts, unit.flats):
            if part.aliased:
                continue
            if partial:
                assert part.partial is not None
                local = part.partial
            else:
                data = flat.data
                local = data if data.dtype == part.compute_dtype else data.to(part.compute_dtype)
            if part.in_place and not partial:
                full = unit.materialize(part)
                # the refill is not an in-place change of tensors autograd saved: the
                # version is put back once the collective has written (after its wait)
                part.version = torch.autograd._unsafe_preserve_version_counter(full)
                pendings = self._gather_in_place(unit, part, local, axes)
                part.inflight = LeafGathers(pendings, full)
                continue
            out = self.pool.take(  # (group_size * numel,); see [Note: staging lifetimes]
                self.group_size * part.layout.numel, local.dtype, local.device
            )
            self.memory.add(out.numel() * out.element_size())
            if unit.weight_format and not partial and local.dtype.is_floating_point:
                # blocks of a low-bit format: [Note: quantized collectives] in plan/quantize.py
                part.inflight = quantized.all_gather(
                    local,
                    self.bound,
                    axes,
                    block=unit.weight_block,
                    format=unit.weight_format,
                    out=out,
                    ledger=self.ledger,
                    tag=unit.name,
                )
                continue
            # a shard (or its cast) is stable until the evaluation settles; a partial copy
            # is freed by its unit ([Note: shards read in place] in comm/shm/cross_memory.py)
            part.inflight = collectives.all_gather(
                local,
                self.bound,
                axes,
                out=out,
                ledger=self.ledger,
                tag=unit.name,
                stable=not partial,
            )
        unit.mark_gathering(from_partial=partial)

    def _gather_in_place(
        self, unit: UnitRuntime, part: Part, local: torch.Tensor, axes: tuple[str, ...]
    ) -> list[Pending]:
        """The collectives writing ``part.full`` over ``axes``: one per leaf (``by_leaf``), else one.

        A flat part where the transport gathers leaf by leaf is gathered by a ring too, which
        writes its storage without the staging of gloo's own all-gather.
        """
        if not part.by_leaf:
            algorithm = _ag.leaf_algorithm() if part.layout.flat and unit.leafwise else None
            pending = collectives.all_gather(
                local,
                self.bound,
                axes,
                out=part.full,
                ledger=self.ledger,
                tag=unit.name,
                algorithm=algorithm,
                stable=True,  # the unit's shard, or its cast
            )
            return [pending]
        pieces = [
            (slot.offset, view.view(self.group_size, slot.numel))
            for slot, view in zip(part.layout.slots, part.views)
        ]
        pending = collectives.all_gather_pieces(
            local, self.bound, self.axes, pieces, ledger=self.ledger, tag=unit.name, stable=True
        )
        return [pending]

    def _start_shared(self) -> None:
        """SHARDED -> GATHERING for every member still SHARDED: one all-gather per part."""
        joining = [i for i, m in enumerate(self.members) if m.state is UnitState.SHARDED]
        first = self.members[joining[0]]
        for j, part in enumerate(first.parts):
            if part.aliased:
                continue
            numel = self.columns_of.numels[j]
            device = first.device(part)
            local = self.pool.take(numel, part.compute_dtype, device)
            for i, member in enumerate(self.members):
                a, b = self.columns_of.span(i, j)
                local[a:b].copy_(member.flats[j].data)  # casts to the compute dtype
            out = self.pool.take(self.group_size * numel, part.compute_dtype, device)
            pending = collectives.all_gather(local, self.bound, self.axes, out=out, tag=self.name)
            gathered = pending.result  # (group_size, numel)
            gathering = SharedGathering(pending, (local, out), set(joining))
            self._gathering.append(gathering)
            for i in joining:
                member = self.members[i]
                a, b = self.columns_of.span(i, j)
                full_bytes = self.group_size * (b - a) * part.compute_dtype.itemsize
                member.parts[j].inflight = Share(gathering, i, gathered[:, a:b])
                self.memory.add(full_bytes)
                if self.ledger is not None:
                    self.ledger.record(
                        "all_gather", self.axes, group_size=self.group_size, full_bytes=full_bytes
                    )
        for i in joining:
            self.members[i].mark_gathering()

    def _finish(self, unit: UnitRuntime) -> None:
        """GATHERING -> GATHERED: waits, then fills every full leaf; see [Note: persistent gathered storage]."""
        unit.expect(UnitState.GATHERING, "finish gathering")
        for part in unit.parts:
            if part.aliased:
                continue
            assert part.inflight is not None
            inflight, part.inflight = part.inflight, None  # a failed wait is not waited for again
            try:
                gathered = inflight.wait()
            except BaseException:
                if part.in_place:
                    unit.forget(part)
                raise
            if unit.partial.lifetime is not None and not unit.partial.in_flight:
                # the rows are the part's storage when gathered in place (flat, or one leaf)
                rows = part.full if part.in_place else gathered
                assert rows is not None
                unit.partial.keep(part, rows.view(self.group_size, -1))
            if part.in_place and not unit.partial.in_flight:  # the collective filled part.full
                assert part.version is not None
                part.version.__exit__(None, None, None)
                part.version = None
                continue
            full = unit.materialize(part)
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(full):
                if not unit.partial.in_flight:
                    unpack_into(part.layout, gathered, part.views, self.axes)
                else:  # [Note: a partial copy on the executor]
                    _unpack_regathered(unit, part, full, gathered)
            self.memory.sub(gathered.numel() * gathered.element_size())
            if isinstance(inflight, Share):
                self._unpacked(inflight)
            else:
                self.pool.give(gathered)
        unit.mark_gathered()

    def _unpacked(self, share: Share) -> None:
        """A member is done with ``share``: the last one gives the shared buffers back."""
        gathering = share.gathering
        gathering.open.discard(share.member)
        if not gathering.open and gathering in self._gathering:
            self._gathering.remove(gathering)
            if gathering.waited:
                for t in gathering.staging:
                    self.pool.give(t)


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
