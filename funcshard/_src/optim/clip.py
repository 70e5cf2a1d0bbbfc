"""Gradient clipping by the global L2 norm over every shard of every rank."""

from __future__ import annotations

import functools
from typing import Any

import torch

from funcshard._src.comm import agree, groups, settle
from funcshard._src.shard.flat import FlatLayout
from funcshard._src.shard.sharded import flats_of


def clip_by_global_norm(grads: Any, max_norm: float, /) -> tuple[Any, torch.Tensor]:
    """Scales ``grads`` in place so that their global L2 norm is at most ``max_norm``.

    The norm covers every leaf across all ranks with one agreement of every
    rank's sum of squares (see [Note: agreements]); a leaf replicated over some
    mesh axes counts once. Scaling follows
    ``torch.nn.utils.clip_grad_norm_``: ``grads *= min(1, max_norm / (norm + 1e-6))``.
    Collective: every rank calls it.

    Args:
        grads: sharded gradients (from a step).
        max_norm: the largest global norm allowed.

    Returns:
        ``(grads, norm)``: the clipped gradients (the same buffers) and the norm before clipping.

    Example:
        >>> import funcshard as fs
        >>> params = {"w": torch.tensor([3.0, 4.0])}
        >>> grads = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1})))
        >>> grads, norm = clip_by_global_norm(grads, 1.0)
        >>> norm, grads["w"].local
        (tensor(5.), tensor([0.6000, 0.8000]))
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm >= 0:
        raise ValueError(f"clip_by_global_norm: max_norm must be a number >= 0, got {max_norm!r}")
    flats = [f for f in flats_of(grads) if f.layout.dtype.is_floating_point]
    if not flats:
        return grads, torch.zeros(())
    pieces = [f.data[a:b] for f in flats for a, b in _counted_ranges(f.layout, f.rank)]
    local = torch.zeros((), dtype=torch.float64, device=flats[0].data.device)
    if pieces:
        norms = torch._foreach_norm(pieces)
        local = torch.stack([n.double() for n in norms]).pow(2).sum()
    groups.bind(flats[0].layout.mesh)
    with settle.operation("clip_by_global_norm"):
        (total,) = agree.sum_over_ranks([float(local)], "clip_by_global_norm")
    norm = (
        torch.tensor(total, dtype=torch.float64)
        .sqrt()
        .to(flats[0].data.device, flats[0].data.dtype)
    )
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_([f.data for f in flats], coef)
    return grads, norm


@functools.lru_cache(maxsize=1024)
def _counted_ranges(layout: FlatLayout, rank: int) -> tuple[tuple[int, int], ...]:
    """Element ranges of ``rank``'s flat buffer whose leaves this rank counts (replica 0 only), merged."""
    ranges: list[tuple[int, int]] = []
    for slot in layout.slots:
        if slot.sharding.replica_id(rank) != 0 or slot.numel == 0:
            continue
        start, end = slot.offset, slot.offset + slot.numel
        if ranges and ranges[-1][1] == start:
            ranges[-1] = (ranges[-1][0], end)
        else:
            ranges.append((start, end))
    return tuple(ranges)
