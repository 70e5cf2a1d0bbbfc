"""Reductions in chunks: a reduce-scatter larger than a warm shared-memory region, a range of columns at a time.

[Note: reductions in chunks]
On gloo, a reduce-scatter's input is packed straight into a shared-memory region
(``comm/collectives.py: input_rows``), and that transport gives a region of
``LARGE_BYTES`` or more its pages back while it is free, so that a root unit's embeddings
are not resident all step twice over. Packing into such a region faults every page
in again, every step: about 25 ms for the 32.5 MiB of the benchmark's root unit, 3 %
of its step. A flat part whose packed gradients pass ``LARGE_BYTES`` is therefore
reduced a range of columns at a time, each of at most ``chunk_bytes``: the largest
reduce-scatter input of the other units, and at most half of ``LARGE_BYTES``. Each
range is packed (``shard/flat_rows.pack_flat_columns``), reduce-scattered into its
columns of the gradient and waited for before the next, so the ranges reuse the
warm regions the other units' reductions leave free, and no large region is made.
Each element's sum is the same as the whole reduce-scatter's, in the same order:
the gradient is bitwise that of one reduce-scatter, and the ledger counts the same
bytes. The ranges start after every reduction in flight is done and run one after
another: such a part is a root unit's, whose reduction ends backward with nothing
left to overlap. Whether a part is reduced in chunks follows from the plan alone
(a CPU device, a group of several ranks, a flat part, exact gradients, no replica
axes, not two-hop, not deferred), so every rank issues the same collectives.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from funcshard._src.comm import collectives
from funcshard._src.comm.transport import LARGE_BYTES
from funcshard._src.execute.buffers import BufferPool
from funcshard._src.execute.pack import pack_rows
from funcshard._src.execute.param_group import ParamGroup
from funcshard._src.execute.unit_state import Part, UnitRuntime


def _input_bytes(unit: UnitRuntime, part: Part, /) -> int:
    """Bytes of ``part``'s packed gradients, ``(group_size, numel)`` in the reduce dtype."""
    return unit.group_size * part.layout.numel * part.grad_dtype.itemsize


def chunk_bytes_for(units: Iterable[UnitRuntime], /) -> int:
    """The most bytes a range of a reduction in chunks packs: see [Note: reductions in chunks].

    The largest reduce-scatter input of the units other than the root, at most half
    of ``LARGE_BYTES``; 0 where no such unit reduces (nothing is chunked).
    """
    sizes = [
        _input_bytes(u, p)
        for u in units
        if not u.is_root and u.group_size > 1
        for p in u.parts
        if p.layout.dtype.is_floating_point and not p.layout.frozen
    ]
    return min(max(sizes, default=0), LARGE_BYTES // 2)


def chunk_columns(unit: UnitRuntime, part: Part, chunk_bytes: int, /, *, defer: bool) -> int:
    """Columns a range of ``part``'s reduction holds, or 0 where it is reduced whole."""
    layout = part.layout
    if (
        defer
        or not layout.flat
        or unit.group_size == 1
        or unit.all_reduce_axes
        or unit.grad_format
        or unit.two_hop
        or unit.device(part).type != "cpu"
        or _input_bytes(unit, part) <= LARGE_BYTES
    ):
        return 0
    columns = chunk_bytes // (unit.group_size * part.grad_dtype.itemsize)
    return columns if 0 < columns < layout.numel else 0


def reduce_in_chunks(
    group: ParamGroup,
    unit: UnitRuntime,
    part: Part,
    leaves: Sequence[torch.Tensor | None],
    kept: torch.Tensor | None,
    pool: BufferPool,
    /,
    *,
    out: torch.Tensor | None,
    columns: int,
    world_size: int,
) -> torch.Tensor:
    """Reduces ``part``'s gradients ``columns`` at a time; returns this rank's ``(numel,)`` of the mean.

    ``leaves`` are this call's full gradients (in the reduce dtype); ``kept``, the
    packed gradients earlier micro-batches deferred. Writes into ``out`` where
    given. See [Note: reductions in chunks].
    """
    layout, dtype = part.layout, part.grad_dtype
    n, g = layout.numel, unit.group_size
    device = unit.device(part)
    result = out if out is not None else torch.empty(n, dtype=dtype, device=device)
    for start in range(0, n, columns):
        width = min(columns, n - start)
        rows = collectives.input_rows(unit.bound, unit.axes, width, dtype)
        staged = None
        if rows is None:  # no shared memory: a buffer of the pool's
            staged = rows = pool.take(g * width, dtype, device).view(g, width)
        scale = 1.0 / world_size if kept is None else 1.0
        shared = staged is None and kept is None
        own = pack_rows(
            unit, layout, leaves, rows, unit.axes, scale=scale, shared=shared, start=start
        )
        if kept is not None:
            rows.add_(kept[:, start : start + width]).div_(world_size)
        into = result[start : start + width]
        group.reduce_columns(unit, rows, into, first=start == 0, own=own).wait()
        if staged is not None:
            pool.give(staged)
    return result
