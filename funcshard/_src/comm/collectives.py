"""Flat-buffer collectives: one call per buffer, never one per leaf, each counted in a ledger.

Every collective can run asynchronously: it returns a :class:`Pending` whose
``wait()`` yields the result, so callers overlap communication with compute and
wait only when they need the data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from funcshard._src.comm.groups import BoundMesh
from funcshard._src.comm.ledger import Ledger

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single and
# deprecated the old names; older releases only have the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Pending:
    """A collective in flight; :meth:`wait` blocks until ``result`` holds the data."""

    result: torch.Tensor
    work: Any = None  # a torch.distributed Work handle, or None when already done

    def wait(self) -> torch.Tensor:
        """Blocks until the collective is done and returns its result."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.result

    @property
    def done(self) -> bool:
        """Whether :meth:`wait` would return at once."""
        return self.work is None or bool(self.work.is_completed())


def group_size(bound: BoundMesh, axes: tuple[str, ...], /) -> int:
    """Number of ranks in a group over ``axes``."""
    size = 1
    for a in axes:
        size *= bound.mesh.axis_size(a)
    return size


def all_gather(
    flat: torch.Tensor,
    bound: BoundMesh,
    axes: tuple[str, ...],
    /,
    *,
    out: torch.Tensor | None = None,
    ledger: Ledger | None = None,
    async_op: bool = False,
) -> Pending:
    """Gathers every group member's ``flat`` into ``(group_size, numel)``, row = group rank.

    ``out`` (``group_size * numel`` elements) is filled when given. Over a group of
    one rank the result is ``flat`` itself viewed as one row (no copy) unless
    ``out`` is given.
    """
    size = group_size(bound, axes)
    group = bound.group(axes)
    if group is None:
        result = flat.view(1, -1) if out is None else out.view(1, -1).copy_(flat.view(1, -1))
        return Pending(result)
    if out is None:
        out = torch.empty(size * flat.numel(), dtype=flat.dtype, device=flat.device)
    work = _all_gather_single(out.view(-1), flat, group=group, async_op=async_op)
    if ledger is not None:
        ledger.record(
            "all_gather", axes, group_size=size, full_bytes=out.numel() * out.element_size()
        )
    return Pending(out.view(size, -1), work)


def reduce_scatter(
    rows: torch.Tensor,
    bound: BoundMesh,
    axes: tuple[str, ...],
    /,
    *,
    out: torch.Tensor | None = None,
    ledger: Ledger | None = None,
    async_op: bool = False,
) -> Pending:
    """Sums ``rows`` ``(group_size, numel)`` over the group; group rank ``i`` gets row ``i``'s sum.

    Over a group of one rank the result is the single row (no copy unless ``out``).
    """
    size = group_size(bound, axes)
    group = bound.group(axes)
    if group is None:
        result = rows.view(-1) if out is None else out.copy_(rows.view(-1))
        return Pending(result)
    if out is None:
        out = torch.empty(rows.shape[1], dtype=rows.dtype, device=rows.device)
    work = _reduce_scatter_single(out, rows.view(-1), group=group, async_op=async_op)
    if ledger is not None:
        ledger.record(
            "reduce_scatter", axes, group_size=size, full_bytes=rows.numel() * rows.element_size()
        )
    return Pending(out, work)


def all_reduce(
    buf: torch.Tensor,
    bound: BoundMesh,
    axes: tuple[str, ...],
    /,
    *,
    ledger: Ledger | None = None,
    async_op: bool = False,
) -> Pending:
    """Sums ``buf`` over the group over ``axes``, in place; mutates ``buf``."""
    size = group_size(bound, axes)
    group = bound.group(axes)
    if group is None:
        return Pending(buf)
    work = dist.all_reduce(buf, group=group, async_op=async_op)
    if ledger is not None:
        ledger.record(
            "all_reduce", axes, group_size=size, full_bytes=buf.numel() * buf.element_size()
        )
    return Pending(buf, work)


def gather_to_rank0(
    flat: torch.Tensor, bound: BoundMesh, /, *, ledger: Ledger | None = None
) -> torch.Tensor | None:
    """Every rank's ``flat`` stacked into ``(world_size, numel)`` on global rank 0, ``None`` elsewhere."""
    if not bound.distributed:
        return flat.view(1, -1)
    world = bound.mesh.size
    rows = [torch.empty_like(flat) for _ in range(world)] if bound.rank == 0 else None
    dist.gather(flat, rows, dst=0)
    if ledger is not None:
        ledger.record(
            "gather",
            bound.mesh.axis_names,
            group_size=world,
            full_bytes=world * flat.numel() * flat.element_size(),
        )
    return None if rows is None else torch.stack(rows)
