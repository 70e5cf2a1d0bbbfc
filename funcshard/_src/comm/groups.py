"""Binding a :class:`Mesh` to process groups: one per mesh axis, via torch's ``DeviceMesh``.

Binding is collective: every rank binds the same meshes in the same order (as
``init_device_mesh`` and ``new_group`` require). Bound meshes are cached, so
later binds of an equal mesh are free and issue no collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from funcshard._src.comm import runtime
from funcshard._src.spec.mesh import Mesh


@dataclass(eq=False)
class BoundMesh:
    """A mesh tied to this process: its rank, and process groups over any set of axes.

    ``device_mesh`` is ``None`` outside a distributed run (a mesh of size 1).
    """

    mesh: Mesh
    rank: int
    device_mesh: DeviceMesh | None
    _groups: dict[tuple[str, ...], dist.ProcessGroup | None] = field(default_factory=dict)

    @property
    def coords(self) -> dict[str, int]:
        """This rank's coordinate along every axis."""
        return dict(zip(self.mesh.axis_names, self.mesh.coords(self.rank)))

    def group(self, axes: tuple[str, ...], /) -> dist.ProcessGroup | None:
        """The process group of this rank over ``axes`` (group ranks row-major over ``axes``).

        Returns ``None`` when the group has one rank: nothing to communicate.
        Collective the first time a multi-axis subset is asked for.
        """
        if axes in self._groups:
            return self._groups[axes]
        size = 1
        for a in axes:
            size *= self.mesh.axis_size(a)
        group: dist.ProcessGroup | None
        if size == 1 or self.device_mesh is None:
            group = None
        elif len(axes) == len(self.mesh.axis_names) and axes == self.mesh.axis_names:
            group = (
                dist.distributed_c10d._get_default_group()
            )  # the world: mesh order is rank order
        elif len(axes) == 1:
            group = self.device_mesh.get_group(axes[0])
        else:
            group = cast(
                "dist.ProcessGroup",
                dist.new_subgroups_by_enumeration(self.mesh.groups(list(axes)))[0],
            )
        self._groups[axes] = group
        return group


_BOUND: dict[tuple[Mesh, int], BoundMesh] = {}


def bind(mesh: Mesh, /) -> BoundMesh:
    """Binds ``mesh`` to this process's distributed run (collective on first use).

    Raises:
        ValueError: the mesh's size is not the world size; the message says how to fix it.
    """
    world = runtime.world_size()
    if mesh.size != world:
        hint = (
            "run under torchrun and call funcshard.init() first, or plan for a mesh of size 1"
            if not runtime.is_distributed()
            else f"make the product of the axis sizes {world}"
        )
        raise ValueError(f"{mesh!r} has {mesh.size} ranks but the world size is {world}; {hint}")
    if not runtime.is_distributed():
        return BoundMesh(mesh, 0, None)
    key = (mesh, id(dist.group.WORLD))
    bound = _BOUND.get(key)
    if bound is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        device_mesh = init_device_mesh(device_type, mesh.shape, mesh_dim_names=mesh.axis_names)
        bound = _BOUND[key] = BoundMesh(mesh, runtime.rank(), device_mesh)
    return bound
