"""Gradient clipping by the global L2 norm over every shard of every rank."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, overload

import torch

from funcshard._src import tree
from funcshard._src.comm import agree, groups, settle
from funcshard._src.optim.base import Optimizer
from funcshard._src.shard.flat import FlatLayout, local_range
from funcshard._src.shard.sharded import flats_of


@tree.register_namedtuple  # checkpoints name it in their tree structure
class ClipState(NamedTuple):
    """The global gradient norm of the last update, before clipping (for logs)."""

    norm: torch.Tensor


@overload
def clip_by_global_norm(max_norm: float, /) -> Optimizer: ...
@overload
def clip_by_global_norm(grads: Any, max_norm: float, /) -> tuple[Any, torch.Tensor]: ...
def clip_by_global_norm(*args: Any) -> Any:
    """Scales gradients in place so that their global L2 norm is at most ``max_norm``.

    Two forms, as in optax and ``torch.nn.utils.clip_grad_norm_``:

    - ``clip_by_global_norm(max_norm)`` is a transform for
      :func:`funcshard.optim.chain`: each update clips the gradients (writing
      into them) before the next element reads them; its state's ``norm`` is the
      norm before clipping.
    - ``clip_by_global_norm(grads, max_norm)`` clips ``grads`` now and returns
      ``(grads, norm)``.

    The norm covers every leaf across all ranks with one agreement of every
    rank's sum of squares (see [Note: agreements]); a leaf replicated over some
    mesh axes counts once. Scaling follows
    ``torch.nn.utils.clip_grad_norm_``: ``grads *= min(1, max_norm / (norm + 1e-6))``.
    Collective: every rank calls it.

    Args:
        *args: ``(max_norm)``, or ``(grads, max_norm)`` with sharded gradients
            (from a step) and the largest global norm allowed.

    Returns:
        A transform (an :class:`Optimizer` that writes into the gradients), or
        ``(grads, norm)``: the clipped gradients (the same buffers) and the norm before clipping.

    Example:
        >>> import funcshard as fs
        >>> params = {"w": torch.tensor([3.0, 4.0])}
        >>> grads = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1})))
        >>> grads, norm = clip_by_global_norm(grads, 1.0)
        >>> norm, grads["w"].local
        (tensor(5.), tensor([0.6000, 0.8000]))
    """
    if len(args) == 2:
        return _clip(args[0], _check_max_norm(args[1]))
    if len(args) != 1:
        raise TypeError(
            f"clip_by_global_norm takes (max_norm) for a chain or (grads, max_norm), got "
            f"{len(args)} arguments"
        )
    max_norm = _check_max_norm(args[0])

    def init(sparams: Any, /) -> ClipState:
        return ClipState(torch.zeros((), dtype=torch.float32))

    def update_(grads: Any, state: ClipState, sparams: Any, /) -> tuple[Any, ClipState]:
        _, norm = _clip(grads, max_norm)
        state.norm.copy_(norm)
        return sparams, state

    return Optimizer(init, update_)


def _check_max_norm(max_norm: object) -> float:
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm >= 0:
        raise ValueError(f"clip_by_global_norm: max_norm must be a number >= 0, got {max_norm!r}")
    return float(max_norm)


def _clip(grads: Any, max_norm: float) -> tuple[Any, torch.Tensor]:
    """Clips ``grads`` in place; returns them and the norm before clipping."""
    flats = [f for f in flats_of(grads) if f.layout.dtype.is_floating_point]
    if not flats:
        return grads, torch.zeros(())
    pieces = [
        piece
        for f in flats
        for piece in (  # held as leaves: a one-rank group, every leaf counted
            f.held()
            if f.leaves is not None
            else [f.data[a:b] for a, b in _counted_ranges(f.layout, f.rank)]
        )
    ]
    device = pieces[0].device if pieces else flats[0].data.device
    local = torch.zeros((), dtype=torch.float64, device=device)
    if pieces:
        norms = torch._foreach_norm(pieces)
        local = torch.stack([n.double() for n in norms]).pow(2).sum()
    groups.bind(flats[0].layout.mesh)
    with settle.operation("clip_by_global_norm"):
        (total,) = agree.sum_over_ranks([float(local)], "clip_by_global_norm")
    norm = torch.tensor(total, dtype=torch.float64).sqrt().to(device, flats[0].layout.dtype)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_([t for f in flats for t in f.held()], coef)
    return grads, norm


@functools.lru_cache(maxsize=1024)
def _counted_ranges(layout: FlatLayout, rank: int) -> tuple[tuple[int, int], ...]:
    """Element ranges of ``rank``'s flat buffer whose leaves this rank counts (replica 0 only), merged."""
    ranges: list[tuple[int, int]] = []
    for slot in layout.slots:
        start, end = local_range(slot, rank)
        if slot.sharding.replica_id(rank) != 0 or start == end:
            continue
        if ranges and ranges[-1][1] == start:
            ranges[-1] = (ranges[-1][0], end)
        else:
            ranges.append((start, end))
    return tuple(ranges)
