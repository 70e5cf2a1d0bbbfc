"""Filling a box of a leaf block by block, each element from its flat index in the whole leaf.

An initializer sees only the global row-major indices of the elements it
generates, so a box (one rank's shard, or the whole leaf) comes out the same
however the leaf is cut. Blocks hold at most :data:`BLOCK_NUMEL` elements, so
the transient memory of generating a shard is a block, never the leaf.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import torch

BLOCK_NUMEL = 1 << 20  # elements per generated block; read at call time (tests shrink it)


def fill_blocks_(
    out: torch.Tensor,
    shape: Sequence[int],
    starts: Sequence[int],
    values: Callable[[torch.Tensor], torch.Tensor],
    /,
) -> None:
    """Writes ``values(index)`` into ``out`` one block at a time; mutates ``out``.

    ``out`` (any strides) is the box of a leaf of global ``shape`` whose corner
    is at ``starts``; ``values`` maps an int64 tensor of at most
    :data:`BLOCK_NUMEL` flat row-major leaf indices to the elements there (one
    per index, in order).

    Example:
        >>> out = torch.empty(2, 2, dtype=torch.int64)
        >>> fill_blocks_(out, (3, 4), (1, 2), lambda index: index)
        >>> out
        tensor([[ 6,  7],
                [10, 11]])
    """
    box = tuple(out.shape)
    if math.prod(box) == 0:
        return
    block = max(1, int(BLOCK_NUMEL))
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    if not box:  # a scalar leaf
        out.copy_(values(torch.zeros(1, dtype=torch.int64)).reshape(()))
        return
    # split at the first dim whose trailing box fits in a block: outer dims loop, dim
    # ``split`` is cut into runs of rows, the dims after it are whole in every block
    split = next(d for d in range(len(box)) if math.prod(box[d + 1 :]) <= block)
    inner = torch.zeros((), dtype=torch.int64)
    for d in range(split + 1, len(box)):
        along = (starts[d] + torch.arange(box[d], dtype=torch.int64)) * strides[d]
        inner = inner.unsqueeze(-1) + along
    inner = inner.reshape(-1)  # (prod(box[split + 1:]),) <= block
    rows = max(1, block // inner.numel())
    for outer in itertools.product(*(range(n) for n in box[:split])):
        base = sum((starts[d] + i) * strides[d] for d, i in enumerate(outer))
        for r0 in range(0, box[split], rows):
            r1 = min(r0 + rows, box[split])
            heads = (starts[split] + torch.arange(r0, r1, dtype=torch.int64)) * strides[split]
            index = (heads.unsqueeze(-1) + (inner + base)).reshape(-1)  # (<= block,)
            piece = out[(*outer, slice(r0, r1))]
            piece.copy_(values(index).reshape(piece.shape))
