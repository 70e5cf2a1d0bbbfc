"""Flat-buffer collectives: one call per buffer, never one per leaf, each counted in a ledger."""

from __future__ import annotations

import torch
import torch.distributed as dist

from funcshard._src.comm.groups import BoundMesh
from funcshard._src.comm.ledger import Ledger

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single and
# deprecated the old names; older releases only have the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather(
    flat: torch.Tensor,
    bound: BoundMesh,
    axes: tuple[str, ...],
    /,
    *,
    out: torch.Tensor | None = None,
    ledger: Ledger | None = None,
) -> torch.Tensor:
    """Gathers every group member's ``flat`` into ``(group_size, numel)``, row = group rank.

    ``out`` (shape ``(group_size * numel,)`` or ``(group_size, numel)``) is filled
    in place when given. Over a group of one rank the result is ``flat`` itself
    viewed as one row.
    """
    group = bound.group(axes)
    size = _group_size(bound, axes)
    if group is None:
        return flat.view(1, -1) if out is None else out.view(1, -1).copy_(flat.view(1, -1))
    if out is None:
        out = torch.empty(size * flat.numel(), dtype=flat.dtype, device=flat.device)
    _all_gather_single(out.view(-1), flat, group=group)
    if ledger is not None:
        ledger.record(
            "all_gather", axes, group_size=size, full_bytes=out.numel() * out.element_size()
        )
    return out.view(size, -1)


def gather_to_rank0(
    flat: torch.Tensor, bound: BoundMesh, /, *, ledger: Ledger | None = None
) -> torch.Tensor | None:
    """Every rank's ``flat`` stacked into ``(world_size, numel)`` on global rank 0, ``None`` elsewhere."""
    if bound.device_mesh is None:
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


def _group_size(bound: BoundMesh, axes: tuple[str, ...]) -> int:
    size = 1
    for a in axes:
        size *= bound.mesh.axis_size(a)
    return size
