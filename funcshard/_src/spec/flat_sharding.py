"""FlatSharding: a leaf's place in a unit stored in the flat layout (FSDP1 / ZeRO style).

In the flat layout a unit's leaves of one dtype are flattened and concatenated
in leaf order, the concatenation is zero-padded to a multiple of the group size
and every rank of the group holds one contiguous range of ``chunk`` elements of
it, rank-major over the sharding ``axes``. A leaf therefore lives in one or
more ranks' ranges, cut at any element, not only at a row: what a rank holds of
a leaf is a range of its row-major elements, which :func:`range_boxes` cuts
into at most ``2 * ndim - 1`` boxes (for checkpoints and sliced reads).

This is funcshard's extension: no ``PartitionSpec`` expresses it, so a leaf in a
flat unit keeps a spec only as its JAX counterpart (``Plan.to_jax_shardings``).
Along mesh axes outside ``axes`` the ranges are replicated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from funcshard._src.spec.mesh import Mesh

Shape = tuple[int, ...]
Index = tuple[slice, ...]


@dataclass(frozen=True)
class FlatSharding:
    """A leaf of ``size`` elements at ``start`` of its unit's concatenation, in ranges of ``chunk`` per rank.

    Example:
        >>> s = FlatSharding(Mesh({"fsdp": 2}), ("fsdp",), start=4, size=6, chunk=5)
        >>> [s.local_range(r) for r in range(2)]  # elements 4..9 of the unit: 4 on rank 0, 5..9 on rank 1
        [(0, 1), (1, 6)]
        >>> s.boxes((2, 3), 1)
        ((slice(0, 1, None), slice(1, 3, None)), (slice(1, 2, None), slice(0, 3, None)))
    """

    mesh: Mesh
    axes: tuple[str, ...]  # the axes the concatenation is split over, major first
    start: int  # where the leaf starts in the unit's concatenation
    size: int  # the leaf's elements
    chunk: int  # elements of the concatenation per group rank
    base: int = 0  # where the buffer holding the leaf starts in the concatenation (a mask's run)

    @property
    def group_size(self) -> int:
        """Ranks the concatenation is split over."""
        return math.prod(self.mesh.axis_size(a) for a in self.axes)

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """Mesh axes along which every range is replicated."""
        return tuple(a for a in self.mesh.axis_names if a not in self.axes)

    def group_rank(self, rank: int, /) -> int:
        """``rank``'s row-major index over :attr:`axes`: which range of the concatenation it holds."""
        return _index(self.mesh, self.axes, rank)

    def range_start(self, rank: int, /) -> int:
        """Where ``rank``'s range of ``chunk`` elements starts in the unit's concatenation."""
        return self.group_rank(rank) * self.chunk

    def replica_id(self, rank: int, /) -> int:
        """Which copy of its range ``rank`` holds: its row-major index over :attr:`replica_axes`."""
        return _index(self.mesh, self.replica_axes, rank)

    def local_range(self, rank: int, /) -> tuple[int, int]:
        """The [start, stop) of the leaf's row-major elements ``rank`` holds (empty: ``start == stop``)."""
        lo = self.range_start(rank)
        a = min(max(self.start, lo), self.start + self.size)
        b = max(min(self.start + self.size, lo + self.chunk), a)
        return a - self.start, b - self.start

    def local_offset(self, rank: int, /) -> int:
        """Where the leaf's local elements start in ``rank``'s flat buffer (meaningful when it holds some).

        The buffer is the rank's range of the concatenation from :attr:`base` on.
        """
        lo = self.range_start(rank)
        return max(self.start, lo) - max(self.base, lo)

    def local_shape(self, shape: Shape, rank: int, /) -> Shape:
        """The local shard's shape: ``(elements held,)``, the shard is one flat range."""
        a, b = self.local_range(rank)
        return (b - a,)

    def boxes(self, shape: Shape, rank: int, /) -> tuple[Index, ...]:
        """The boxes of the global leaf ``rank`` holds, in row-major order (see :func:`range_boxes`)."""
        return range_boxes(shape, *self.local_range(rank))


def range_boxes(shape: Shape, start: int, stop: int, /) -> tuple[Index, ...]:
    """The row-major elements ``[start, stop)`` of a tensor of ``shape``, as boxes in order.

    Each box is contiguous in row-major order and the boxes follow each other, so
    the range is their elements concatenated. At most ``2 * ndim - 1`` boxes.

    Example:
        >>> range_boxes((3, 4), 2, 11)
        ((slice(0, 1, None), slice(2, 4, None)), (slice(1, 2, None), slice(0, 4, None)), (slice(2, 3, None), slice(0, 3, None)))
        >>> range_boxes((), 0, 1), range_boxes((5,), 3, 3)
        (((),), ())
    """
    if start >= stop:
        return ()
    if not shape:
        return ((),)
    inner = math.prod(shape[1:])
    full = tuple(slice(0, n) for n in shape[1:])
    first, last = start // inner, (stop - 1) // inner
    if first == last:  # within one row of dim 0
        row = slice(first, first + 1)
        base = first * inner
        return tuple((row, *box) for box in range_boxes(shape[1:], start - base, stop - base))
    out: list[Index] = []
    lo = first
    if start % inner:  # a partial first row
        out.extend(
            (slice(first, first + 1), *b) for b in range_boxes(shape[1:], start % inner, inner)
        )
        lo = first + 1
    hi = last + 1 if stop % inner == 0 else last
    if hi > lo:
        out.append((slice(lo, hi), *full))
    if stop % inner:  # a partial last row
        out.extend((slice(last, last + 1), *b) for b in range_boxes(shape[1:], 0, stop % inner))
    return tuple(out)


def box_shape(box: Index, /) -> Shape:
    """The shape of a box of :func:`range_boxes` (its slices have explicit bounds)."""
    return tuple(s.stop - s.start for s in box)


def _index(mesh: Mesh, axes: tuple[str, ...], rank: int) -> int:
    coords = dict(zip(mesh.axis_names, mesh.coords(rank)))
    i = 0
    for axis in axes:
        i = i * mesh.axis_size(axis) + coords[axis]
    return i
