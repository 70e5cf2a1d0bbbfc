"""One unit on this rank: its shards, its gathered storage, and the states between them.

A unit is SHARDED, GATHERING (an all-gather in flight) or GATHERED.

[Note: a unit's state is moved by its group alone]
The unit's parameter group (``param_group.py``) issues and waits for the
collectives and calls the transitions here (``mark_gathering``, ``mark_gathered``,
``hold``, ``unhold``, ``free``, ...), each of which checks the state it comes from
(docs/executor.md draws them), but for ``drop_holders`` (any state: it changes no
state) and ``reset_after_error`` (any state to SHARDED, after an error); no other
module calls them, and only this one assigns ``state`` (``tests/test_layering.py``).
A transition from the wrong state is an internal error (:class:`UnitStateError`),
never silently allowed. A unit
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
``unit_state.py``).

[Note: aliased units]
A part that needs no collective and no cast (``no_shard`` without mixed
precision, or any unit on a mesh of one rank) has full leaves that are exactly
its flat shard: the full views alias the shard and freeing is a no-op.

The bytes of gathered parameters alive on this rank are counted here as units
move (:class:`GatheredMemory`); a unit's dtypes are its :class:`Part` s, and a
unit that keeps a partial copy holds it in a :class:`PartialCopy`.

[Note: a partial copy on the executor]
A ``partial_reshard`` or ``hybrid_shard_optimizer`` unit keeps a partial copy
([Note: partial copies] in ``plan/strategy.py``): the gathered rows of the ranks
that share its coordinate on the last mesh axis, one buffer per part
(``Part.partial``, in the compute dtype, its storage resized to zero when freed
and kept for the next time, as ``Part.full`` is). The unit's parameter group copies it
out of the first gather's rows (:meth:`PartialCopy.keep`); it outlives the unit's
``free``, and while it is :attr:`~PartialCopy.held` the unit's next gather is an
all-gather of the copy over :attr:`~PartialCopy.regather_axes` alone, through a
staging buffer whose rows come row-major over :attr:`~PartialCopy.order` (the last
axis major): a flat part, or one gathered in place elsewhere, is filled from it by
one transposing copy, any other unpacked in that order. Such units never gather
leaf by leaf, so the rows of the first gather are always there to copy from.
[Note: what a release keeps] in ``run.py`` says which release frees it.

Large gathered storages go on transparent huge pages, where Linux offers them
on request.

[Note: huge pages for gathered storage]
A unit's gathered storage is given back when the unit is freed and allocated again
at its next gather ([Note: persistent gathered storage] in ``unit_state.py``). An
allocation as large as a root unit's embeddings (tens to hundreds of MiB) is a
fresh mapping under glibc, whose every 4 KiB page the gather then faults in: on
the benchmark machine 163 MiB took 69 ms to fill fresh against 27 ms warm. Linux
set to give transparent huge pages on request (``madvise`` in
``/sys/kernel/mm/transparent_hugepage/enabled``, the common default) faults such a
range in 2 MiB at a time when asked (``MADV_HUGEPAGE``): 36 ms. The storage is
written whole by its gather, so huge pages hold no byte more than it uses, and
they go back with it. Only CPU storages of at least ``MIN_BYTES`` are advised;
where the call is missing or refused nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import functools
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from funcshard._src.comm import collectives
from funcshard._src.comm.collectives import Ledger
from funcshard._src.comm.groups import BoundMesh
from funcshard._src.plan.precision import MixedPrecision
from funcshard._src.plan.quantize import Format, Quantized
from funcshard._src.plan.strategy import (
    keeps_for_step,
    partial_axes,
    partial_copy_lifetime,
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
    unpacker,
)
from funcshard._src.shard.sharded import FlatShard
from funcshard._src.spec.flat_sharding import FlatSharding

MIN_BYTES = 8 << 20
_HUGE = 2 << 20
_MADV_HUGEPAGE = 14


def _bind() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    call.restype = ctypes.c_int
    return call


_MADVISE = _bind()


def advise(storage: torch.Tensor, /) -> bool:
    """Asks for huge pages under the whole 2 MiB pages of ``storage``'s memory; whether it was asked.

    Call it before the memory is first written. A refusal (no THP, another OS)
    changes nothing.

    Example:
        >>> advise(torch.empty(4))  # too small to ask
        False
    """
    nbytes = storage.numel() * storage.element_size()
    if _MADVISE is None or storage.device.type != "cpu" or nbytes < MIN_BYTES:
        return False
    start = storage.data_ptr()
    lo = -(-start // _HUGE) * _HUGE
    hi = (start + nbytes) // _HUGE * _HUGE
    return hi > lo and _MADVISE(lo, hi - lo, _MADV_HUGEPAGE) == 0


# -- gathered memory ------------------------------------------------------------------


@dataclass
class GatheredMemory:
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


# -- a unit's parts ------------------------------------------------------------------


@dataclass(eq=False)
class Part:
    """One dtype of a unit: its layout, persistent full storage and full leaf views."""

    layout: FlatLayout
    compute_dtype: torch.dtype
    grad_dtype: torch.dtype
    aliased: bool
    in_place: bool  # gathered straight into ``full``; see [Note: persistent gathered storage]
    full: torch.Tensor | None = None  # persistent, see [Note: persistent gathered storage]
    views: list[torch.Tensor] = field(default_factory=list)
    # the partial copy, (copy rows * numel,) in the compute dtype: [Note: a partial copy on the executor] in
    # unit_state.py; kept across frees like ``full``, its storage resized to zero
    partial: torch.Tensor | None = None
    # fills ``views`` from a gathered (group_size, numel) buffer: shard/flat.py's unpacker,
    # made with the views
    unpack: Callable[[torch.Tensor], None] | None = None

    @property
    def by_leaf(self) -> bool:
        """Whether the part is gathered in place with one collective per leaf (``Capabilities.gathers_leaf_by_leaf``)."""
        return self.in_place and len(self.layout.slots) > 1 and not self.layout.flat

    @functools.cached_property
    def full_numel(self) -> int:
        """Elements of all full leaves of this part (a flat part's: its gathered concatenation)."""
        sharding = self.layout.slots[0].sharding if self.layout.slots else None
        if isinstance(sharding, FlatSharding):
            return self.layout.numel * sharding.group_size  # the end padding included
        return sum(math.prod(s.shape) for s in self.layout.slots)

    def free(self, unit: str, /) -> None:
        """Gives the gathered storage's bytes back (resized to zero, kept for the next gather); mutates.

        Raises:
            RuntimeError: code outside torch holds the memory (numpy), naming the unit and the fix.
        """
        assert self.full is not None
        try:
            self.full.untyped_storage().resize_(0)
        except RuntimeError as e:
            if "not resizable" not in str(e):
                raise
            raise RuntimeError(
                f"unit {unit!r}: its gathered parameters cannot be freed, because code outside "
                f"torch holds their memory: w.detach().numpy() or np.asarray(w) of a parameter "
                f"in forward shares it with numpy. Fix: copy it out (w.detach().numpy().copy(), "
                f"w.tolist()) before numpy uses it"
            ) from None

    @functools.cached_property
    def full_bytes(self) -> int:
        """Bytes of this part's gathered storage (none of its own when aliased)."""
        return 0 if self.aliased else self.full_numel * self.compute_dtype.itemsize


# -- a partial copy ---------------------------------------------------------------------


class PartialCopy:
    """One unit's partial copy on this rank; see [Note: a partial copy on the executor]."""

    def __init__(self, unit: Unit, bound: BoundMesh, memory: GatheredMemory) -> None:
        regather, replicated = partial_axes(unit.strategy, bound.mesh)
        self.name = unit.name
        self.memory = memory
        self.regather_axes = regather
        self.rows = collectives.group_size(bound, replicated)  # the shards in the copy
        self.regather_size = collectives.group_size(bound, regather)
        # "call", "step", or None: the unit keeps no copy (the root, one axis, one rank)
        self.lifetime = partial_copy_lifetime(unit.strategy, bound.mesh, is_root=unit.is_root)
        # the gathered rows are row-major over the mesh axes, the last (regather) one minor:
        # the copy is the rows of this rank's index on it; a regather's rows come row-major
        # over ``order``
        self.index = bound.coords[regather[0]] if regather else 0
        self.order = regather + replicated
        self.held = False
        self.in_flight = False  # the unit's all-gather in flight is of this copy

    @property
    def for_step(self) -> bool:
        """Whether the copy is kept across micro-batches (``hybrid_shard_optimizer``)."""
        return self.lifetime == "step"

    def keep(self, part: Part, rows: torch.Tensor, /) -> None:
        """Copies this rank's copy out of ``part``'s gathered ``(group_size, numel)`` rows; mutates ``part``."""
        n = self.rows * part.layout.numel
        if part.partial is None:
            part.partial = torch.empty(n, dtype=part.compute_dtype, device=rows.device)
        elif part.partial.untyped_storage().size() == 0:
            part.partial.untyped_storage().resize_(n * part.compute_dtype.itemsize)
        grid = rows.view(self.rows, self.regather_size, -1)
        with torch.no_grad():
            part.partial.view(self.rows, -1).copy_(grid[:, self.index])
        self.memory.add(self.nbytes(part))

    def free(self, parts: Sequence[Part], /) -> None:
        """Releases every part's copy, held or half taken (after an error); mutates."""
        if self.lifetime is None:  # never taken: nothing to look at on the hot path
            return
        for part in parts:
            if part.partial is not None and part.partial.untyped_storage().size():
                part.partial.untyped_storage().resize_(0)
                self.memory.sub(self.nbytes(part))
        if self.held:
            self.memory.log("free_partial", self.name)
        self.held = False

    def nbytes(self, part: Part, /) -> int:
        """Bytes of ``part``'s copy: ``rows`` shards in the compute dtype."""
        return self.rows * part.layout.numel * part.compute_dtype.itemsize


# -- a unit ---------------------------------------------------------------------------


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
        # [Note: two-hop reductions] in param_group.py: a unit that keeps its copy for
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
        # one rank, no cast: no autograd node of its own; [Note: local-only calls] in call_record.py
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
            part.unpack = unpacker(part.layout, part.views, self.axes)
            advise(part.full)
        elif part.full.untyped_storage().size() == 0:
            part.full.untyped_storage().resize_(part.full_bytes)
            advise(
                part.full
            )  # [Note: huge pages for gathered storage] in ``execute/unit_state.py``
        self.memory.add(part.full_bytes)
        return part.full

    def forget(self, part: Part, /) -> None:
        """Drops an in-place part's storage without freeing it: a collective may still write into it."""
        part.full, part.views, part.unpack = None, [], None
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
