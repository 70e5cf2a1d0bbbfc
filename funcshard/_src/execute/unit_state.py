"""One unit on this rank: its shards, its gathered storage, and the transitions between them.

A unit is SHARDED, GATHERING (an all-gather in flight) or GATHERED, and only
its own methods move it (docs/executor.md draws the states and who calls
what): :meth:`UnitRuntime.prefetch` issues the all-gather ahead of use,
:meth:`UnitRuntime.acquire` makes the unit GATHERED and counts a holder,
:meth:`UnitRuntime.release` drops one and frees the storage with the last,
:meth:`UnitRuntime.drop_unused` frees a prefetch nobody used. A transition from
the wrong state is an internal error (:class:`UnitStateError`), never silently
allowed.

[Note: persistent gathered storage]
Every full leaf a unit hands to autograd is a view of one persistent buffer per
dtype (``Part.full``). Freeing resizes that buffer's storage to zero bytes;
gathering again resizes it back and copies into the same storage, so tensors
autograd saved in forward see the re-gathered values in backward. The copy runs
inside ``torch.autograd._unsafe_preserve_version_counter`` so autograd does not
take the refill for an in-place change of a saved tensor (PyTorch FSDP2 does
the same).

A part of one leaf that :func:`gathers_in_place` (an embedding or a head alone in
its unit), or any part of a flat unit (whose gathered buffer is its leaves'
concatenation), is all-gathered straight into its full storage: no gathered buffer
beside it, no unpacking copy. On gloo over two ranks, so is a part of several
leaves that all :func:`leaves_gather_in_place` (each split evenly on dim 0, the
default placement): one collective per leaf, each writing its full leaf, a view
of ``Part.full`` (``LEAF_GATHERS`` says why only there). The collectives write
into that storage, so :meth:`UnitRuntime.discard` never frees the storage of
such a gather in flight; it forgets it (the pending collectives keep it alive
until drained).

[Note: aliased units]
A part that needs no collective and no cast (``no_shard`` without mixed
precision, or any unit on a mesh of one rank) has full leaves that are exactly
its flat shard: the full views alias the shard and freeing is a no-op.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from funcshard._src.comm import all_gather as _ag
from funcshard._src.comm import collectives
from funcshard._src.comm.groups import BoundMesh
from funcshard._src.comm.ledger import Ledger
from funcshard._src.comm.pending import Pending
from funcshard._src.execute.buffers import BufferPool
from funcshard._src.execute.memory import GatheredMemory
from funcshard._src.execute.part import LeafGathers, Part, SharedGather
from funcshard._src.plan.precision import MixedPrecision
from funcshard._src.plan.strategy import LEAF_GATHERS, shard_axes
from funcshard._src.plan.units import Unit
from funcshard._src.shard.flat import (
    FlatLayout,
    Slot,
    gathers_in_place,
    leaves_gather_in_place,
    unpack_into,
)
from funcshard._src.shard.flat_shard import FlatShard

_T = TypeVar("_T")


class UnitState(enum.Enum):
    """Where a unit's parameters are on this rank."""

    SHARDED = "sharded"  # only the local shard
    GATHERING = "gathering"  # an all-gather is in flight
    GATHERED = "gathered"  # every full leaf is materialized


class UnitStateError(AssertionError):
    """A unit was asked for a transition its state does not allow: a bug in funcshard."""


class UnitRuntime:
    """A unit on this rank across steps: buffers persist, flat shards are rebound every step."""

    def __init__(
        self,
        unit: Unit,
        layouts: Sequence[FlatLayout],
        bound: BoundMesh,
        precision: MixedPrecision,
        ledger: Ledger | None,
        memory: GatheredMemory,
        pool: BufferPool | None = None,
    ) -> None:
        self.unit = unit
        self.bound = bound
        self.ledger = ledger
        self.memory = memory
        self.pool = (
            BufferPool() if pool is None else pool
        )  # staging buffers, shared by a step's units
        mesh = bound.mesh
        # collectives for gathering run over the strategy's shard axes; gradients are
        # then all-reduced over the remaining (replica) axes
        self.axes = shard_axes(unit.strategy, mesh)
        self.replica_axes = tuple(a for a in mesh.axis_names if a not in self.axes)
        self.group_size = collectives.group_size(bound, self.axes)
        self.replica_size = collectives.group_size(bound, self.replica_axes)
        backend = str(dist.get_backend()) if bound.distributed else ""
        leafwise = self.leafwise = (backend, self.group_size) in LEAF_GATHERS
        self.parts = [
            Part(
                layout,
                precision.compute_dtype(layout.dtype),
                precision.gradient_dtype(layout.dtype),
                aliased=self.group_size == 1
                and precision.compute_dtype(layout.dtype) == layout.dtype,
                in_place=self.group_size > 1
                and (
                    gathers_in_place(layout, self.axes)
                    or (leafwise and leaves_gather_in_place(layout, self.axes))
                ),
            )
            for layout in layouts
        ]
        # the unit's leaf order, computed once: parts in turn, slots within each
        self.slots: tuple[Slot, ...] = tuple(s for p in self.parts for s in p.layout.slots)
        self.position = {slot.index: i for i, slot in enumerate(self.slots)}
        self.index_set = frozenset(self.position)  # what fs.call checks its subtree against
        # per leaf in the unit's order: whether it gets a gradient (floating, not frozen)
        self.trained: tuple[bool, ...] = tuple(
            p.layout.dtype.is_floating_point and not p.layout.frozen
            for p in self.parts
            for _ in p.layout.slots
        )
        # one rank, no cast: no autograd node of its own; [Note: local-only calls] in run.py
        self.local_only = self.bound.mesh.size == 1 and all(p.aliased for p in self.parts)
        self.state = UnitState.SHARDED
        self.flats: list[FlatShard] = []
        self._holders = 0
        self.bucket: SharedGather | None = None  # set by bucket.Bucket; see bucket.py
        self.bucket_index = 0  # this unit's position in its bucket

    @property
    def name(self) -> str:
        """The unit's name."""
        return self.unit.name

    @property
    def frees_after_forward(self) -> bool:
        """Whether forward frees the gathered parameters (``full_shard``, not the root unit)."""
        return self.unit.strategy == "full_shard" and not self.unit.is_root

    @property
    def gathered_bytes(self) -> int:
        """Bytes of this unit's full leaves when gathered (aliased parts hold none of their own)."""
        return sum(p.full_bytes for p in self.parts)

    @property
    def full_numel_bytes(self) -> int:
        """Bytes of this unit's full leaves in the compute dtypes, aliased or not."""
        return sum(p.full_numel * p.compute_dtype.itemsize for p in self.parts)

    @property
    def holders(self) -> int:
        """How many calls (or the root) hold the unit gathered now."""
        return self._holders

    def split(self, leaves: Sequence[_T], /) -> list[Sequence[_T]]:
        """``leaves`` in the unit's leaf order, cut into one sequence per part."""
        out: list[Sequence[_T]] = []
        i = 0
        for part in self.parts:
            out.append(leaves[i : i + len(part.layout.slots)])
            i += len(part.layout.slots)
        return out

    def bind(self, flats: Sequence[FlatShard], /) -> None:
        """Uses ``flats`` (one per part, same layouts) as this step's shards; mutates.

        Raises:
            UnitStateError: the unit is not SHARDED (a step is still using it).
        """
        self._expect(UnitState.SHARDED, "bind")
        self.flats = list(flats)
        for part, flat in zip(self.parts, self.flats):
            if part.aliased and part.full is not flat.data:  # see [Note: aliased units]
                part.full = flat.data  # the views are made once per buffer
                part.views = list(flat.whole_leaves())

    # -- transitions ---------------------------------------------------------------

    def prefetch(self) -> None:
        """SHARDED -> GATHERING: issues the all-gather of every part, to be waited for by :meth:`acquire`."""
        self._expect(UnitState.SHARDED, "prefetch")
        if self.bucket is not None and not all(p.aliased for p in self.parts):
            self.bucket.start_gather()  # moves this unit (and others) to GATHERING
            return
        for part, flat in zip(self.parts, self.flats):
            if part.aliased:
                continue
            local = (
                flat.data
                if flat.data.dtype == part.compute_dtype
                else flat.data.to(part.compute_dtype)
            )
            if part.in_place:
                self._materialize(part)
                assert part.full is not None
                # the refill is not an in-place change of tensors autograd saved: the
                # version is put back once the collective has written (after its wait)
                part.version = torch.autograd._unsafe_preserve_version_counter(part.full)
                part.inflight = LeafGathers(self._gather_in_place(part, local), part.full)
                continue
            out = self.pool.take(  # (group_size * numel,); see [Note: staging lifetimes]
                self.group_size * local.numel(), local.dtype, local.device
            )
            self.memory.add(out.numel() * out.element_size())
            part.inflight = collectives.all_gather(
                local, self.bound, self.axes, out=out, ledger=self.ledger, tag=self.name
            )
        self.mark_gathering()

    def _gather_in_place(self, part: Part, local: torch.Tensor) -> list[Pending]:
        """The collectives writing ``part.full``: one per leaf (``by_leaf``), else one.

        A flat part on ``LEAF_GATHERS``' backends is gathered by a ring too, which
        writes its storage without the staging of gloo's own all-gather.
        """
        if not part.by_leaf:
            algorithm = _ag.leaf_algorithm() if part.layout.flat and self.leafwise else None
            pending = collectives.all_gather(
                local,
                self.bound,
                self.axes,
                out=part.full,
                ledger=self.ledger,
                tag=self.name,
                algorithm=algorithm,
            )
            return [pending]
        pieces = [
            (slot.offset, view.view(self.group_size, slot.numel))
            for slot, view in zip(part.layout.slots, part.views)
        ]
        return [
            collectives.all_gather_pieces(
                local, self.bound, self.axes, pieces, ledger=self.ledger, tag=self.name
            )
        ]

    def pack_gathers(self) -> None:
        """Gathers every part through one packed buffer, none leaf by leaf (for a bucket); mutates.

        A part of one leaf gathered in place keeps its way: such units join no bucket.
        """
        self._expect(UnitState.SHARDED, "pack its gathers")
        for part in self.parts:
            if part.by_leaf:
                part.in_place = False

    def mark_gathering(self) -> None:
        """SHARDED -> GATHERING, once every part's all-gather (or share of one) is in flight."""
        self.memory.log("start", self.name)
        self.state = UnitState.GATHERING

    def acquire(self) -> None:
        """-> GATHERED, held once more: waits for a prefetch, or gathers now."""
        if self.state is UnitState.SHARDED:
            self.prefetch()
        if self.state is UnitState.GATHERING:
            self._finish_gather()
        self._holders += 1

    def release(self) -> None:
        """Drops one holder; the last one frees the storage (GATHERED -> SHARDED)."""
        self._expect(UnitState.GATHERED, "release")
        if self._holders == 0:
            raise UnitStateError(f"unit {self.name!r}: released more often than acquired")
        self._holders -= 1
        if self._holders == 0:
            self._free()

    def drop_unused(self) -> None:
        """Frees a unit that was prefetched but that no call holds (GATHERING/GATHERED -> SHARDED)."""
        if self._holders or self.state is UnitState.SHARDED:
            return
        if self.state is UnitState.GATHERING:
            self._finish_gather()
        self._free()

    def release_all(self) -> None:
        """At the end of a step: drops every holder and frees the storage (-> SHARDED)."""
        self._holders = 0
        if self.state is not UnitState.SHARDED:
            self.drop_unused()

    def discard(self) -> list[Pending]:
        """After an error: drops gathers in flight without waiting (returns them), frees storage, forgets holders."""
        dropped: list[Pending] = [] if self.bucket is None else self.bucket.abandon()
        for part in self.parts:
            if isinstance(part.inflight, LeafGathers):
                # the collectives write into the part's storage: forget it, free nothing
                dropped.extend(part.inflight.pendings)
                part.inflight = None
                self._forget(part)
                continue
            if part.inflight is not None:
                self.memory.sub(part.inflight.result.numel() * part.inflight.result.element_size())
                if isinstance(part.inflight, Pending):  # a bucket's share: abandoned above
                    dropped.append(part.inflight)
                part.inflight = None
            if not part.aliased and part.full is not None and part.full.untyped_storage().size():
                part.free(self.name)
                self.memory.sub(part.full_bytes)
        self._holders = 0
        self.state = UnitState.SHARDED
        return dropped

    def full_leaves(self) -> list[torch.Tensor]:
        """The full leaves in the unit's leaf order (the unit must be GATHERED)."""
        self._expect(UnitState.GATHERED, "full_leaves")
        return [view.detach() for part in self.parts for view in part.views]

    # -- helpers ---------------------------------------------------------------------

    def _expect(self, state: UnitState, what: str) -> None:
        if self.state is not state:
            raise UnitStateError(
                f"internal error: unit {self.name!r} asked to {what} in state {self.state.value}, "
                f"which needs {state.value}; please report it"
            )

    def _finish_gather(self) -> None:
        """GATHERING -> GATHERED: waits, then fills every full leaf; see [Note: persistent gathered storage]."""
        self._expect(UnitState.GATHERING, "finish gathering")
        for part in self.parts:
            if part.aliased:
                continue
            assert part.inflight is not None
            inflight, part.inflight = part.inflight, None  # a failed wait is not waited for again
            try:
                gathered = inflight.wait()
            except BaseException:
                if part.in_place:
                    self._forget(part)
                raise
            if part.in_place:  # the collective filled part.full itself
                assert part.version is not None
                part.version.__exit__(None, None, None)
                part.version = None
                continue
            self._materialize(part)
            assert part.full is not None
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(part.full):
                unpack_into(part.layout, gathered, part.views, self.axes)
            self.memory.sub(gathered.numel() * gathered.element_size())
            if isinstance(inflight, Pending):
                self.pool.give(gathered)
            else:  # a share of the bucket's buffer, which the bucket gives back
                assert self.bucket is not None
                self.bucket.unpacked(inflight)
        self.memory.log("finish", self.name)
        self.state = UnitState.GATHERED

    def _forget(self, part: Part) -> None:
        """Drops an in-place part's storage without freeing it: a collective may still write into it."""
        part.full, part.views, part.version = None, [], None
        self.memory.sub(part.full_bytes)

    def _free(self) -> None:
        """GATHERED -> SHARDED: releases the full storage of every part (aliased parts keep theirs)."""
        self._expect(UnitState.GATHERED, "free")
        for part in self.parts:
            if not part.aliased and part.full is not None:
                part.free(self.name)
                self.memory.sub(part.full_bytes)
        self.memory.log("free", self.name)
        self.state = UnitState.SHARDED

    def _materialize(self, part: Part) -> None:
        """Gives ``part.full`` its storage back (allocating it and the views the first time)."""
        if part.full is None:
            device = self.flats[self.parts.index(part)].data.device
            part.full = torch.empty(part.full_numel, dtype=part.compute_dtype, device=device)
            offset = 0
            for slot in part.layout.slots:
                n = math.prod(slot.shape)
                part.views.append(part.full[offset : offset + n].view(slot.shape))
                offset += n
        elif part.full.untyped_storage().size() == 0:
            part.full.untyped_storage().resize_(part.full_bytes)
        self.memory.add(part.full_bytes)
