"""Gradient clipping by the global L2 norm over every shard of every rank."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple, overload

import torch

from funcshard._src import tree
from funcshard._src.comm import channel, collectives, groups, runtime, settle
from funcshard._src.optim.base import (
    Optimizer,
    Transform,
    can_skip_on_device,
    device_of,
    skip_flag,
)
from funcshard._src.shard.flat import FlatLayout, local_range
from funcshard._src.shard.sharded import FlatShard, flats_of, map_flats


@tree.register_namedtuple  # checkpoints name it in their tree structure
class ClipState(NamedTuple):
    """The global gradient norm of the last update, before clipping (for logs)."""

    norm: torch.Tensor


@overload
def clip_by_global_norm(max_norm: float, /, *, eps: float = 0.0) -> Transform: ...
@overload
def clip_by_global_norm(
    grads: Any, max_norm: float, /, *, eps: float = 0.0
) -> tuple[Any, torch.Tensor]: ...
def clip_by_global_norm(*args: Any, eps: float = 0.0) -> Any:
    """Scales gradients so that their global L2 norm is at most ``max_norm``, as ``optax.clip_by_global_norm``.

    Two forms, as in optax and ``torch.nn.utils.clip_grad_norm_``:

    - ``clip_by_global_norm(max_norm)`` is a :class:`Transform` for
      :func:`funcshard.optim.chain`: the elements after it read the clipped
      gradients (the chain copies the caller's gradients once for its
      transforms, so the caller's tree is not written); its state's ``norm`` is
      the norm before clipping.
    - ``clip_by_global_norm(grads, max_norm)`` returns ``(clipped, norm)``:
      new gradients, ``grads`` unchanged.

    :func:`clip_by_global_norm_` is the same in place (no copy).

    The norm covers every leaf across all ranks with one agreement of every
    rank's sum of squares (see [Note: agreements] in ``comm/channel.py``); a leaf replicated over some
    mesh axes counts once. It is reduced and applied on the device with no
    host read on one rank, and over several ranks on an accelerator (an
    all-reduce over the mesh; on the CPU the sums travel in the agreement). Scaling is optax's: ``grads * (max_norm / norm)`` where
    ``norm > max_norm``, else ``grads`` as they are (equal to optax's
    ``grads / norm * max_norm`` to one rounding). ``eps=1e-6`` gives
    ``torch.nn.utils.clip_grad_norm_``'s instead: ``grads * min(1, max_norm /
    (norm + eps))``, which scales by a little under 1 just below ``max_norm`` and
    differs from optax's by about ``eps / norm``. Collective: every rank calls it.

    Args:
        *args: ``(max_norm)``, or ``(grads, max_norm)`` with sharded gradients
            (from a step) and the largest global norm allowed.
        eps: added to the norm in the scale, torch's ``max_norm / (norm + eps)``;
            0 (the default) is optax's.

    Returns:
        A :class:`Transform`, or ``(clipped, norm)``: the clipped gradients (a new
        tree) and the norm before clipping.

    Example:
        >>> import funcshard as fs
        >>> params = {"w": torch.tensor([3.0, 4.0])}
        >>> grads = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1})))
        >>> clipped, norm = clip_by_global_norm(grads, 1.0)
        >>> norm, clipped["w"].local, grads["w"].local
        (tensor(5.), tensor([0.6000, 0.8000]), tensor([3., 4.]))
    """
    max_norm, eps = _check(args, eps, "clip_by_global_norm")
    if len(args) == 2:
        flats, coef, norm = _norm_and_scale(args[0], max_norm, eps)
        if coef is None:
            return args[0], norm
        scaled = {id(f): torch._foreach_mul(list(f.held()), coef) for f in flats}
        return map_flats(lambda f: _with_held(f, scaled.get(id(f))), args[0]), norm
    return Transform(*_transform(max_norm, eps))


@overload
def clip_by_global_norm_(max_norm: float, /, *, eps: float = 0.0) -> Optimizer: ...
@overload
def clip_by_global_norm_(
    grads: Any, max_norm: float, /, *, eps: float = 0.0
) -> tuple[Any, torch.Tensor]: ...
def clip_by_global_norm_(*args: Any, eps: float = 0.0) -> Any:
    """:func:`clip_by_global_norm` writing into the gradients in place: no copy, ``grads`` is changed.

    ``clip_by_global_norm_(grads, max_norm)`` scales ``grads``' buffers and
    returns ``(grads, norm)``; ``clip_by_global_norm_(max_norm)`` in a
    :func:`funcshard.optim.chain` scales the caller's gradients (the chain makes
    no copy for it). For gradients nothing reads after the update, e.g. a
    step's with ``fs.value_and_grad(..., donate_grads=True)``.

    Args:
        *args: ``(max_norm)``, or ``(grads, max_norm)``.
        eps: as :func:`clip_by_global_norm`.

    Returns:
        A chain element (an :class:`Optimizer` that writes into the gradients), or
        ``(grads, norm)``: the same buffers, clipped, and the norm before clipping.

    Example:
        >>> import funcshard as fs
        >>> params = {"w": torch.tensor([3.0, 4.0])}
        >>> grads = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1})))
        >>> _, norm = clip_by_global_norm_(grads, 1.0)
        >>> norm, grads["w"].local
        (tensor(5.), tensor([0.6000, 0.8000]))
    """
    max_norm, eps = _check(args, eps, "clip_by_global_norm_")
    if len(args) == 2:
        return _clip_(args[0], max_norm, eps)
    return Optimizer(*_transform(max_norm, eps))


def _transform(max_norm: float, eps: float) -> tuple[Any, Any]:
    """``init`` and an ``update_`` that clips the gradients it is given in place."""

    def init(sparams: Any, /) -> ClipState:
        return ClipState(torch.zeros((), dtype=torch.float32, device=device_of(sparams)))

    @can_skip_on_device  # See [Note: skipping on the device] (base.py)
    def update_(grads: Any, state: ClipState, sparams: Any, /) -> tuple[Any, ClipState]:
        skip = skip_flag()
        _, norm = _clip_(grads, max_norm, eps, skip=skip)
        state.norm.copy_(norm if skip is None else torch.where(skip > 0, state.norm, norm))
        return sparams, state

    return init, update_


def _check(args: tuple[Any, ...], eps: object, who: str) -> tuple[float, float]:
    if len(args) not in (1, 2):
        raise TypeError(
            f"{who} takes (max_norm) for a chain or (grads, max_norm), got {len(args)} arguments"
        )
    max_norm = args[-1]
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm >= 0:
        raise ValueError(f"{who}: max_norm must be a number >= 0, got {max_norm!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
        raise ValueError(
            f"{who}: eps must be a finite number >= 0 (0: optax's scale, 1e-6: torch's), got {eps!r}"
        )
    return float(max_norm), float(eps)


def _clip_(
    grads: Any, max_norm: float, eps: float, *, skip: torch.Tensor | None = None
) -> tuple[Any, torch.Tensor]:
    """Clips ``grads`` in place (scaling by 1 where ``skip`` is 1); returns them and the norm before clipping."""
    flats, coef, norm = _norm_and_scale(grads, max_norm, eps)
    if coef is not None:
        if skip is not None:
            coef = torch.where(skip > 0, 1.0, coef)
        torch._foreach_mul_([t for f in flats for t in f.held()], coef)
    return grads, norm


def _with_held(flat: FlatShard, held: Sequence[torch.Tensor] | None) -> FlatShard:
    """A flat shard like ``flat`` holding ``held`` (new tensors like ``flat.held()``); ``flat`` if ``None``."""
    if held is None:
        return flat
    if flat.leaves is not None:
        return FlatShard.of_leaves(flat.layout, held, flat.rank)
    return flat.with_data(held[0])


def _norm_and_scale(
    grads: Any, max_norm: float, eps: float
) -> tuple[list[FlatShard], torch.Tensor | None, torch.Tensor]:
    """The floating flat shards of ``grads``, the factor that clips them and the global norm.

    Reads nothing back to the host on one rank: the sum of squares stays on the
    device (see [Note: update counts on the device] in ``base.py`` for why a step
    avoids host reads).
    """
    flats = [f for f in flats_of(grads) if f.layout.dtype.is_floating_point]
    if not flats:
        return flats, None, torch.zeros(())
    pieces = [
        piece
        for f in flats
        for piece in (  # held as leaves: a one-rank group, every leaf counted
            f.held()
            if f.leaves is not None
            else [f.data[a:b] for a, b in _counted_ranges(f.layout, f.rank)]
        )
    ]
    device = pieces[0].device if pieces else flats[0].held()[0].device
    local = torch.zeros((), dtype=torch.float64, device=device)
    if pieces:
        norms = torch._foreach_norm(pieces)
        local = torch.stack([n.double() for n in norms]).pow(2).sum()
    bound = groups.bind(flats[0].layout.mesh)
    if runtime.world_size() > 1:
        with settle.operation("clip_by_global_norm"):
            if _reduce_on_device(device):
                # ranks agree on the operation on the host, and sum on the device: no read back
                local = collectives.sum_over_mesh(
                    local.reshape(1), bound, "clip_by_global_norm"
                ).reshape(())
            else:  # the CPU: the values travel in the agreement, added in rank order
                (total,) = channel.sum_over_ranks([float(local)], "clip_by_global_norm")
                local = torch.tensor(total, dtype=torch.float64)
    norm = local.sqrt().to(device, flats[0].layout.dtype)
    if eps:  # torch.nn.utils.clip_grad_norm_'s
        coef = torch.clamp(max_norm / (norm + eps), max=1.0)
    else:  # optax's: as they are up to max_norm (so 0 / 0 never arises)
        coef = torch.where(norm <= max_norm, 1.0, max_norm / norm)
    return flats, coef, norm


def _reduce_on_device(device: torch.device) -> bool:
    """Whether the ranks' sums of squares are all-reduced on ``device`` rather than read and agreed.

    On an accelerator, reading the sum back would wait for the device; on the CPU
    the agreement carries it at no such cost and adds in rank order (the same
    value on every world size).
    """
    return device.type != "cpu"


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
