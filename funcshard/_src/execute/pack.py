"""Packing one part's gradients for its reduction: every row, or every row but this rank's own.

See [Note: the own row from the leaves] in ``shard/own_row.py``: where the rows
are in shared memory and go to a reduce-scatter alone (not deferred, nothing
kept to add, the plain row order of a flat layout, a power-of-two mean), this
rank's row is left out and summed from the leaves instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from funcshard._src.execute.unit_state import UnitRuntime
from funcshard._src.shard.flat import FlatLayout, pack_into
from funcshard._src.shard.flat_rows import pack_flat_columns, row_order
from funcshard._src.shard.own_row import OwnRow, exact_scale


def pack_rows(
    unit: UnitRuntime,
    layout: FlatLayout,
    leaves: Sequence[torch.Tensor | None],
    rows: torch.Tensor,
    order: Sequence[str],
    /,
    *,
    scale: float,
    shared: bool,
    start: int = 0,
) -> OwnRow | None:
    """Packs ``leaves`` times ``scale`` into ``rows`` ``(group_size, width)``, columns from ``start``; mutates ``rows``.

    Returns the :class:`OwnRow` the reduce-scatter sums this rank's row from, where
    ``rows`` (``shared``: in shared memory) are packed without it, else ``None``.
    """
    width = rows.shape[1]
    if (
        shared
        and layout.flat
        and tuple(order) == unit.axes
        and row_order(layout.mesh, unit.axes) is None
        and exact_scale(scale)
    ):
        me = unit.bound.group_rank(unit.axes)
        pack_flat_columns(layout, leaves, rows, start, scale, skip=me)
        return OwnRow(layout, leaves, me * layout.numel + start, width, scale)
    if start or width != layout.numel:
        pack_flat_columns(layout, leaves, rows, start, scale)
    else:
        pack_into(layout, leaves, rows, order, scale=scale)
    return None
