"""Chunk geometry: the pieces a leaf is saved in, and which of them a rank needs.

A sharded leaf is saved as one chunk per distinct non-empty shard (replica 0's
rank writes it), a plain tensor as one chunk written by rank 0. A chunk is a
box of the leaf: its offsets and sizes per dim. The chunks of a leaf must tile
it exactly, every element once: :func:`check_tiling` refuses a manifest whose
chunks leave a gap (rows that would come back as zeros), overlap, or stick out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

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
        sharding, shape = leaf.sharding, leaf.shape
        for rank in range(sharding.mesh.size):
            if sharding.replica_id(rank) != 0:
                continue
            offsets = region_of(leaf, rank)
            sizes = sharding.local_shape(shape, rank)
            if all(sizes):
                out.append(
                    Chunk(
                        chunk_key(path, tuple(a for a, _ in offsets)),
                        tuple(a for a, _ in offsets),
                        sizes,
                        rank,
                    )
                )
        return out
    shape = tuple(leaf.shape)
    offsets = (0,) * len(shape)
    return [Chunk(chunk_key(path, offsets), offsets, shape, 0)] if all(shape) else []


def region_of(leaf: ShardedTensor, rank: int, /) -> Region:
    """The [start, stop) per dim of ``leaf`` that ``rank`` holds."""
    index = leaf.sharding.local_index(leaf.shape, rank)
    return tuple(s.indices(n)[:2] for s, n in zip(index, leaf.shape))


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
    consecutive pieces, and there must be one chunk per cell of that grid. An
    empty leaf has no chunks.

    Example:
        >>> check_tiling("w", (4,), [Chunk("w@0", (0,), (2,), 0), Chunk("w@2", (2,), (2,), 1)]) is None
        True
        >>> check_tiling("w", (4,), [Chunk("w@0", (0,), (2,), 0)])
        'the chunks of w do not cover dim 0 of (4,): they cut it at [(0, 2)]'
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
