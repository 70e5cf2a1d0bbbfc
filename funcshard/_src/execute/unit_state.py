"""One unit on this rank: its shards, its gathered storage, and the collectives that move them.

A unit moves SHARDED -> GATHERING -> GATHERED -> SHARDED, one method per
transition: :meth:`UnitRuntime.start_gather` issues the all-gather (possibly
ahead of time, as a prefetch), :meth:`UnitRuntime.finish_gather` waits for it
and copies every full leaf into the unit's persistent storage, and
:meth:`UnitRuntime.free` releases that storage. :meth:`UnitRuntime.reduce`
turns the full gradients of one call into a pending reduce-scatter (and
all-reduce across replicas) of the sharded gradient.

[Note: persistent gathered storage]
Every full leaf a unit hands to autograd is a view of one persistent buffer per
dtype (``Part.full``). Freeing resizes that buffer's storage to zero bytes;
gathering again resizes it back and copies into the same storage, so tensors
autograd saved in forward see the re-gathered values in backward. The copy runs
inside ``torch.autograd._unsafe_preserve_version_counter`` so autograd does not
take the refill for an in-place change of a saved tensor (PyTorch FSDP2 does
the same).

[Note: aliased units]
A part that needs no collective and no cast (``no_shard`` without mixed
precision, or any unit on a mesh of one rank) has full leaves that are exactly
its flat shard: the full views alias the shard and freeing is a no-op.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from funcshard._src.comm import collectives
from funcshard._src.comm.collectives import Pending
from funcshard._src.comm.groups import BoundMesh
from funcshard._src.comm.ledger import Ledger
from funcshard._src.plan.precision import MixedPrecision
from funcshard._src.plan.strategy import shard_axes
from funcshard._src.plan.units import Unit
from funcshard._src.shard.flat import FlatLayout, pack_into, unpack_into
from funcshard._src.shard.sharded import FlatShard


class UnitState(enum.Enum):
    """Where a unit's parameters are on this rank."""

    SHARDED = "sharded"  # only the local shard
    GATHERING = "gathering"  # an all-gather is in flight
    GATHERED = "gathered"  # every full leaf is materialized


@dataclass
class Memory:
    """Bytes of gathered parameters alive on this rank, and their peak; optionally a trace.

    With ``events`` a list, every unit transition appends ``(event, unit name)``:
    ``start`` (all-gather issued), ``finish`` (gathered), ``free`` and ``reduce``.
    """

    current: int = 0
    peak: int = 0
    events: list[tuple[str, str]] | None = None

    def log(self, event: str, unit: str) -> None:
        """Appends to ``events`` when tracing; mutates."""
        if self.events is not None:
            self.events.append((event, unit))

    def add(self, nbytes: int) -> None:
        """Counts ``nbytes`` more; mutates."""
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def sub(self, nbytes: int) -> None:
        """Counts ``nbytes`` fewer; mutates."""
        self.current -= nbytes


@dataclass
class Part:
    """One dtype of a unit: its layout, full storage and full leaf views."""

    layout: FlatLayout
    compute_dtype: torch.dtype
    grad_dtype: torch.dtype
    aliased: bool
    full: torch.Tensor | None = None  # persistent, see [Note: persistent gathered storage]
    views: list[torch.Tensor] = field(default_factory=list)
    inflight: Pending | None = None
    deferred: torch.Tensor | None = None  # packed gradients kept locally, (group_size, numel)
    spare: torch.Tensor | None = None  # a donated gradient buffer, (numel,), for the next reduction

    @property
    def full_numel(self) -> int:
        """Elements of all full leaves of this part."""
        return sum(math.prod(s.shape) for s in self.layout.slots)


@dataclass
class Reduction:
    """A gradient reduction in flight for one part; :meth:`finish` adds it to the sharded gradient."""

    part: int  # index of the part in its unit
    stage: Pending
    then_all_reduce: tuple[str, ...]
    bound: BoundMesh
    ledger: Ledger | None
    unit: str = ""

    def finish(
        self, grads: dict[tuple[str, int], torch.Tensor], key: tuple[str, int], dtype: torch.dtype
    ) -> None:
        """Waits, then adds the reduced gradient to ``grads[key]``; mutates ``grads``.

        The first reduction of a key becomes its gradient buffer as it is (cast to
        the stored ``dtype`` if need be): no zero-filled buffer and no extra pass.
        """
        out = self.stage.wait()
        if self.then_all_reduce:
            out = collectives.all_reduce(
                out, self.bound, self.then_all_reduce, ledger=self.ledger, tag=self.unit
            ).wait()
        if key not in grads:
            grads[key] = out if out.dtype == dtype else out.to(dtype)
        else:
            grads[key].add_(out if out.dtype == dtype else out.to(dtype))


class UnitRuntime:
    """A unit on this rank across steps: buffers persist, flat shards are rebound every step."""

    def __init__(
        self,
        unit: Unit,
        layouts: Sequence[FlatLayout],
        bound: BoundMesh,
        precision: MixedPrecision,
        ledger: Ledger | None,
        memory: Memory,
    ) -> None:
        self.unit = unit
        self.bound = bound
        self.ledger = ledger
        self.memory = memory
        mesh = bound.mesh
        # collectives for gathering run over the strategy's shard axes; gradients are
        # then all-reduced over the remaining (replica) axes
        self.axes = shard_axes(unit.strategy, mesh)
        self.replica_axes = tuple(a for a in mesh.axis_names if a not in self.axes)
        self.group_size = collectives.group_size(bound, self.axes)
        self.parts = [
            Part(
                layout,
                precision.compute_dtype(layout.dtype),
                precision.gradient_dtype(layout.dtype),
                aliased=self.group_size == 1
                and precision.compute_dtype(layout.dtype) == layout.dtype,
            )
            for layout in layouts
        ]
        self.state = UnitState.SHARDED
        self.refs = 0
        self.flats: list[FlatShard] = []

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
        return sum(p.full_numel * p.compute_dtype.itemsize for p in self.parts if not p.aliased)

    def bind(self, flats: Sequence[FlatShard], /) -> None:
        """Uses ``flats`` (one per part, same layouts) as this step's shards; mutates."""
        self.flats = list(flats)
        for part, flat in zip(self.parts, self.flats):
            if part.aliased:
                part.views = [
                    flat.data[s.offset : s.offset + s.numel].view(s.shape)
                    for s in part.layout.slots
                ]

    def start_gather(self) -> None:
        """SHARDED -> GATHERING: issues the all-gather of every part (asynchronously)."""
        assert self.state is UnitState.SHARDED, (self.name, self.state)
        for part, flat in zip(self.parts, self.flats):
            if part.aliased:
                continue
            local = (
                flat.data
                if flat.data.dtype == part.compute_dtype
                else flat.data.to(part.compute_dtype)
            )
            out = torch.empty(
                self.group_size * local.numel(), dtype=local.dtype, device=local.device
            )
            self.memory.add(out.numel() * out.element_size())
            part.inflight = collectives.all_gather(
                local,
                self.bound,
                self.axes,
                out=out,
                ledger=self.ledger,
                tag=self.name,
            )
        self.memory.log("start", self.name)
        self.state = UnitState.GATHERING

    def finish_gather(self) -> None:
        """GATHERING -> GATHERED: waits, then fills every full leaf; see [Note: persistent gathered storage]."""
        assert self.state is UnitState.GATHERING, (self.name, self.state)
        for part in self.parts:
            if part.aliased:
                continue
            assert part.inflight is not None
            inflight, part.inflight = part.inflight, None  # a failed wait is not waited for again
            gathered = inflight.wait()
            self._materialize(part)
            assert part.full is not None
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(part.full):
                unpack_into(part.layout, gathered, part.views, self.axes)
            self.memory.sub(gathered.numel() * gathered.element_size())
            del gathered
        self.memory.log("finish", self.name)
        self.state = UnitState.GATHERED

    def gather(self) -> None:
        """Makes the unit GATHERED, waiting for a prefetch in flight or gathering now."""
        if self.state is UnitState.SHARDED:
            self.start_gather()
        if self.state is UnitState.GATHERING:
            self.finish_gather()

    def free(self) -> None:
        """GATHERED -> SHARDED: releases the full storage of every part (aliased parts keep theirs)."""
        if self.state is UnitState.GATHERING:
            self.finish_gather()
        if self.state is UnitState.SHARDED:
            return
        for part in self.parts:
            if not part.aliased and part.full is not None:
                part.full.untyped_storage().resize_(0)
                self.memory.sub(part.full_numel * part.compute_dtype.itemsize)
        self.memory.log("free", self.name)
        self.state = UnitState.SHARDED

    def discard(self) -> list[Pending]:
        """After an error: drops gathers in flight without waiting (returns them), frees storage, forgets references."""
        dropped: list[Pending] = []
        for part in self.parts:
            if part.inflight is not None:
                self.memory.sub(part.inflight.result.numel() * part.inflight.result.element_size())
                dropped.append(part.inflight)
                part.inflight = None
            part.deferred = None
            if (
                not part.aliased
                and part.full is not None
                and part.full.untyped_storage().size() > 0
            ):
                part.full.untyped_storage().resize_(0)
                self.memory.sub(part.full_numel * part.compute_dtype.itemsize)
        self.refs = 0
        self.state = UnitState.SHARDED
        return dropped

    def full_leaves(self) -> list[torch.Tensor]:
        """The full leaves of every part, in part then slot order (the unit must be GATHERED)."""
        assert self.state is UnitState.GATHERED or all(p.aliased for p in self.parts), (
            self.name,
            self.state,
        )
        return [view.detach() for part in self.parts for view in part.views]

    def reduce(
        self, grads: Sequence[torch.Tensor | None], /, *, defer: bool = False
    ) -> list[Reduction]:
        """Starts reducing one call's full gradients (part then slot order) to their mean over all ranks.

        With ``defer``, the gradients are packed and kept locally instead (added to
        what earlier deferred calls kept), to be reduced once by a later call
        without ``defer``: gradient accumulation without communication, like
        FSDP's ``no_sync``. Returns one :class:`Reduction` per floating-point
        part that was reduced.
        """
        out: list[Reduction] = []
        world = self.bound.mesh.size
        replica = (
            self.replica_axes if collectives.group_size(self.bound, self.replica_axes) > 1 else ()
        )
        i = 0
        for k, part in enumerate(self.parts):
            mine = grads[i : i + len(part.layout.slots)]
            i += len(part.layout.slots)
            if not part.layout.dtype.is_floating_point:
                continue
            device = self.flats[k].data.device
            # a donated buffer of the last step's gradient takes this one's result; see donation.py
            spare = None
            if part.spare is not None and not defer:
                spare, part.spare = part.spare, None
                if spare.dtype != part.grad_dtype:
                    spare = None
            if spare is not None and self.group_size == 1:
                rows = spare.view(1, -1)  # no_shard: reduced in place, this becomes the gradient
                spare = None
            else:
                rows = torch.empty(
                    self.group_size, part.layout.numel, dtype=part.grad_dtype, device=device
                )
            # the mean over every data-parallel rank: divide while packing, unless gradients
            # kept from earlier micro-batches are still to be added
            direct = part.deferred is None and not defer
            leaves = [None if g is None else g.to(part.grad_dtype) for g in mine]
            pack_into(part.layout, leaves, rows, self.axes, scale=1.0 / world if direct else 1.0)
            if part.deferred is not None:
                rows.add_(part.deferred)
                part.deferred = None
            if defer:
                part.deferred = rows
                continue
            if not direct:
                rows.div_(world)
            if self.group_size == 1 and replica:  # no_shard: start the all-reduce now, overlapped
                stage = collectives.all_reduce(
                    rows.view(-1),
                    self.bound,
                    replica,
                    ledger=self.ledger,
                    tag=self.name,
                )
                then: tuple[str, ...] = ()
            else:  # the all-reduce across replicas (hybrid_shard) waits for the reduce-scatter
                stage = collectives.reduce_scatter(
                    rows,
                    self.bound,
                    self.axes,
                    out=spare,
                    ledger=self.ledger,
                    tag=self.name,
                )
                then = replica
            self.memory.log("reduce", self.name)
            out.append(Reduction(k, stage, then, self.bound, self.ledger, self.name))
        return out

    def _materialize(self, part: Part) -> None:
        """Gives ``part.full`` its storage back (allocating it and the views the first time)."""
        nbytes = part.full_numel * part.compute_dtype.itemsize
        if part.full is None:
            device = self.flats[self.parts.index(part)].data.device
            part.full = torch.empty(part.full_numel, dtype=part.compute_dtype, device=device)
            offset = 0
            for slot in part.layout.slots:
                n = math.prod(slot.shape)
                part.views.append(part.full[offset : offset + n].view(slot.shape))
                offset += n
        elif part.full.untyped_storage().size() == 0:
            part.full.untyped_storage().resize_(nbytes)
        self.memory.add(nbytes)
