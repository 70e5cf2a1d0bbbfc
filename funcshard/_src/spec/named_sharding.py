"""NamedSharding: which slice of a leaf each rank holds, for a mesh and a spec.

For every case JAX accepts, :meth:`NamedSharding.indices` equals JAX's
``NamedSharding.devices_indices_map`` with device id = rank. Dims that do not
divide by their shard count are funcshard's extension (JAX refuses them for
arrays): the dim is cut into ceil-div chunks with the padding at the end, the
layout of ``torch.chunk`` and of XLA's padded shardings, so 10 over 4 gives
3, 3, 3, 1 and 3 over 4 gives 1, 1, 1, 0. Every rank stores its chunk padded to
the full chunk size (:meth:`NamedSharding.shard_shape`), so flat buffers have
the same size on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from funcshard._src.spec.mesh import Mesh
from funcshard._src.spec.partition_spec import P, SpecError

Shape = tuple[int, ...]
Index = tuple[slice, ...]


@dataclass(frozen=True)
class NamedSharding:
    """A leaf's placement: ``spec`` over ``mesh``.

    Example:
        >>> s = NamedSharding(Mesh({"fsdp": 4}), P("fsdp"))
        >>> [s.local_shape((10, 3), r) for r in range(4)]
        [(3, 3), (3, 3), (3, 3), (1, 3)]
        >>> s.shard_shape((10, 3))
        (3, 3)
    """

    mesh: Mesh
    spec: P

    def dim_axes(self, ndim: int, /) -> tuple[tuple[str, ...], ...]:
        """Per dim, the mesh axes that split it, major first."""
        return self.spec.dims(ndim)

    def num_shards(self, shape: Shape, /) -> tuple[int, ...]:
        """Per dim, how many chunks it is cut into."""
        return tuple(
            math.prod(self.mesh.axis_size(a) for a in axes) for axes in self.dim_axes(len(shape))
        )

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """Mesh axes the spec does not name: the leaf is replicated along them."""
        used = set(self.spec.axes)
        return tuple(a for a in self.mesh.axis_names if a not in used)

    def validate(self, shape: Shape, /, *, path: str = "", strict: bool = False) -> None:
        """Checks the spec against ``shape`` on this mesh.

        Raises:
            SpecError: see :meth:`P.validate`; with ``strict``, also a dim that its
                shard count does not divide (``kind="uneven"``), as JAX refuses it.
        """
        self.spec.validate(self.mesh, len(shape), path=path)
        if strict:
            for dim, (size, n) in enumerate(zip(shape, self.num_shards(shape))):
                if size % n:
                    where = f"{path}: " if path else ""
                    raise SpecError(
                        f"{where}{self.spec!r} cuts dim {dim} of shape {shape} into {n} shards, "
                        f"which do not divide {size}; pad the dim or pass strict=False "
                        f"for ceil-div chunks",
                        kind="uneven",
                    )

    def shard_shape(self, shape: Shape, /) -> Shape:
        """The padded chunk every rank stores: ``ceil(size / shards)`` per dim."""
        return tuple(-(-size // n) for size, n in zip(shape, self.num_shards(shape)))

    def chunk_index(self, ndim: int, rank: int, /) -> tuple[int, ...]:
        """Per dim, which chunk ``rank`` holds (0 for dims that are not split)."""
        coords = dict(zip(self.mesh.axis_names, self.mesh.coords(rank)))
        index: list[int] = []
        for axes in self.dim_axes(ndim):
            i = 0
            for axis in axes:
                i = i * self.mesh.axis_size(axis) + coords[axis]
            index.append(i)
        return tuple(index)

    def local_index(self, shape: Shape, rank: int, /) -> Index:
        """The slices of the global leaf that ``rank`` holds (JAX's form)."""
        self.spec.validate(self.mesh, len(shape))
        out: list[slice] = []
        chunks = self.shard_shape(shape)
        for size, n, chunk, i in zip(
            shape, self.num_shards(shape), chunks, self.chunk_index(len(shape), rank)
        ):
            if n == 1:
                out.append(slice(None))
            else:
                out.append(slice(min(i * chunk, size), min((i + 1) * chunk, size)))
        return tuple(out)

    def local_shape(self, shape: Shape, rank: int, /) -> Shape:
        """The unpadded shape of ``rank``'s shard."""
        return tuple(
            len(range(*s.indices(size))) for s, size in zip(self.local_index(shape, rank), shape)
        )

    def indices(self, shape: Shape, /, *, strict: bool = False) -> dict[int, Index]:
        """Every rank's slices of a leaf of ``shape``: JAX's ``devices_indices_map``.

        Args:
            shape: the global shape of the leaf.
            strict: refuse dims that their shard count does not divide, as JAX does.

        Raises:
            SpecError: the spec does not fit ``shape`` or the mesh (see :meth:`validate`).

        Example:
            >>> s = NamedSharding(Mesh({"dp": 2, "fsdp": 2}), P("fsdp"))
            >>> s.indices((4,))
            {0: (slice(0, 2, None),), 1: (slice(2, 4, None),), 2: (slice(0, 2, None),), 3: (slice(2, 4, None),)}
        """
        self.validate(shape, strict=strict)
        return {rank: self.local_index(shape, rank) for rank in range(self.mesh.size)}

    def replica_id(self, rank: int, /) -> int:
        """Which copy of its chunk ``rank`` holds: its row-major index over :attr:`replica_axes`."""
        coords = dict(zip(self.mesh.axis_names, self.mesh.coords(rank)))
        i = 0
        for axis in self.replica_axes:
            i = i * self.mesh.axis_size(axis) + coords[axis]
        return i
