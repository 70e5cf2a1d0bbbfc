r"""Layouts: where each leaf of a unit sits in the unit's flat buffer of one dtype, on every rank.

:func:`layouts` makes them from a plan: per unit and dtype (trainable before
frozen) one :class:`FlatLayout` of :class:`Slot`\ s. In the ``"leaf"`` layout a
slot is its leaf's padded chunk of its ``PartitionSpec``, at the same offset on
every rank; in the ``"flat"`` layout the unit's leaves are concatenated and each
group rank holds one equal range of the concatenation (:class:`FlatSharding`).
``flat.py`` packs and unpacks buffers of either.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from funcshard._src.plan.plan import LeafPlan, Plan
from funcshard._src.plan.strategy import shard_axes
from funcshard._src.plan.units import Unit
from funcshard._src.spec.flat_sharding import FlatSharding
from funcshard._src.spec.mesh import Mesh
from funcshard._src.spec.named_sharding import NamedSharding


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

    @property
    def numel(self) -> int:
        """Elements of the padded chunk."""
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
