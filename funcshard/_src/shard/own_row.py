"""A rank's own row of a flat layout's packed gradients, summed from the leaves instead of packed.

[Note: the own row from the leaves]
A reduce-scatter sums, at group rank ``i``, row ``i`` of every rank's packed
gradients. Through shared memory (``comm/shm/__init__.py``) a rank's peers read every row
of its packed input but its own, and the rank itself reads its own row once, to
add it to theirs. Packing that row is a write and a read of one row of memory
that nothing else uses: on the benchmark's 34M-parameter GPT at W = 2, half the
gradients, 1.3 % of a step. A flat part whose reduce-scatter goes through shared
memory therefore packs every row but its own (``flat_rows.pack_flat_columns(...,
skip=)``) and hands the reduce-scatter an :class:`OwnRow`, which adds
``scale * leaf`` straight from autograd's gradient tensors when the sum is made.

The sum keeps its bits: the terms are still added in group-rank order, and the
own row is used only where ``scale`` is a power of two (the mean over a
power-of-two world), so ``scale * leaf`` is exact and adding it with
``torch.add(..., alpha=scale)`` rounds once, as adding the packed row did
(gradients below the smallest normal number aside, which the packed row rounded
first). The leaves are held until the sum is made; they are autograd's tensors,
handed to the reduction and written by no one, which :meth:`OwnRow.__call__`
checks by their version counters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from funcshard._src.shard.flat_rows import concatenation_pieces
from funcshard._src.shard.layout import FlatLayout


def exact_scale(scale: float, /) -> bool:
    """Whether multiplying by ``scale`` is exact: a power of two.

    Example:
        >>> exact_scale(0.25), exact_scale(1 / 3)
        (True, False)
    """
    return scale > 0 and math.frexp(scale)[0] == 0.5


class OwnRow:
    """Columns ``[lo, lo + width)`` of a flat layout's concatenated gradients, times ``scale``, read when summed.

    ``lo`` is where this rank's row (or a range of its columns) starts in the
    concatenation. See [Note: the own row from the leaves].

    Example:
        >>> from funcshard._src.plan.planner import plan
        >>> from funcshard._src.shard.layout import layouts
        >>> from funcshard._src.spec.mesh import Mesh
        >>> p = plan({"w": torch.zeros(8)}, Mesh({"fsdp": 2}), layout="flat")
        >>> (layout,) = layouts(p)
        >>> own = OwnRow(layout, [torch.arange(8.0)], 4, 4, 0.5)
        >>> out = torch.empty(4)
        >>> own(out, torch.ones(4))
        >>> out
        tensor([3.0000, 3.5000, 4.0000, 4.5000])
    """

    def __init__(
        self,
        layout: FlatLayout,
        leaves: Sequence[torch.Tensor | None],
        lo: int,
        width: int,
        scale: float,
        /,
    ) -> None:
        if not exact_scale(scale):
            raise ValueError(f"an own row needs a power-of-two scale to sum exactly, got {scale}")
        self.scale, self.width = scale, width
        # (start, stop) in the row, and the leaf's elements there (None: zeros)
        self.pieces = concatenation_pieces(layout, leaves, lo, lo + width)
        self.versions = [(leaf, leaf._version) for leaf in leaves if leaf is not None]

    def __call__(self, out: torch.Tensor, base: torch.Tensor | None, /) -> None:
        """``out = base + scale * row`` (``scale * row`` where ``base`` is ``None``); mutates ``out``.

        ``base`` may be ``out`` itself.

        Raises:
            RuntimeError: a leaf was written after the row was taken (an internal error).
        """
        for leaf, version in self.versions:
            if leaf._version != version:
                raise RuntimeError(
                    "internal error: a gradient was written while its reduction was in flight; "
                    "please report it"
                )
        for a, b, source in self.pieces:
            target = out[a:b]
            if source is None:
                if base is None:
                    target.zero_()
                elif base is not out:
                    target.copy_(base[a:b])
            elif base is None:
                torch.mul(source, self.scale, out=target)
            else:
                torch.add(base[a:b], source, alpha=self.scale, out=target)
