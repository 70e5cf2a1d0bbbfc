"""A unit's partial copy on this rank: the rows it keeps, the axes it is re-gathered over, its storage.

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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from funcshard._src.comm import collectives
from funcshard._src.comm.groups import BoundMesh
from funcshard._src.execute.memory import GatheredMemory
from funcshard._src.execute.part import Part
from funcshard._src.plan.strategy import partial_axes, partial_copy_lifetime
from funcshard._src.plan.units import Unit


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
