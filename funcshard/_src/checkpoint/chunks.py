"""Chunk geometry: the pieces a leaf is saved in, and which of them a rank needs.

A sharded leaf is saved as one chunk per distinct non-empty shard (replica 0's
rank writes it), a plain tensor as one chunk written by rank 0. A chunk is a
box of the leaf: its offsets and sizes per dim. A leaf of a flat unit is held
as ranges of its elements, each saved as the boxes that cut it
(``spec/flat_sharding.range_boxes``), so the format and resharding are the same
for both layouts. The chunks of a leaf must tile it exactly, every element
once: :func:`check_tiling` refuses a manifest whose chunks leave a gap (rows
that would come back as zeros), overlap, or stick out.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from funcshard._src.checkpoint.errors import UnsafeCheckpointError
from funcshard._src.shard.flat import piece_indices, pieces
from funcshard._src.shard.sharded import ShardedTensor

Region = tuple[tuple[int, int], ...]  # [start, stop) per dim


@dataclass(frozen=True)
class Chunk:
    """One saved piece of a leaf: its DCP key, where it sits in the leaf, and who wrote it."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    writer: int  # the rank that wrote it

    @property
    def numel(self) -> int:
        """Elements in the chunk."""
        return math.prod(self.sizes)


def chunk_key(path: str, offsets: tuple[int, ...], /) -> str:
    """The DCP key of the chunk of leaf ``path`` that starts at ``offsets``.

    Example:
        >>> chunk_key("blocks/0/w", (2, 0))
        'blocks/0/w@2,0'
    """
    return f"{path}@{','.join(map(str, offsets))}"


def chunks_of(leaf: Any, path: str, /) -> list[Chunk]:
    """Every chunk ``leaf`` is saved in: one per distinct non-empty shard (replica 0 writes it)."""
    if isinstance(leaf, ShardedTensor):
        out: list[Chunk] = []
        sharding = leaf.sharding
        for rank in range(sharding.mesh.size):
            if sharding.replica_id(rank) != 0:
                continue
            for region in regions_of(leaf, rank):
                offsets = tuple(a for a, _ in region)
                sizes = tuple(b - a for a, b in region)
                if all(sizes):
                    out.append(Chunk(chunk_key(path, offsets), offsets, sizes, rank))
        return out
    shape = tuple(leaf.shape)
    offsets = (0,) * len(shape)
    return [Chunk(chunk_key(path, offsets), offsets, shape, 0)] if all(shape) else []


def regions_of(leaf: ShardedTensor, rank: int, /) -> list[Region]:
    """The boxes, [start, stop) per dim, of ``leaf`` that ``rank`` holds: one, or a flat range's."""
    return [_region(index, leaf.shape) for index in piece_indices(leaf.slot, rank)]


def local_pieces(leaf: ShardedTensor, /) -> list[tuple[Region, torch.Tensor]]:
    """Each box of ``leaf`` that its rank holds, with its view of the leaf's flat buffer."""
    return [
        (_region(index, leaf.shape), view)
        for index, view in pieces(leaf.flat.data, leaf.slot, leaf.flat.rank)
    ]


def _region(index: tuple[slice, ...], shape: tuple[int, ...]) -> Region:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def whole(shape: tuple[int, ...] | list[int], /) -> Region:
    """The region of a whole leaf of ``shape``."""
    return tuple((0, n) for n in shape)


def overlap(region: Region, chunk: Chunk, /) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """Slices of (the region, the chunk) where they overlap, or ``None``.

    Example:
        >>> overlap(((0, 4),), Chunk("w@2", (2,), (4,), 0))
        ((slice(2, 4, None),), (slice(0, 2, None),))
    """
    dst: list[slice] = []
    src: list[slice] = []
    for (start, stop), offset, size in zip(region, chunk.offsets, chunk.sizes):
        lo, hi = max(start, offset), min(stop, offset + size)
        if lo >= hi:
            return None
        dst.append(slice(lo - start, hi - start))
        src.append(slice(lo - offset, hi - offset))
    return tuple(dst), tuple(src)


def check_tiling(path: str, shape: tuple[int, ...], chunks: list[Chunk], /) -> str | None:
    """Why ``chunks`` do not tile a leaf of ``shape`` exactly once, or ``None`` if they do.

    The chunks funcshard writes form a grid (a ``NamedSharding`` cuts every dim
    into intervals): per dim, the chunks' intervals must cut ``[0, size)`` into
    consecutive pieces, and there must be one chunk per cell of that grid. Or,
    from a flat unit, each chunk is a contiguous range of the leaf's row-major
    elements and the ranges follow each other from the first element to the
    last. An empty leaf has no chunks.

    Example:
        >>> check_tiling("w", (4,), [Chunk("w@0", (0,), (2,), 0), Chunk("w@2", (2,), (2,), 1)]) is None
        True
        >>> check_tiling("w", (4,), [Chunk("w@0", (0,), (2,), 0)])
        'the chunks of w do not cover dim 0 of (4,): they cut it at [(0, 2)]'
        >>> flat = [Chunk("w@0,0", (0, 0), (1, 3), 0), Chunk("w@1,0", (1, 0), (1, 1), 0),
        ...         Chunk("w@1,1", (1, 1), (1, 2), 1)]
        >>> check_tiling("w", (2, 3), flat) is None  # rank 0 holds 4 elements, rank 1 two
        True
    """
    if math.prod(shape) == 0:
        return None if not chunks else f"{path} is empty but lists chunks"
    for chunk in chunks:
        if len(chunk.offsets) != len(shape) or len(chunk.sizes) != len(shape):
            return f"chunk {chunk.key!r} of {path} has {len(chunk.offsets)} dims, the leaf {len(shape)}"
        if chunk.key != chunk_key(path, chunk.offsets):
            return f"chunk {chunk.key!r} of {path} does not carry the key of its offsets"
        if any(n <= 0 for n in chunk.sizes):
            return f"chunk {chunk.key!r} of {path} has sizes {chunk.sizes}"
    if _tiles_as_ranges(shape, chunks):
        return None
    cells = 1
    for d, size in enumerate(shape):
        cuts = sorted({(c.offsets[d], c.offsets[d] + c.sizes[d]) for c in chunks})
        ends = [0] + [stop for _, stop in cuts]
        if any(start != end for (start, _), end in zip(cuts, ends)) or ends[-1] != size:
            return f"the chunks of {path} do not cover dim {d} of {shape}: they cut it at {cuts}"
        cells *= len(cuts)
    if len({c.offsets for c in chunks}) != len(chunks) or len(chunks) != cells:
        return f"the chunks of {path} are not one per cell of a grid over {shape}"
    return None


def check_own_bytes(spans: Iterable[tuple[str, int, int, str]], /, *, metadata: object) -> None:
    """Refuses two entries whose byte ranges overlap in one data file: every chunk has bytes of its own.

    Two entries over one blob would let a file declare more than it holds. ``spans`` are
    ``(file, start, stop, label)``; an empty range holds no byte and shares none.

    Raises:
        UnsafeCheckpointError: two ranges overlap; the message names ``metadata``, both
            entries (their ``label``) and the file.

    Example:
        >>> check_own_bytes([("f", 0, 8, "'a'"), ("f", 8, 9, "'b'"), ("g", 0, 8, "'c'")], metadata="m")
        >>> check_own_bytes([("f", 0, 8, "'a'"), ("f", 4, 12, "'b'")], metadata="m")
        Traceback (most recent call last):
        ...
        funcshard._src.checkpoint.errors.UnsafeCheckpointError: m: entries 'a' and 'b' share bytes of f; every chunk has bytes of its own, so the checkpoint was crafted
    """
    ordered = sorted(span for span in spans if span[2] > span[1])
    for (name, _, stop, label), (other_name, start, _, other) in itertools.pairwise(ordered):
        if name == other_name and start < stop:  # sorted by start: an overlap shows in a pair
            raise UnsafeCheckpointError(
                f"{metadata}: entries {label} and {other} share bytes of {name}; every chunk has "
                f"bytes of its own, so the checkpoint was crafted"
            )


def _tiles_as_ranges(shape: tuple[int, ...], chunks: list[Chunk], /) -> bool:
    """Whether every chunk is a contiguous row-major range and the ranges tile the leaf in order."""
    ranges: list[tuple[int, int]] = []
    for chunk in chunks:
        if any(o < 0 or o + n > size for o, n, size in zip(chunk.offsets, chunk.sizes, shape)):
            return False
        k = next((d for d, n in enumerate(chunk.sizes) if n > 1), len(shape) - 1)
        if any(
            o != 0 or n != size
            for o, n, size in zip(chunk.offsets[k + 1 :], chunk.sizes[k + 1 :], shape[k + 1 :])
        ):
            return False  # not contiguous: a later dim is cut
        start = 0
        for o, size in zip(chunk.offsets, shape):
            start = start * size + o
        ranges.append((start, start + chunk.numel))
    ranges.sort()
    end = 0
    for start, stop in ranges:
        if start != end:
            return False
        end = stop
    return end == math.prod(shape)
