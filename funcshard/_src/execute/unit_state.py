"""One unit on this rank: its shards, its gathered storage, and the states between them.

A unit is SHARDED, GATHERING (an all-gather in flight) or GATHERED.

[Note: a unit's state is moved by its group alone]
The unit's parameter group (``param_group.py``) issues and waits for the
collectives and calls the transitions here (``mark_gathering``, ``mark_gathered``,
``hold``, ``unhold``, ``free``, ...), each of which checks the state it comes from
(docs/executor.md draws them); no other module calls them, and only this one
assigns ``state`` (``tests/test_layering.py``). A transition from the wrong state
is an internal error (:class:`UnitStateError`), never silently allowed. A unit
never calls its group: see [Note: one owner per collective] in ``param_group.py``.

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
of ``Part.full`` (``Capabilities.gathers_leaf_by_leaf``, declared by the transport,
says where). The collectives write
into that storage, so after an error the group never frees the storage of such
a gather in flight; the unit forgets it (:meth:`UnitRuntime.forget`), and the
pending collectives keep it alive until drained.

A ``partial_reshard`` or ``hybrid_shard_optimizer`` unit also keeps a partial
copy (:attr:`UnitRuntime.partial`; [Note: a partial copy on the executor] in
``partial_copy.py``).

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

from funcshard._src.comm import collectives
from funcshard._src.comm.groups import BoundMesh
from funcshard._src.comm.ledger import Ledger
from funcshard._src.execute import huge_pages
from funcshard._src.execute.memory import GatheredMemory
from funcshard._src.execute.part import Part
from funcshard._src.execute.partial_copy import PartialCopy
from funcshard._src.plan.precision import MixedPrecision
from funcshard._src.plan.quantize import Format, Quantized
from funcshard._src.plan.strategy import (
    keeps_for_step,
    reduces_in_two_hops,
    reshards_after_forward,
    shard_axes,
    transport_capabilities,
)
from funcshard._src.plan.units import Unit
from funcshard._src.shard.flat import (
    FlatLayout,
    Slot,
    gathers_in_place,
    leaves_gather_in_place,
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
    """A unit on this rank across steps: storage persists, flat shards are rebound every step."""

    def __init__(
        self,
        unit: Unit,
        layouts: Sequence[FlatLayout],
        bound: BoundMesh,
        precision: MixedPrecision,
        ledger: Ledger | None,
        memory: GatheredMemory,
        quantize: Quantized | None = None,
    ) -> None:
        self.unit = unit
        self.is_root = unit.is_root  # what a step asks of the plan, asked once
        self._frees_after_forward = reshards_after_forward(unit.strategy) and not unit.is_root
        self._keeps_for_step = keeps_for_step(unit.strategy)
        self.bound = bound
        self.ledger = ledger
        self.memory = memory
        mesh = bound.mesh
        # collectives for gathering run over the strategy's shard axes; gradients are
        # then all-reduced over the remaining (replica) axes
        self.axes = shard_axes(unit.strategy, mesh)
        self.replica_axes = tuple(a for a in mesh.axis_names if a not in self.axes)
        self.group_size = collectives.group_size(bound, self.axes)
        self.replica_size = collectives.group_size(bound, self.replica_axes)
        # what gradients are all-reduced over after (or, for no_shard, instead of) the
        # reduce-scatter: the replica axes, none where there is one replica
        self.all_reduce_axes = self.replica_axes if self.replica_size > 1 else ()
        self.partial = PartialCopy(unit, bound, memory)
        # [Note: two-hop reductions] in partial_gradient.py: a unit that keeps its copy for
        # the step reduces over the last axis each micro-batch, over the others once a step
        self.two_hop = reduces_in_two_hops(unit.strategy, bound.mesh, is_root=unit.is_root)
        # [Note: quantized collectives] in plan/quantize.py: the block and format of
        # quantized gathers from shards (floating parts) and of reductions (block 0: exact)
        q = quantize if self.group_size > 1 else None
        self.weight_format: Format | None = q.weight_format if q is not None else None
        self.grad_format: Format | None = q.gradient_format if q is not None else None
        self.weight_block = q.block if q is not None and self.weight_format else 0
        self.grad_block = q.block if q is not None and self.grad_format else 0
        backend = str(dist.get_backend()) if bound.distributed else ""
        leafwise = self.leafwise = (
            transport_capabilities(backend, self.group_size).gathers_leaf_by_leaf
            and self.partial.lifetime is None
            and not self.weight_block
        )
        self.parts = [
            Part(
                layout,
                precision.compute_dtype(layout.dtype),
                precision.gradient_dtype(layout.dtype),
                aliased=self.group_size == 1
                and precision.compute_dtype(layout.dtype) == layout.dtype,
                in_place=self.group_size > 1
                and not (
                    self.weight_block and precision.compute_dtype(layout.dtype).is_floating_point
                )
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
        # one rank, no cast: no autograd node of its own; [Note: local-only calls] in local_calls.py
        self.local_only = self.bound.mesh.size == 1 and all(p.aliased for p in self.parts)
        self.state = UnitState.SHARDED
        self.flats: list[FlatShard] = []
        self._holders = 0

    @property
    def name(self) -> str:
        """The unit's name."""
        return self.unit.name

    @property
    def frees_after_forward(self) -> bool:
        """Whether forward frees the gathered parameters (``full_shard``, ``hybrid_shard``; not the root unit)."""
        return self._frees_after_forward

    @property
    def keeps_for_step(self) -> bool:
        """Whether the unit stays gathered and defers its reduction across micro-batches (``shard_optimizer``)."""
        return self._keeps_for_step

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

    @property
    def collective(self) -> bool:
        """Whether gathering the unit takes a collective (a part that is not aliased)."""
        return not all(p.aliased for p in self.parts)

    def split(self, leaves: Sequence[_T], /) -> list[Sequence[_T]]:
        """``leaves`` in the unit's leaf order, cut into one sequence per part."""
        out: list[Sequence[_T]] = []
        i = 0
        for part in self.parts:
            out.append(leaves[i : i + len(part.layout.slots)])
            i += len(part.layout.slots)
        return out

    def device(self, part: Part, /) -> torch.device:
        """Where ``part``'s shard (and so its gathered storage) lives."""
        return self.flats[self.parts.index(part)].data.device

    def bind(self, flats: Sequence[FlatShard], /) -> None:
        """Uses ``flats`` (one per part, same layouts) as this step's shards; mutates.

        A unit kept gathered from the step's last micro-batch (:attr:`keeps_for_step`),
        or keeping its partial copy (``partial.for_step``), is bound again
        to the same shards.

        Raises:
            UnitStateError: the unit is not SHARDED (a step is still using it), or is
                kept gathered from other shards than ``flats``.
        """
        kept = self.state is UnitState.GATHERED and self.keeps_for_step and not self._holders
        if kept or self.partial.held:
            if len(flats) != len(self.flats) or any(a is not b for a, b in zip(flats, self.flats)):
                raise UnitStateError(
                    f"internal error: unit {self.name!r} is kept gathered from other shards "
                    f"than this micro-batch's; please report it"
                )
            if kept:
                return
        self.expect(UnitState.SHARDED, "bind")
        self.flats = list(flats)
        for part, flat in zip(self.parts, self.flats):
            if part.aliased and part.full is not flat.data:  # see [Note: aliased units]
                part.full = flat.data  # the views are made once per buffer
                part.views = list(flat.whole_leaves())

    def pack_gathers(self) -> None:
        """Gathers every part through one packed buffer, none leaf by leaf (a bucket's member); mutates.

        A part of one leaf gathered in place keeps its way: such units join no bucket.
        """
        self.expect(UnitState.SHARDED, "pack its gathers")
        for part in self.parts:
            if part.by_leaf:
                part.in_place = False

    # -- transitions, called by the unit's parameter group ------------------------------

    def mark_gathering(self, *, from_partial: bool = False) -> None:
        """SHARDED -> GATHERING, once every part's all-gather (or share of one) is in flight.

        ``from_partial``: the all-gathers are of the partial copy, over its regather axes.
        """
        self.expect(UnitState.SHARDED, "start gathering")
        self.memory.log("start", self.name)
        self.partial.in_flight = from_partial
        self.state = UnitState.GATHERING

    def mark_gathered(self) -> None:
        """GATHERING -> GATHERED, once every full leaf is filled (and any partial copy kept)."""
        self.expect(UnitState.GATHERING, "finish gathering")
        self.memory.log("finish", self.name)
        self.partial.held = self.partial.lifetime is not None
        self.partial.in_flight = False
        self.state = UnitState.GATHERED

    def hold(self) -> None:
        """Counts one more holder of the GATHERED unit (a call, or the root)."""
        self.expect(UnitState.GATHERED, "be held")
        self._holders += 1

    def unhold(self) -> bool:
        """Drops one holder; whether it was the last (then the group frees the unit)."""
        self.expect(UnitState.GATHERED, "release")
        if self._holders == 0:
            raise UnitStateError(f"unit {self.name!r}: released more often than acquired")
        self._holders -= 1
        return self._holders == 0

    def drop_holders(self) -> None:
        """At the end of a step: no call holds the unit any more (its group frees it next)."""
        self._holders = 0

    def free(self) -> None:
        """GATHERED -> SHARDED: releases the full storage of every part (aliased parts keep theirs)."""
        self.expect(UnitState.GATHERED, "free")
        for part in self.parts:
            if not part.aliased and part.full is not None:
                part.free(self.name)
                self.memory.sub(part.full_bytes)
        self.memory.log("free", self.name)
        self.state = UnitState.SHARDED

    def reset_after_error(self) -> None:
        """After an error: frees whatever storage is materialized, forgets holders (-> SHARDED).

        The group has forgotten (:meth:`forget`) the storage collectives may still write.
        """
        for part in self.parts:
            if not part.aliased and part.full is not None and part.full.untyped_storage().size():
                part.free(self.name)
                self.memory.sub(part.full_bytes)
        self.partial.free(self.parts)
        self._holders = 0
        self.state = UnitState.SHARDED

    # -- storage ---------------------------------------------------------------------

    def materialize(self, part: Part, /) -> torch.Tensor:
        """Gives ``part.full`` its storage back (allocating it and the views the first time); returns it."""
        if part.full is None:
            part.full = torch.empty(
                part.full_numel, dtype=part.compute_dtype, device=self.device(part)
            )
            offset = 0
            for slot in part.layout.slots:
                n = math.prod(slot.shape)
                part.views.append(part.full[offset : offset + n].view(slot.shape))
                offset += n
            huge_pages.advise(part.full)
        elif part.full.untyped_storage().size() == 0:
            part.full.untyped_storage().resize_(part.full_bytes)
            huge_pages.advise(part.full)  # [Note: huge pages for gathered storage]
        self.memory.add(part.full_bytes)
        return part.full

    def forget(self, part: Part, /) -> None:
        """Drops an in-place part's storage without freeing it: a collective may still write into it."""
        part.full, part.views, part.version = None, [], None
        self.memory.sub(part.full_bytes)

    def full_leaves(self) -> list[torch.Tensor]:
        """The full leaves in the unit's leaf order (the unit must be GATHERED)."""
        self.expect(UnitState.GATHERED, "full_leaves")
        return [view.detach() for part in self.parts for view in part.views]

    def expect(self, state: UnitState, what: str) -> None:
        """Raises :class:`UnitStateError` unless the unit is in ``state``."""
        if self.state is not state:
            raise UnitStateError(
                f"internal error: unit {self.name!r} asked to {what} in state {self.state.value}, "
                f"which needs {state.value}; please report it"
            )
