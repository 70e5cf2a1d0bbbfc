"""Binding a :class:`Mesh` to process groups: one per mesh axis, made by torch's ``DeviceMesh``.

Binding is collective: every rank binds the same meshes in the same order (as
``init_device_mesh`` and ``new_group`` require). Bound meshes are cached, so
later binds of an equal mesh are free and issue no collective.

[Note: weak process groups]
``torch.distributed`` owns its process groups; funcshard holds them, and the
``DeviceMesh`` that made them, by weak reference only. A ``DeviceMesh`` keeps
its groups alive, so a strong reference from a cache (or from a step a user
still holds) would keep a gloo group's worker threads running past
``destroy_process_group`` into interpreter shutdown, where a thread releasing
the last tensor of a finished collective needs the GIL and aborts the process
("terminate called without an active exception").
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import cast

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from funcshard._src.comm import channel, runtime
from funcshard._src.spec.mesh import Mesh


@dataclass(eq=False)
class BoundMesh:
    """A mesh tied to this process: its rank, and process groups over any set of axes.

    ``distributed`` is false outside a distributed run (a mesh of size 1).
    ``layout`` is the rank grid of the ``DeviceMesh`` that made the axis groups.
    """

    mesh: Mesh
    rank: int
    distributed: bool
    layout: list[object] = field(default_factory=list)
    _groups: dict[tuple[str, ...], weakref.ref[dist.ProcessGroup] | None] = field(
        default_factory=dict
    )
    # what :meth:`resolve` found, by axes: the group (weakly), its size and this rank's index
    # in it, for ``collectives.py`` to read without a call per collective
    resolved: dict[tuple[str, ...], tuple[weakref.ref[dist.ProcessGroup] | None, int, int]] = field(
        default_factory=dict
    )

    @property
    def coords(self) -> dict[str, int]:
        """This rank's coordinate along every axis."""
        return dict(zip(self.mesh.axis_names, self.mesh.coords(self.rank)))

    def group(self, axes: tuple[str, ...], /) -> dist.ProcessGroup | None:
        """The process group of this rank over ``axes`` (group ranks row-major over ``axes``).

        Returns ``None`` when the group has one rank: nothing to communicate.
        Collective the first time a multi-axis subset is asked for.

        Raises:
            RuntimeError: the group was destroyed (``destroy_process_group``).
        """
        if axes not in self._groups:
            self._groups[axes] = self._make_group(axes)
        ref = self._groups[axes]
        if ref is None:
            return None
        group = ref()
        if group is None:
            raise RuntimeError(
                f"the process group of mesh axes {list(axes)} was destroyed "
                f"(torch.distributed.destroy_process_group); initialize again and bind anew"
            )
        return group

    def resolve(self, axes: tuple[str, ...], /) -> tuple[dist.ProcessGroup | None, int, int]:
        """The group over ``axes`` (:meth:`group`), its size and :meth:`group_rank`; remembered in :attr:`resolved`.

        Raises:
            RuntimeError: the group was destroyed (``destroy_process_group``).
        """
        group = self.group(axes)
        size = math.prod(self.mesh.axis_size(a) for a in axes)
        rank = self.group_rank(axes)
        self.resolved[axes] = (None if group is None else weakref.ref(group), size, rank)
        return group, size, rank

    def group_rank(self, axes: tuple[str, ...], /) -> int:
        """This rank's index in the group over ``axes``: the row of a reduce-scatter's input it gets the sum of."""
        group = self.group(axes)
        return 0 if group is None else dist.get_group_rank(group, dist.get_rank())

    def _make_group(self, axes: tuple[str, ...]) -> weakref.ref[dist.ProcessGroup] | None:
        size = 1
        for a in axes:
            size *= self.mesh.axis_size(a)
        if size == 1 or not self.distributed:
            return None
        if axes == self.mesh.axis_names:  # the world: mesh order is rank order
            return weakref.ref(dist.distributed_c10d._get_default_group())
        group = dist.new_subgroups_by_enumeration(self.mesh.groups(list(axes)))[0]
        return weakref.ref(cast("dist.ProcessGroup", group))


_BOUND: dict[Mesh, tuple[weakref.ref[dist.ProcessGroup], BoundMesh]] = {}


def bind(mesh: Mesh, /) -> BoundMesh:
    """Binds ``mesh`` to this process's distributed run (collective on first use).

    Raises:
        ValueError: the mesh's size is not the world size; the message says how to fix it.
    """
    world_size = runtime.world_size()
    if mesh.size != world_size:
        hint = (
            "run under torchrun and call funcshard.init() first, or plan for a mesh of size 1"
            if not runtime.is_distributed()
            else f"make the product of the axis sizes {world_size}"
        )
        raise ValueError(
            f"{mesh!r} has {mesh.size} ranks but the world size is {world_size}; {hint}"
        )
    if not runtime.is_distributed():
        return BoundMesh(mesh, 0, distributed=False)
    world = dist.distributed_c10d._get_default_group()
    cached = _BOUND.get(mesh)
    if cached is not None and cached[0]() is world:
        return cached[1]
    channel.channel()  # before any other group, so that every rank makes its groups in one order
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    # the DeviceMesh makes one group per axis; see [Note: weak process groups]
    device_mesh = init_device_mesh(device_type, mesh.shape, mesh_dim_names=mesh.axis_names)
    bound = BoundMesh(mesh, runtime.rank(), distributed=True, layout=device_mesh.mesh.tolist())
    for axis in mesh.axis_names:
        if mesh.axis_size(axis) > 1 and (axis,) != mesh.axis_names:
            bound._groups[(axis,)] = weakref.ref(device_mesh.get_group(axis))
    _BOUND[mesh] = (weakref.ref(world), bound)  # a new default group (re-initialized) binds anew
    return bound
