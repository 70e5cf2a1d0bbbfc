"""Flat buffers: packing leaves into one unit's buffer of one dtype, in any row order, and cutting them out.

Every rank stores, per unit and dtype, a flat buffer of ``numel`` elements: each
leaf's padded chunk (:meth:`NamedSharding.shard_shape`) in leaf order. The size is
the same on every rank, so one ``all_gather_into_tensor`` of the flat buffers
yields a ``(world_size, numel)`` rank-major buffer from which
:func:`unpack_gathered` cuts every full leaf, and :func:`pack_all` is its
inverse for reduce-scatter.

A unit of the ``"flat"`` layout (``layout.py``) stores one equal range of its
leaves' concatenation per group rank: its gathered buffer is the concatenation
itself, so every full leaf is a view of it, and gradients are packed by one
plain copy per leaf. :func:`pieces` is how consumers address what a rank holds
of a leaf in either layout.

[Note: padding]
Padding lives at the end of every padded dim of a chunk and is always zero in
parameters, gradients and optimizer state (zero gradients leave it zero under
SGD and AdamW). Ceil-div chunks make the padding of the *gathered* dim sit at
its end too, so narrowing the gathered dim to the leaf's size drops it.

**Rows in another order.** A flat layout's packed rows may be wanted in another
order, or a range of their columns at a time.

The flat layout's rows are its concatenation cut into one equal range per rank,
in mesh order (``flat.py``). A two-hop reduction packs them with another axis
major ([Note: two-hop reductions] in ``execute/param_group.py``), and a
reduce-scatter too large for one warm shared-memory region packs them a range of
columns at a time ([Note: reductions in chunks] in ``execute/param_group.py``): both
write each leaf's pieces straight where they go, with no buffer in mesh order.

**The own row.** A rank's own row of a flat layout's packed gradients can be
summed from the leaves instead of packed.

[Note: the own row from the leaves]
A reduce-scatter sums, at group rank ``i``, row ``i`` of every rank's packed
gradients. Through shared memory (``comm/shm/__init__.py``) a rank's peers read every row
of its packed input but its own, and the rank itself reads its own row once, to
add it to theirs. Packing that row is a write and a read of one row of memory
that nothing else uses: on the benchmark's 34M-parameter GPT at W = 2, half the
gradients, 1.3 % of a step. A flat part whose reduce-scatter goes through shared
memory therefore packs every row but its own (``pack_flat_columns(...,
skip=)``) and hands the reduce-scatter an :class:`OwnRow`, which adds
``scale * leaf`` straight from the gradient tensors (autograd's own, or their casts
to the reduce dtype) when the sum is made.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

import torch

from funcshard._src.shard.layout import FlatLayout as FlatLayout
from funcshard._src.shard.layout import Slot as Slot
from funcshard._src.shard.layout import layouts as layouts
from funcshard._src.shard.layout import local_range as local_range
from funcshard._src.shard.layout import local_view as local_view
from funcshard._src.shard.layout import padded_view as padded_view
from funcshard._src.shard.layout import piece_indices as piece_indices
from funcshard._src.shard.layout import pieces as pieces
from funcshard._src.shard.layout import whole_chunk as whole_chunk
from funcshard._src.spec.flat_sharding import FlatSharding
from funcshard._src.spec.mesh import Mesh
from funcshard._src.spec.named_sharding import NamedSharding


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


_T = TypeVar("_T")


def _derived(
    layout: FlatLayout,
    what: str,
    axes: tuple[str, ...],
    make: Callable[[FlatLayout, tuple[str, ...]], _T],
    /,
) -> _T:
    """``make(layout, axes)``, worked out once per layout and ``axes`` and held on the layout (``FlatLayout.derived``)."""
    key = (what, axes)
    if key not in layout.derived:
        layout.derived[key] = make(layout, axes)
    return cast("_T", layout.derived[key])


def layout_row_order(layout: FlatLayout, axes: Sequence[str], /) -> tuple[int, ...] | None:
    """:func:`row_order` of ``layout``'s mesh, worked out once per layout and ``axes``."""
    return _derived(layout, "row order", tuple(axes), _mesh_row_order)


def _mesh_row_order(layout: FlatLayout, axes: tuple[str, ...]) -> tuple[int, ...] | None:
    return row_order(layout.mesh, axes)


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
    (``flat.py``).

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


def pack_local(layout: FlatLayout, leaves: Sequence[torch.Tensor], rank: int, /) -> torch.Tensor:
    """``rank``'s flat buffer, shape ``(numel,)``, cut from the full ``leaves`` (slot order).

    Padding is zero. The result is a new tensor on the leaves' device.
    """
    flat = torch.zeros(layout.numel, dtype=layout.dtype, device=leaves[0].device)
    for slot, leaf in zip(layout.slots, leaves):
        for index, view in pieces(flat, slot, rank):
            view.copy_(leaf[index])
    return flat


def unpack_gathered(
    layout: FlatLayout, gathered: torch.Tensor, /, axes: Sequence[str] | None = None
) -> list[torch.Tensor]:
    """Every full leaf of ``layout``, cut from a gathered ``(group_size, numel)`` buffer.

    ``axes`` are the mesh axes the buffer was gathered over (default: all, in mesh
    order); rows are group ranks, row-major over ``axes``. The results are new
    contiguous tensors, except for a layout that :func:`gathers_in_place`, whose
    one leaf is a view of ``gathered``.
    """
    if layout.flat:
        whole = gathered.view(-1)
        return [whole[s.offset : s.offset + s.numel].view(s.shape) for s in layout.slots]
    if gathers_in_place(layout, axes):
        (slot,) = layout.slots
        return [gathered.view(slot.shape)]
    outs = [
        torch.empty(slot.shape, dtype=gathered.dtype, device=gathered.device)
        for slot in layout.slots
    ]
    unpack_into(layout, gathered, outs, axes)
    return outs


def unpack_into(
    layout: FlatLayout,
    gathered: torch.Tensor,
    outs: Sequence[torch.Tensor],
    /,
    axes: Sequence[str] | None = None,
) -> None:
    """Writes every full leaf of ``layout`` from ``gathered`` into ``outs`` (slot order); mutates ``outs``.

    Each leaf is its chunks, concatenated and narrowed to the leaf's size, which
    drops the padding (see [Note: padding]).

    One copy per leaf when its dims divide evenly, two when they are padded.
    """
    if layout.flat:
        for view, out in zip(unpack_gathered(layout, gathered, axes), outs):
            out.copy_(view)
        return
    widths = column_widths(layout, axes)
    if widths is not None and _fusable(gathered, outs):  # See [Note: leaves as columns]
        rows = gathered.shape[0]
        torch.split_with_sizes_copy(
            gathered[:, : sum(widths)], list(widths), dim=1, out=[o.view(rows, -1) for o in outs]
        )
        return
    for geo, out in zip(geometry(layout, axes), outs):
        grid = geo.grid(gathered)[geo.replica_index]  # replicas hold the same chunk
        if geo.padded is None:
            out.view(geo.split).copy_(grid)
        else:
            out.copy_(grid.reshape(geo.padded)[geo.unpad])


def unpacker(
    layout: FlatLayout,
    outs: Sequence[torch.Tensor],
    /,
    axes: Sequence[str] | None = None,
) -> Callable[[torch.Tensor], None]:
    """A function that writes ``outs`` as ``unpack_into(layout, gathered, outs, axes)`` does, decided once; it mutates ``outs``.

    For storage that stays where it is (a unit's gathered leaves, [Note: persistent
    gathered storage] in ``execute/unit_state.py``): which copies unpacking takes
    is found out here, not again at every gather. Call the function without
    autograd recording (``torch.no_grad``).

    Example:
        >>> from funcshard._src.plan.planner import plan as make_plan
        >>> from funcshard._src.spec.mesh import Mesh
        >>> p = make_plan({"a": torch.zeros(8, 2), "b": torch.zeros(4)}, Mesh({"fsdp": 4}))
        >>> layout = layouts(p)[0]
        >>> outs = [torch.empty(8, 2), torch.empty(4)]
        >>> gathered = pack_all(layout, [torch.arange(16.0).view(8, 2), torch.arange(4.0)])
        >>> unpacker(layout, outs)(gathered)
        >>> bool(outs[0].equal(torch.arange(16.0).view(8, 2))), bool(outs[1].equal(torch.arange(4.0)))
        (True, True)
    """
    widths = None if layout.flat else column_widths(layout, axes)
    if widths is None or not all(out.is_contiguous() for out in outs):
        return lambda gathered: unpack_into(layout, gathered, outs, axes)
    names = tuple(layout.mesh.axis_names if axes is None else axes)
    rows = math.prod(layout.mesh.axis_size(a) for a in names)
    columns = sum(widths)
    sizes, views = list(widths), [out.view(rows, -1) for out in outs]

    def unpack(gathered: torch.Tensor, /) -> None:  # See [Note: leaves as columns]
        if gathered.dtype != views[0].dtype or gathered.device != views[0].device:
            unpack_into(layout, gathered, outs, axes)
            return
        torch.split_with_sizes_copy(gathered[:, :columns], sizes, dim=1, out=views)

    return unpack


def gathers_in_place(layout: FlatLayout, /, axes: Sequence[str] | None = None) -> bool:
    """Whether the gathered ``(group_size, numel)`` buffer of ``layout`` is its one leaf, in memory order.

    True for one leaf sharded evenly on dim 0 over exactly ``axes`` (in order) and
    nowhere else: an embedding or a head alone in its unit. Such a leaf is
    gathered straight into its full storage and needs no unpacking copy.

    Example:
        >>> from funcshard._src.plan.planner import plan as make_plan
        >>> from funcshard._src.spec.mesh import Mesh
        >>> p = make_plan({"w": torch.zeros(8, 2)}, Mesh({"fsdp": 4}))
        >>> gathers_in_place(layouts(p)[0], ("fsdp",))
        True
    """
    axes = tuple(layout.mesh.axis_names if axes is None else axes)
    if layout.flat:  # the gathered buffer is the concatenation: every leaf is a view of it
        return bool(layout.slots) and all(
            isinstance(s.sharding, FlatSharding) and s.sharding.axes == axes for s in layout.slots
        )
    if len(layout.slots) != 1:
        return False
    (slot,) = layout.slots
    return slot.numel == layout.numel and _slot_in_place(slot, axes)


def leaves_gather_in_place(layout: FlatLayout, /, axes: Sequence[str] | None = None) -> bool:
    """Whether every leaf of ``layout`` can be all-gathered on its own straight into its full storage.

    True when each leaf is sharded evenly on dim 0 over exactly ``axes`` (in
    order) and nowhere else: a rank's shard of such a leaf is one contiguous
    range of the flat buffer, and the group's shards in rank order are the full
    leaf in memory order. One collective per leaf then needs no gathered buffer
    beside the leaves and no unpacking copy (:func:`gathers_in_place` is the
    case of one leaf).

    Example:
        >>> from funcshard._src.plan.planner import plan as make_plan
        >>> from funcshard._src.spec.mesh import Mesh
        >>> p = make_plan({"w": torch.zeros(8, 2), "b": torch.zeros(4)}, Mesh({"fsdp": 4}))
        >>> leaves_gather_in_place(layouts(p)[0], ("fsdp",))
        True
        >>> p = make_plan({"w": torch.zeros(8, 2), "s": torch.zeros(())}, Mesh({"fsdp": 4}))
        >>> leaves_gather_in_place(layouts(p)[0], ("fsdp",))  # a scalar is replicated
        False
    """
    axes = tuple(layout.mesh.axis_names if axes is None else axes)
    return (
        not layout.flat
        and bool(layout.slots)
        and all(_slot_in_place(slot, axes) for slot in layout.slots)
    )


def _slot_in_place(slot: Slot, axes: tuple[str, ...], /) -> bool:
    assert isinstance(slot.sharding, NamedSharding)
    dim_axes = slot.sharding.dim_axes(len(slot.shape))
    return (
        len(slot.shape) > 0
        and _is_even(slot)
        and tuple(dim_axes[0]) == axes
        and all(not names for names in dim_axes[1:])
    )


def pack_all(
    layout: FlatLayout, leaves: Sequence[torch.Tensor], /, axes: Sequence[str] | None = None
) -> torch.Tensor:
    """Every group rank's flat buffer at once, ``(group_size, numel)``: the inverse of :func:`unpack_gathered`.

    ``leaves`` are full tensors in slot order. A leaf replicated over some of
    ``axes`` is written into the rows of every replica, so a reduce-scatter of
    this buffer over the group sums each chunk over every rank of the group.
    """
    axes = tuple(layout.mesh.axis_names if axes is None else axes)
    rows = math.prod(layout.mesh.axis_size(a) for a in axes)
    out = torch.empty(rows, layout.numel, dtype=layout.dtype, device=leaves[0].device)
    pack_into(layout, leaves, out, axes)
    return out


def pack_into(
    layout: FlatLayout,
    leaves: Sequence[torch.Tensor | None],
    out: torch.Tensor,
    /,
    axes: Sequence[str] | None = None,
    *,
    scale: float = 1.0,
) -> None:
    """Writes :func:`pack_all` of ``leaves`` times ``scale`` into ``out`` ``(group_size, numel)``; mutates ``out``.

    A ``None`` leaf packs as zeros; padding is written as zeros. Scaling while
    copying saves a pass over ``out``. In the flat layout ``out`` viewed flat is
    the concatenation: one copy per leaf.
    """
    if layout.flat:
        order = None if axes is None else layout_row_order(layout, axes)
        if order is None:
            _pack_flat(layout, leaves, out.view(-1), scale)
        else:
            pack_flat_rows(layout, leaves, out.view(len(order), -1), order, scale)
        return
    widths = column_widths(layout, axes)
    if (
        widths is not None
        and sum(widths) == layout.numel
        and (scale == 1.0 or out.numel() * out.element_size() <= FUSED_SCALE_BYTES)
        and all(leaf is not None for leaf in leaves)
        and _fusable(out, cast("Sequence[torch.Tensor]", leaves), cast_ok=True)
    ):  # See [Note: leaves as columns]; the cat casts: [Note: cast while packing] in ``shard/flat.py``
        rows = out.shape[0]
        torch.cat([leaf.view(rows, -1) for leaf in leaves if leaf is not None], dim=1, out=out)
        if scale != 1.0:
            out.mul_(scale)
        return
    geos = geometry(layout, axes)
    if out.shape[0] == 1 and all(
        geo.padded is None for geo in geos
    ):  # a row is the leaves as they are
        row = out.view(-1)
        for geo, leaf in zip(geos, leaves):
            write_scaled(row[geo.start : geo.stop], leaf, scale)
        return
    for geo, leaf in zip(geos, leaves):
        target = geo.grid(out)
        if leaf is None:
            target.zero_()
            continue
        if geo.padded is None:
            source = leaf.reshape(geo.split)
        else:
            padded = leaf.new_zeros(geo.padded)
            padded[geo.unpad] = leaf
            source = padded.view(geo.split)
        _write_grid(target, source, scale)


def _write_grid(target: torch.Tensor, source: torch.Tensor, scale: float, /) -> None:
    """``source`` (a leaf's chunk grid, without replica dims) times ``scale`` into ``target``; mutates ``target``."""
    if scale == 1.0:
        target.copy_(source.expand(target.shape))
    elif source.dtype != target.dtype:  # [Note: cast while packing] in ``shard/flat.py``
        scale_cast(target, source.expand(target.shape), scale)
    else:
        torch.mul(source.expand(target.shape), scale, out=target)


def leaf_column_ranges(
    layout: FlatLayout, axes: Sequence[str], columns: int, /
) -> tuple[tuple[int, int], ...] | None:
    """Ranges of the packed ``(group_size, numel)`` rows' columns, each packed on its own by :func:`pack_leaf_columns`.

    For a layout of the ``"leaf"`` kind (each leaf's chunk of its spec, over
    ``axes``): a range holds whole slots side by side, or a run of whole rows (along
    dim 0) of one slot's chunk, and at most ``columns`` columns unless one chunk row
    alone is wider. ``None`` where the layout is flat, a slot is padded (its chunk
    grid is not a view of the leaf) or the slots leave a gap: such a part is packed
    whole. Worked out once per layout, ``axes`` and ``columns``. See [Note: reductions
    in chunks] in ``execute/param_group.py``.

    Example:
        >>> from funcshard._src.plan.planner import plan
        >>> p = plan({"a": torch.zeros(8, 2), "b": torch.zeros(4)}, Mesh({"fsdp": 2}))
        >>> (layout,) = layouts(p)
        >>> leaf_column_ranges(layout, ("fsdp",), 4)  # a's chunk (4, 2): rows 0-1, 2-3; then b's (2,)
        ((0, 4), (4, 8), (8, 10))
    """
    if layout.flat or columns <= 0:
        return None

    def make(layout: FlatLayout, axes: tuple[str, ...]) -> tuple[tuple[int, int], ...] | None:
        return _work_out_ranges(layout, axes, columns)

    return _derived(layout, f"column ranges of {columns}", tuple(axes), make)


def _work_out_ranges(
    layout: FlatLayout, axes: tuple[str, ...], columns: int
) -> tuple[tuple[int, int], ...] | None:
    ranges: list[tuple[int, int]] = []
    lo = hi = 0  # the range being filled
    for slot, geo in zip(layout.slots, _geometry(layout, axes)):
        if geo.padded is not None or geo.start != hi:
            return None
        width = geo.stop - geo.start
        if hi - lo + width <= columns:
            hi = geo.stop
            continue
        if hi > lo:
            ranges.append((lo, hi))
            lo = hi
        if width <= columns or not slot.shard_shape:
            hi = geo.stop
            continue
        rows = slot.shard_shape[0]
        row = width // rows  # the elements of one row of the chunk
        step = max(1, columns // row)
        ranges += [
            (geo.start + i * row, geo.start + min(i + step, rows) * row)
            for i in range(0, rows, step)
        ]
        lo = hi = geo.stop
    if hi != layout.numel:
        return None
    if hi > lo:
        ranges.append((lo, hi))
    return tuple(ranges)


def pack_leaf_columns(
    layout: FlatLayout,
    leaves: Sequence[torch.Tensor | None],
    out: torch.Tensor,
    start: int,
    axes: Sequence[str],
    /,
    *,
    scale: float = 1.0,
) -> None:
    """Columns ``[start, start + out.shape[1])`` of :func:`pack_into`'s rows, times ``scale``, into ``out``; mutates ``out``.

    The range is one of :func:`leaf_column_ranges`: whole slots, or whole rows of
    one slot's chunk, each written through its chunk grid as :func:`pack_into` writes
    the whole. A ``None`` leaf packs as zeros.

    Example:
        >>> from funcshard._src.plan.planner import plan
        >>> p = plan({"a": torch.zeros(8, 2), "b": torch.zeros(4)}, Mesh({"fsdp": 2}))
        >>> (layout,) = layouts(p)
        >>> leaves = [torch.arange(16.0).view(8, 2), torch.arange(4.0)]
        >>> whole = torch.empty(2, 10)
        >>> pack_into(layout, leaves, whole, ("fsdp",))
        >>> out = torch.empty(2, 4)
        >>> pack_leaf_columns(layout, leaves, out, 4, ("fsdp",))
        >>> torch.equal(out, whole[:, 4:8])
        True
    """
    axes = tuple(axes)
    k = len(axes)
    stop = start + out.shape[1]
    for slot, geo, leaf in zip(layout.slots, _geometry(layout, axes), leaves):
        a, b = max(start, geo.start), min(stop, geo.stop)
        if a >= b:
            continue
        view, first, rows = geo.view, 0, 0
        if (a, b) != (geo.start, geo.stop):  # whole rows of the chunk (leaf_column_ranges)
            row = (geo.stop - geo.start) // slot.shard_shape[0]
            first, rows = (a - geo.start) // row, (b - a) // row
            view = (*geo.view[:k], rows, *geo.view[k + 1 :])
        target = out[:, a - start : b - start].view(view).permute(geo.order)
        if leaf is None:
            target.zero_()
            continue
        source = leaf.reshape(geo.split)
        if rows:  # the chunk's dim 0 in the grid, less the replica dims the split lacks
            source = source.narrow(geo.order.index(k) - len(geo.replica_index), first, rows)
        _write_grid(target, source, scale)


def _pack_flat(
    layout: FlatLayout, leaves: Sequence[torch.Tensor | None], row: torch.Tensor, scale: float
) -> None:
    end = 0
    for slot, leaf in zip(layout.slots, leaves):
        end = slot.offset + slot.numel
        write_scaled(row[slot.offset : end], leaf, scale)
    row[end:].zero_()  # the concatenation's end padding


@dataclass(frozen=True)
class SlotGeometry:
    """How one slot sits in a gathered ``(group_size, numel)`` buffer: computed once per layout and axes.

    ``grid`` views the slot's columns as (replica axes, then per dim: its axes
    and its chunk); ``split`` is the full (padded) leaf with each dim split into
    (its axes' sizes..., chunk); ``padded`` is the padded full shape, ``None``
    when every dim divides evenly.
    """

    start: int
    stop: int
    view: tuple[int, ...]
    order: tuple[int, ...]
    replica_index: tuple[int, ...]
    split: tuple[int, ...]
    padded: tuple[int, ...] | None
    unpad: tuple[slice, ...]

    def grid(self, block: torch.Tensor, /) -> torch.Tensor:
        """The slot's part of ``block`` ``(group_size, numel)`` as its grid (a view)."""
        return block[:, self.start : self.stop].view(self.view).permute(self.order)


def _geometry(layout: FlatLayout, axes: tuple[str, ...]) -> tuple[SlotGeometry, ...]:
    return _derived(layout, "geometry", axes, _work_out_geometry)


def _work_out_geometry(layout: FlatLayout, axes: tuple[str, ...]) -> tuple[SlotGeometry, ...]:
    out: list[SlotGeometry] = []
    mesh = layout.mesh
    for slot in layout.slots:
        if not isinstance(slot.sharding, NamedSharding):
            raise TypeError(f"{slot.path}: a flat-layout slot has no chunk grid")
        k = len(axes)
        dim_axes = slot.sharding.dim_axes(len(slot.shape))
        used = {a for d in dim_axes for a in d}
        missing = used - set(axes)
        if missing:
            raise ValueError(
                f"{slot.path}: its spec uses {sorted(missing)}, outside the collective axes {list(axes)}"
            )
        order = [i for i, a in enumerate(axes) if a not in used]
        for dim, names in enumerate(dim_axes):
            order += [axes.index(a) for a in names] + [k + dim]
        split: list[int] = []
        for dim, names in enumerate(dim_axes):
            split += [mesh.axis_size(a) for a in names] + [slot.shard_shape[dim]]
        num = slot.sharding.num_shards(slot.shape)
        even = all(n * c == size for n, c, size in zip(num, slot.shard_shape, slot.shape))
        out.append(
            SlotGeometry(
                start=slot.offset,
                stop=slot.offset + slot.numel,
                view=(*(mesh.axis_size(a) for a in axes), *slot.shard_shape),
                order=tuple(order),
                replica_index=(0,) * sum(1 for a in axes if a not in used),
                split=tuple(split),
                padded=None if even else tuple(n * c for n, c in zip(num, slot.shard_shape)),
                unpad=tuple(slice(0, n) for n in slot.shape),
            )
        )
    return tuple(out)


def geometry(layout: FlatLayout, axes: Sequence[str] | None = None, /) -> tuple[SlotGeometry, ...]:
    """Per slot of ``layout``, its :class:`SlotGeometry` for a collective over ``axes`` (default: all).

    Cached: the executor packs and unpacks the same layouts every step.

    Raises:
        ValueError: a slot's spec uses a mesh axis outside ``axes``.
    """
    return _geometry(layout, layout.mesh.axis_names if axes is None else tuple(axes))


FUSED_SCALE_BYTES = 4 << 20  # a scaled pack up to this size: one fused copy, then a scale


def _column_widths(layout: FlatLayout, axes: tuple[str, ...]) -> tuple[int, ...] | None:
    return _derived(layout, "column widths", axes, _work_out_column_widths)


def _work_out_column_widths(layout: FlatLayout, axes: tuple[str, ...]) -> tuple[int, ...] | None:
    at, widths = 0, []
    for geo in _geometry(layout, axes):
        identity = geo.order == tuple(range(len(geo.order)))
        if geo.padded is not None or geo.replica_index or not identity or geo.start != at:
            return None
        widths.append(geo.stop - geo.start)
        at = geo.stop
    return tuple(widths) if widths else None


def column_widths(
    layout: FlatLayout, axes: Sequence[str] | None = None, /
) -> tuple[int, ...] | None:
    """Each slot's width if every leaf of ``layout`` is its columns of the gathered rows, in order.

    [Note: leaves as columns]
    When every leaf is sharded evenly on dim 0 over exactly ``axes`` (in order)
    and nowhere else, and the slots follow each other from column 0, leaf ``i``
    viewed ``(group_size, -1)`` *is* columns ``start_i:stop_i`` of the gathered
    ``(group_size, numel)`` rows: the layout of FSDP2's all-gather. Unpacking is
    then one ``torch.split_with_sizes_copy`` over the slots' widths, and packing
    one ``torch.cat`` (then a scale, for a small buffer), where the general path
    runs a copy per leaf through its chunk grid; the host time of a small unit is
    those calls. ``None`` for any other layout.

    Example:
        >>> from funcshard._src.plan.planner import plan as make_plan
        >>> from funcshard._src.spec.mesh import Mesh
        >>> p = make_plan({"a": torch.zeros(8, 2), "b": torch.zeros(4)}, Mesh({"fsdp": 4}))
        >>> column_widths(layouts(p)[0])
        (4, 1)
    """
    return _column_widths(layout, layout.mesh.axis_names if axes is None else tuple(axes))


def _fusable(block: torch.Tensor, leaves: Sequence[torch.Tensor], *, cast_ok: bool = False) -> bool:
    """Whether ``leaves`` can each be viewed as ``block``'s rows, in its dtype (or, ``cast_ok``, any float) and on its device.

    Not where autograd would record the copies (a fused copy's ``out=`` refuses it).
    """
    if torch.is_grad_enabled() and (block.requires_grad or any(x.requires_grad for x in leaves)):
        return False
    return all(
        leaf.is_contiguous()
        and (
            leaf.dtype == block.dtype
            or (cast_ok and leaf.dtype.is_floating_point and block.dtype.is_floating_point)
        )
        and leaf.device == block.device
        for leaf in leaves
    )


def _is_even(slot: Slot) -> bool:
    assert isinstance(slot.sharding, NamedSharding)
    return all(
        n * c == size
        for n, c, size in zip(slot.sharding.num_shards(slot.shape), slot.shard_shape, slot.shape)
    )
