"""A flat layout's packed rows in another order, or a range of their columns.

The flat layout's rows are its concatenation cut into one equal range per rank,
in mesh order (``flat.py``). A two-hop reduction packs them with another axis
major ([Note: two-hop reductions] in ``execute/param_group.py``), and a
reduce-scatter too large for one warm shared-memory region packs them a range of
columns at a time ([Note: reductions in chunks] in ``execute/param_group.py``): both
write each leaf's pieces straight where they go, with no buffer in mesh order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from funcshard._src.shard.layout import FlatLayout
from funcshard._src.spec.mesh import Mesh


def row_order(mesh: Mesh, axes: Sequence[str], /) -> tuple[int, ...] | None:
    """Where each row of a buffer row-major over ``axes`` in mesh order goes when row-major over ``axes`` as given.

    ``None`` where the two orders are the same.

    Example:
        >>> row_order(Mesh({"node": 2, "local": 3}), ("local", "node"))
        (0, 2, 4, 1, 3, 5)
    """
    ordered = [a for a in mesh.axis_names if a in axes]
    if ordered == list(axes):
        return None
    sizes = {a: mesh.axis_size(a) for a in axes}
    out: list[int] = []
    for r in range(math.prod(sizes.values())):
        coords: dict[str, int] = {}
        for a in reversed(ordered):  # the row's coordinate on each axis, mesh order
            r, coords[a] = divmod(r, sizes[a])
        target = 0
        for a in axes:
            target = target * sizes[a] + coords[a]
        out.append(target)
    return tuple(out)


def pack_flat_rows(
    layout: FlatLayout,
    leaves: Sequence[torch.Tensor | None],
    out: torch.Tensor,
    order: Sequence[int],
    scale: float,
) -> None:
    """The flat layout's rows (mesh order) written to ``out`` ``(group_size, numel)`` at rows ``order``; mutates ``out``.

    A leaf that spans several rows is written piece by piece, so no buffer in mesh
    order is needed.
    """
    n = out.shape[1]
    ranges: list[tuple[int, int, torch.Tensor | None]] = [
        (slot.offset, slot.offset + slot.numel, None if leaf is None else leaf.reshape(-1))
        for slot, leaf in zip(layout.slots, leaves)
    ]
    end = ranges[-1][1] if ranges else 0
    ranges.append((end, len(order) * n, None))  # the concatenation's end padding: zeros
    for a, b, flat in ranges:
        at = a
        while at < b:
            row, col = divmod(at, n)
            stop = min(b, (row + 1) * n)
            source = None if flat is None else flat[at - a : stop - a]
            write_scaled(out[order[row], col : col + stop - at], source, scale)
            at = stop


def write_scaled(target: torch.Tensor, leaf: torch.Tensor | None, scale: float) -> None:
    """``leaf * scale`` into the contiguous range ``target`` (zeros for ``None``); mutates ``target``.

    A leaf of another dtype is cast while it is written; see [Note: cast while packing].
    """
    if leaf is None:
        target.zero_()
    elif scale == 1.0:
        target.view_as(leaf).copy_(leaf)
    elif leaf.dtype != target.dtype:
        scale_cast(target.view_as(leaf), leaf, scale)
    else:
        torch.mul(leaf, scale, out=target.view_as(leaf))


def scale_cast(target: torch.Tensor, source: torch.Tensor, scale: float) -> None:
    """``source`` cast to ``target``'s dtype, times ``scale``, into ``target``; mutates ``target``.

    [Note: cast while packing]
    A part's gradients are packed into its reduce-scatter input in the reduce dtype
    straight from the leaves in the compute dtype: the copy into the packed buffer
    casts, so a unit's gradients are never all cast beside the buffer (the peak is
    the buffer, once, not twice). The copy casts as ``Tensor.to`` does and the scale
    is applied after it, in the reduce dtype: the same bits as casting each leaf first.
    ``torch.mul(source, scale, out=target)`` would not be: it multiplies in the
    source's dtype and casts the rounded product.

    Example:
        >>> g = torch.tensor([1.0, 3.0], dtype=torch.bfloat16)
        >>> t = torch.empty(2)
        >>> scale_cast(t, g, 1 / 3)
        >>> torch.equal(t, g.float() * (1 / 3))
        True
    """
    target.copy_(source)
    target.mul_(scale)


def pack_flat_columns(
    layout: FlatLayout,
    leaves: Sequence[torch.Tensor | None],
    out: torch.Tensor,
    start: int,
    scale: float,
    /,
    *,
    skip: int | None = None,
) -> None:
    """Columns ``[start, start + out.shape[1])`` of the flat layout's rows (mesh order), times ``scale``, into ``out``; mutates ``out``.

    ``out`` is ``(rows, width)`` for a layout of ``numel`` elements a row; a
    ``None`` leaf and the end padding are written as zeros. Row ``skip`` is left
    as it is: a reduce-scatter sums this rank's own row from the leaves
    (``own_row.py``).

    Example:
        >>> from funcshard._src.plan.planner import plan
        >>> from funcshard._src.shard.layout import layouts
        >>> p = plan({"w": torch.zeros(8)}, Mesh({"fsdp": 2}), layout="flat")
        >>> (layout,) = layouts(p)
        >>> out = torch.empty(2, 2)
        >>> pack_flat_columns(layout, [torch.arange(8.0)], out, 1, 1.0)
        >>> out
        tensor([[1., 2.],
                [5., 6.]])
    """
    rows, width = out.shape
    n = layout.numel
    for row in range(rows):
        if row == skip:
            continue
        lo = row * n + start  # this row's columns, concatenated
        for a, b, source in concatenation_pieces(layout, leaves, lo, lo + width):
            write_scaled(out[row, a:b], source, scale)


def concatenation_pieces(
    layout: FlatLayout, leaves: Sequence[torch.Tensor | None], lo: int, hi: int, /
) -> list[tuple[int, int, torch.Tensor | None]]:
    """Elements ``[lo, hi)`` of the leaves' concatenation, as ``(start, stop, elements)`` from ``lo`` on.

    ``elements`` is a flat view (or copy) of a leaf's part there, ``None`` where the
    range holds zeros: a ``None`` leaf, or the end padding.

    Example:
        >>> from funcshard._src.plan.planner import plan
        >>> from funcshard._src.shard.layout import layouts
        >>> p = plan({"w": torch.zeros(3)}, Mesh({"fsdp": 2}), layout="flat")
        >>> (layout,) = layouts(p)
        >>> concatenation_pieces(layout, [torch.arange(3.0)], 2, 4)
        [(0, 1, tensor([2.])), (1, 2, None)]
    """
    out: list[tuple[int, int, torch.Tensor | None]] = []
    at = lo
    for slot, leaf in zip(layout.slots, leaves):
        a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if a >= b:
            continue
        if at < a:  # a gap before the slot: zeros
            out.append((at - lo, a - lo, None))
        source = None if leaf is None else leaf.reshape(-1)[a - slot.offset : b - slot.offset]
        out.append((a - lo, b - lo, source))
        at = b
    if at < hi:
        out.append((at - lo, hi - lo, None))  # the end padding
    return out
