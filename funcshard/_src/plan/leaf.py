"""One leaf's placement: its path, shape, dtype, spec, unit and whether it is frozen."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from funcshard._src.spec.mesh import Mesh
from funcshard._src.spec.named_sharding import NamedSharding
from funcshard._src.spec.partition_spec import P


@dataclass(frozen=True)
class LeafPlan:
    """One leaf's placement: path, global shape, dtype, spec, unit, and whether it is frozen.

    A frozen leaf is sharded, gathered and freed like any other, but gets no
    gradient and no optimizer state.
    """

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    spec: P
    unit: str
    frozen: bool = False

    def sharding(self, mesh: Mesh, /) -> NamedSharding:
        """The leaf's :class:`NamedSharding` on ``mesh``."""
        return NamedSharding(mesh, self.spec)

    @property
    def numel(self) -> int:
        """Elements of the whole leaf."""
        n = 1
        for size in self.shape:
            n *= size
        return n

    @property
    def trained(self) -> bool:
        """Whether the leaf gets a gradient and optimizer state: floating point and not frozen."""
        return self.dtype.is_floating_point and not self.frozen

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize
