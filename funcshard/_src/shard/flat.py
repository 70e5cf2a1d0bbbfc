"""Flat layouts: one unit's local shards of one dtype, packed in one buffer.

Every rank stores, per unit and dtype, a flat buffer of ``numel`` elements: each
leaf's padded chunk (:meth:`NamedSharding.shard_shape`) in leaf order. The size is
the same on every rank, so one ``all_gather_into_tensor`` of the flat buffers
yields a ``(world_size, numel)`` rank-major buffer from which
:func:`unpack_gathered` cuts every full leaf, and :func:`pack_all` is its
inverse for reduce-scatter.

[Note: padding]
Padding lives at the end of every padded dim of a chunk and is always zero in
parameters, gradients and optimizer state (zero gradients leave it zero under
SGD and AdamW). Ceil-div chunks make the padding of the *gathered* dim sit at
its end too, so narrowing the gathered dim to the leaf's size drops it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from funcshard._src.plan.plan import LeafPlan, Plan
from funcshard._src.spec.mesh import Mesh
from funcshard._src.spec.named_sharding import NamedSharding


@dataclass(frozen=True)
class Slot:
    """Where one leaf's padded chunk sits in its unit's flat buffer."""

    index: int  # position of the leaf in the plan's leaf order
    path: str
    shape: tuple[int, ...]  # global shape
    sharding: NamedSharding
    shard_shape: tuple[int, ...]  # padded chunk, equal on every rank
    offset: int

    @property
    def numel(self) -> int:
        """Elements of the padded chunk."""
        return math.prod(self.shard_shape)


@dataclass(frozen=True)
class FlatLayout:
    """The flat buffer of one unit and one dtype: its slots and size per rank."""

    unit: str
    dtype: torch.dtype
    mesh: Mesh
    slots: tuple[Slot, ...]
    numel: int  # per rank

    @property
    def nbytes(self) -> int:
        """Bytes of the flat buffer on one rank."""
        return self.numel * self.dtype.itemsize


def layouts(plan: Plan, /) -> tuple[FlatLayout, ...]:
    """The flat layouts of ``plan``: per unit in unit order, per dtype in leaf order.

    Example:
        >>> from funcshard._src.plan.plan import plan as make_plan
        >>> from funcshard._src.spec.mesh import Mesh
        >>> p = make_plan({"w": torch.zeros(10, 2), "b": torch.zeros(3)}, Mesh({"fsdp": 4}))
        >>> [(s.path, s.shard_shape, s.offset) for s in layouts(p)[0].slots]
        [('b', (1,), 0), ('w', (3, 2), 1)]
    """
    position = {leaf.path: i for i, leaf in enumerate(plan.leaves)}
    out: list[FlatLayout] = []
    for unit in plan.units:
        by_dtype: dict[torch.dtype, list[tuple[int, LeafPlan]]] = {}
        for path in unit.paths:
            i = position[path]
            by_dtype.setdefault(plan.leaves[i].dtype, []).append((i, plan.leaves[i]))
        for dtype, members in by_dtype.items():
            slots: list[Slot] = []
            offset = 0
            for index, leaf in members:
                sharding = leaf.sharding(plan.mesh)
                slot = Slot(
                    index, leaf.path, leaf.shape, sharding, sharding.shard_shape(leaf.shape), offset
                )
                slots.append(slot)
                offset += slot.numel
            out.append(FlatLayout(unit.name, dtype, plan.mesh, tuple(slots), offset))
    return tuple(out)


def pack_local(layout: FlatLayout, leaves: Sequence[torch.Tensor], rank: int, /) -> torch.Tensor:
    """``rank``'s flat buffer, shape ``(numel,)``, cut from the full ``leaves`` (slot order).

    Padding is zero. The result is a new tensor on the leaves' device.
    """
    flat = torch.zeros(layout.numel, dtype=layout.dtype, device=leaves[0].device)
    for slot, leaf in zip(layout.slots, leaves):
        local = leaf[slot.sharding.local_index(slot.shape, rank)]
        padded_view(flat, slot)[tuple(slice(0, n) for n in local.shape)].copy_(local)
    return flat


def padded_view(flat: torch.Tensor, slot: Slot, /) -> torch.Tensor:
    """The view of ``flat`` (one rank's buffer) holding ``slot``'s padded chunk."""
    return flat[slot.offset : slot.offset + slot.numel].view(slot.shard_shape)


def local_view(flat: torch.Tensor, slot: Slot, rank: int, /) -> torch.Tensor:
    """The view of ``flat`` holding ``rank``'s unpadded shard of ``slot``'s leaf."""
    local = slot.sharding.local_shape(slot.shape, rank)
    return padded_view(flat, slot)[tuple(slice(0, n) for n in local)]


def unpack_gathered(layout: FlatLayout, gathered: torch.Tensor, /) -> list[torch.Tensor]:
    """Every full leaf of ``layout``, cut from the rank-major ``(world_size, numel)`` buffer.

    The results are new tensors (one copy each); ``gathered`` is not kept.
    """
    return [
        _assemble(slot, layout.mesh, gathered[:, slot.offset : slot.offset + slot.numel])
        for slot in layout.slots
    ]


def pack_all(layout: FlatLayout, leaves: Sequence[torch.Tensor], /) -> torch.Tensor:
    """Every rank's flat buffer at once, ``(world_size, numel)``: the inverse of :func:`unpack_gathered`.

    ``leaves`` are full tensors in slot order (one per slot). A leaf replicated
    over some mesh axes is written into the rows of every replica, so a
    reduce-scatter of this buffer over all ranks sums each chunk over all ranks.
    """
    world = layout.mesh.size
    out = torch.zeros(world, layout.numel, dtype=layout.dtype, device=leaves[0].device)
    for slot, leaf in zip(layout.slots, leaves):
        out[:, slot.offset : slot.offset + slot.numel].copy_(
            _disassemble(slot, layout.mesh, leaf).reshape(world, -1)
        )
    return out


def _permutation(slot: Slot, mesh: Mesh) -> tuple[list[int], list[int]]:
    """Dims of ``(*mesh.shape, *shard_shape)`` reordered to (replica axes, then per dim its axes and itself)."""
    k = len(mesh.shape)
    dim_axes = slot.sharding.dim_axes(len(slot.shape))
    replica = [mesh.axis_index(a) for a in slot.sharding.replica_axes]
    order = list(replica)
    for dim, axes in enumerate(dim_axes):
        order += [mesh.axis_index(a) for a in axes] + [k + dim]
    return order, replica


def _assemble(slot: Slot, mesh: Mesh, block: torch.Tensor) -> torch.Tensor:
    order, replica = _permutation(slot, mesh)
    grid = block.reshape(*mesh.shape, *slot.shard_shape).permute(order)
    grid = grid[(0,) * len(replica)]  # replicas hold the same chunk
    padded = tuple(n * c for n, c in zip(slot.sharding.num_shards(slot.shape), slot.shard_shape))
    full = grid.reshape(padded)  # copies unless the layout is already contiguous
    return full[tuple(slice(0, n) for n in slot.shape)].clone(memory_format=torch.contiguous_format)


def _disassemble(slot: Slot, mesh: Mesh, leaf: torch.Tensor) -> torch.Tensor:
    """``(*mesh.shape, *shard_shape)``: every rank's padded chunk of the full ``leaf``."""
    order, replica = _permutation(slot, mesh)
    num_shards = slot.sharding.num_shards(slot.shape)
    padded = torch.zeros(
        [n * c for n, c in zip(num_shards, slot.shard_shape)], dtype=leaf.dtype, device=leaf.device
    )
    padded[tuple(slice(0, n) for n in slot.shape)] = leaf
    split: list[int] = [mesh.shape[i] for i in replica]
    for dim, axes in enumerate(slot.sharding.dim_axes(len(slot.shape))):
        split += [mesh.axis_size(a) for a in axes] + [slot.shard_shape[dim]]
    grid = padded.reshape(split[len(replica) :]).expand(split)
    inverse = [order.index(i) for i in range(len(order))]
    return grid.permute(inverse)
