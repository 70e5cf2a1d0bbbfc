r"""Layouts: where each leaf of a unit sits in the unit's flat buffer of one dtype, on every rank.

:func:`layouts` makes them from a plan: per unit and dtype (trainable before
frozen) one :class:`FlatLayout` of :class:`Slot`\ s. In the ``"leaf"`` layout a
slot is its leaf's padded chunk of its ``PartitionSpec``, at the same offset on
every rank; in the ``"flat"`` layout the unit's leaves are concatenated and each
group rank holds one equal range of the concatenation (:class:`FlatSharding`).
:func:`pieces` is what a rank holds of a leaf, in either layout, as views of its
buffer. ``flat.py`` packs and unpacks buffers of either.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from funcshard._src.plan.plan import LeafPlan, Plan
from funcshard._src.plan.strategy import shard_axes
from funcshard._src.plan.units import Unit
from funcshard._src.spec.flat_sharding import FlatSharding, box_shape
from funcshard._src.spec.mesh import Mesh
from funcshard._src.spec.named_sharding import Index, NamedSharding


@dataclass(frozen=True)
class Slot:
    """Where one leaf's padded chunk sits in its unit's flat buffer.

    In a flat unit (``sharding`` a :class:`FlatSharding`) ``offset`` is where the
    leaf starts in the unit's concatenation and ``shard_shape`` is ``(numel,)``:
    where it sits in one rank's buffer depends on the rank (:func:`local_view`).
    """

    index: int  # position of the leaf in the plan's leaf order
    path: str
    shape: tuple[int, ...]  # global shape
    sharding: NamedSharding | FlatSharding
    shard_shape: tuple[int, ...]  # padded chunk, equal on every rank
    offset: int

    @functools.cached_property
    def numel(self) -> int:
        """Elements of the padded chunk (worked out once: packing reads it per slot, per step)."""
        return math.prod(self.shard_shape)


@dataclass(frozen=True)
class FlatLayout:
    """The flat buffer of one unit and one dtype (trainable or frozen): its slots and size per rank."""

    unit: str
    dtype: torch.dtype
    mesh: Mesh
    slots: tuple[Slot, ...]
    numel: int  # per rank
    frozen: bool = False  # its leaves get no gradient and no optimizer state
    flat: bool = False  # the flat layout: every slot's sharding is a FlatSharding

    def __hash__(self) -> int:  # gradients are keyed by layout: hash the slots once
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:
        return hash(
            (self.unit, self.dtype, self.mesh, self.slots, self.numel, self.frozen, self.flat)
        )

    @functools.cached_property
    def derived(self) -> dict[object, object]:
        """What packing works out from this layout once (``shard/flat.py``), by what it is for; not part of its value.

        Held on the layout, not in a cache keyed by it: a step looks it up per
        collective, and hashing a layout is a Python call.
        """
        return {}

    @property
    def nbytes(self) -> int:
        """Bytes of the flat buffer on one rank."""
        return self.numel * self.dtype.itemsize


def layouts(plan: Plan, /) -> tuple[FlatLayout, ...]:
    """The flat layouts of ``plan``: per unit in unit order, per dtype in leaf order.

    Frozen leaves of a unit get flat buffers of their own, after the trainable
    ones, so that gradients and optimizer state cover whole buffers.

    Example:
        >>> from funcshard._src.plan.planner import plan as make_plan
        >>> from funcshard._src.spec.mesh import Mesh
        >>> p = make_plan({"w": torch.zeros(10, 2), "b": torch.zeros(3)}, Mesh({"fsdp": 4}))
        >>> [(s.path, s.shard_shape, s.offset) for s in layouts(p)[0].slots]
        [('b', (1,), 0), ('w', (3, 2), 1)]
    """
    position = {leaf.path: i for i, leaf in enumerate(plan.leaves)}
    out: list[FlatLayout] = []
    for unit in plan.units:
        by_dtype: dict[tuple[bool, torch.dtype], list[tuple[int, LeafPlan]]] = {}
        for path in unit.paths:
            i = position[path]
            key = (plan.leaves[i].frozen, plan.leaves[i].dtype)
            by_dtype.setdefault(key, []).append((i, plan.leaves[i]))
        for (frozen, dtype), members in sorted(by_dtype.items(), key=lambda kv: kv[0][0]):
            if unit.layout == "flat":
                out.append(_flat_layout(plan, unit, dtype, frozen, members))
                continue
            slots: list[Slot] = []
            offset = 0
            for index, leaf in members:
                sharding = leaf.sharding(plan.mesh)
                slot = Slot(
                    index, leaf.path, leaf.shape, sharding, sharding.shard_shape(leaf.shape), offset
                )
                slots.append(slot)
                offset += slot.numel
            out.append(FlatLayout(unit.name, dtype, plan.mesh, tuple(slots), offset, frozen))
    return tuple(out)


def _flat_layout(
    plan: Plan, unit: Unit, dtype: torch.dtype, frozen: bool, members: list[tuple[int, LeafPlan]]
) -> FlatLayout:
    """The flat layout of one part: its leaves concatenated, one equal range per group rank."""
    axes = shard_axes(unit.strategy, plan.mesh)
    group = math.prod(plan.mesh.axis_size(a) for a in axes)
    chunk = -(-sum(leaf.numel for _, leaf in members) // group)
    slots: list[Slot] = []
    offset = 0
    for index, leaf in members:
        sharding = FlatSharding(plan.mesh, axes, offset, leaf.numel, chunk)
        slots.append(Slot(index, leaf.path, leaf.shape, sharding, (leaf.numel,), offset))
        offset += leaf.numel
    return FlatLayout(unit.name, dtype, plan.mesh, tuple(slots), chunk, frozen, flat=True)


def whole_chunk(layout: FlatLayout, data: torch.Tensor, rank: int, /) -> torch.Tensor:
    """``data`` as ``rank``'s whole range of its flat unit's concatenation, for collectives.

    A mask's run of a flat unit (``optim/select.py``) holds only the part of the
    range its leaves cover, which differs between ranks; this pads it with zeros to
    the ``numel`` every rank gathers. Other buffers come back as they are.
    """
    if not layout.flat or data.numel() == layout.numel or not layout.slots:
        return data
    sharding = layout.slots[0].sharding
    assert isinstance(sharding, FlatSharding)
    lo = sharding.range_start(rank)
    at = min(max(sharding.base - lo, 0), layout.numel)
    out = data.new_zeros(layout.numel)
    out[at : at + data.numel()] = data
    return out


def piece_indices(slot: Slot, rank: int, /) -> list[Index]:
    """The indices into the global leaf of :func:`pieces`, without a buffer (for any rank)."""
    sharding = slot.sharding
    if isinstance(sharding, NamedSharding):
        return [sharding.local_index(slot.shape, rank)]
    return list(sharding.boxes(slot.shape, rank))


def pieces(flat: torch.Tensor, slot: Slot, rank: int, /) -> list[tuple[Index, torch.Tensor]]:
    """What ``rank`` holds of ``slot``'s leaf: ``(index into the global leaf, view of flat)`` pairs.

    One pair in the leaf layout (the shard's slices and its unpadded view, possibly
    empty); in the flat layout one per box of the rank's range (none for a leaf
    the rank holds nothing of). Writing to a view writes ``flat``.
    """
    sharding = slot.sharding
    if isinstance(sharding, NamedSharding):
        return [(sharding.local_index(slot.shape, rank), local_view(flat, slot, rank))]
    out: list[tuple[Index, torch.Tensor]] = []
    at = sharding.local_offset(rank)
    for box in piece_indices(slot, rank):
        shape = box_shape(box)
        n = math.prod(shape)
        out.append((box, flat[at : at + n].view(shape)))
        at += n
    return out


def padded_view(flat: torch.Tensor, slot: Slot, /) -> torch.Tensor:
    """The view of ``flat`` (one rank's buffer) holding ``slot``'s padded chunk (the leaf layout).

    Raises:
        TypeError: ``slot`` is in the flat layout, whose place in a buffer depends on
            the rank: use :func:`local_view` or :func:`pieces`.
    """
    if isinstance(slot.sharding, FlatSharding):
        raise TypeError(f"{slot.path}: a flat-layout slot has no padded chunk; use local_view")
    return flat[slot.offset : slot.offset + slot.numel].view(slot.shard_shape)


def local_view(flat: torch.Tensor, slot: Slot, rank: int, /) -> torch.Tensor:
    """The view of ``flat`` holding ``rank``'s unpadded shard of ``slot``'s leaf.

    In the flat layout that is the 1-D range of the leaf's elements the rank holds.
    """
    sharding = slot.sharding
    if isinstance(sharding, FlatSharding):
        a, b = sharding.local_range(rank)
        at = sharding.local_offset(rank)
        return flat[at : at + b - a]
    local = sharding.local_shape(slot.shape, rank)
    return padded_view(flat, slot)[tuple(slice(0, n) for n in local)]


def local_range(slot: Slot, rank: int, /) -> tuple[int, int]:
    """The [start, stop) of ``rank``'s flat buffer that holds ``slot``'s leaf (padding included)."""
    sharding = slot.sharding
    if isinstance(sharding, FlatSharding):
        a, b = sharding.local_range(rank)
        at = sharding.local_offset(rank) if b > a else 0
        return at, at + b - a
    return slot.offset, slot.offset + slot.numel
