"""Inputs that a collective sends as they are: buffers in this rank's shared regions.

Through shared memory (``shm.py``) a collective copies its input into a region
of its own for its peers to read. A caller that packs its input anyway (the
reducer, gradients into rows) can pack it straight into such a region instead:
the functions here return one where the group's ranks already share memory, and
``None`` elsewhere, where the caller packs into a buffer of its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from funcshard._src.comm import reduce_scatter as _rs
from funcshard._src.comm import shm
from funcshard._src.comm.groups import BoundMesh


def reduce_scatter_input(
    bound: BoundMesh, axes: tuple[str, ...], numel: int, dtype: torch.dtype, /
) -> torch.Tensor | None:
    """A ``(group_size, numel)`` input that the next reduce-scatter over ``axes`` sends as it is, or ``None``.

    Where the group's ranks already share memory (``shm.py``), a buffer in one
    of this rank's regions: packing gradients into it saves the copy into a
    region. Elsewhere ``None``: the caller packs into a buffer of its own.
    Start that reduce-scatter before any other collective on the group.
    """
    arena = _shared(bound, axes)
    if arena is None:
        return None
    nbytes = arena.w * numel * dtype.itemsize
    if _rs.resolve(_rs.default_algorithm(), "gloo", arena.w, nbytes) != "shm":
        return None
    return shm.input_rows(arena, arena.w, numel, dtype)


def all_reduce_input(
    bound: BoundMesh, axes: tuple[str, ...], numel: int, dtype: torch.dtype, /
) -> torch.Tensor | None:
    """A ``(numel,)`` input that the next all-reduce over ``axes`` sends as it is, or ``None``.

    Where the group's ranks already share memory (``shm.py``), a buffer in one
    of this rank's regions; its sum goes to the ``out=`` of :func:`all_reduce`,
    which must start before any other collective on the group. Elsewhere
    ``None``: the caller reduces a buffer of its own.
    """
    arena = _shared(bound, axes)
    # the test collectives.all_reduce makes to go through shared memory
    if arena is None or not shm.enabled() or numel * dtype.itemsize < shm.MIN_BYTES:
        return None
    return shm.input_rows(arena, 1, numel, dtype).view(-1)


def _shared(bound: BoundMesh, axes: tuple[str, ...], /) -> shm.Arena | None:
    """The arena of the group over ``axes`` where a collective has set one up on gloo."""
    group = bound.group(axes)
    if group is None or dist.get_backend(group) != "gloo":
        return None
    return shm.existing(group)


def group_rank(bound: BoundMesh, axes: tuple[str, ...], /) -> int:
    """This rank's index in the group over ``axes``: the row of a reduce-scatter's input it gets the sum of."""
    group = bound.group(axes)
    return 0 if group is None else dist.get_group_rank(group, dist.get_rank())
