"""Which examples each rank reads: ``DistributedSampler``'s split, over a mesh's data-parallel axes."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from funcshard._src.comm import runtime
from funcshard._src.spec.mesh import Mesh


def shard_indices(
    n: int,
    mesh: Mesh | None = None,
    /,
    *,
    rank: int | None = None,
    axes: Sequence[str] | None = None,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
) -> list[int]:
    """This rank's indices into a dataset of ``n`` examples for one epoch.

    The same split as ``torch.utils.data.DistributedSampler`` (``set_epoch(epoch)``),
    index for index: a permutation drawn from ``seed + epoch`` (or ``range(n)``
    without ``shuffle``), padded by repeating its start to a multiple of the
    replicas (or cut to one with ``drop_last``), and every replica takes every
    replica-th index from its own offset. The replicas are the ranks' coordinates
    over ``axes`` (default every mesh axis: each rank reads its own examples, as
    data parallelism over the whole mesh needs); ranks that differ only along the
    other axes read the same examples. Pass a ``Sampler``-like list to a
    ``DataLoader`` (``sampler=``), or index a tensor dataset with it.

    Args:
        n: the number of examples.
        mesh: the mesh (default: one axis over every rank).
        rank: the global rank (default: this process's).
        axes: the mesh axes the data is split over (default: all of them).
        seed: the shuffle's seed, the same on every rank.
        epoch: the epoch: each one shuffles differently.
        shuffle: draw a permutation (else the examples in order).
        drop_last: leave out the tail that does not divide among the replicas
            (else repeat the first examples to fill it).

    Returns:
        This rank's indices, ``ceil(n / replicas)`` of them (``n // replicas`` with ``drop_last``).

    Raises:
        ValueError: a negative ``n``, a ``seed`` or ``epoch`` that is not an integer >= 0,
            ``shuffle``/``drop_last`` that are not bools, a rank outside the mesh, an axis
            the mesh lacks or named twice, or a mesh that does not cover the world.

    Example:
        >>> import funcshard as fs
        >>> mesh = fs.Mesh({"dp": 2, "fsdp": 2})
        >>> [fs.data.shard_indices(10, mesh, rank=r, shuffle=False) for r in range(4)]
        [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]
        >>> [fs.data.shard_indices(10, mesh, rank=r, axes=["dp"], shuffle=False)[:3] for r in range(4)]
        [[0, 2, 4], [0, 2, 4], [1, 3, 5], [1, 3, 5]]
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"shard_indices: n must be an int >= 0 (the dataset size), got {n!r}")
    for name, value in (("seed", seed), ("epoch", epoch)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**62:
            raise ValueError(
                f"shard_indices: {name} must be an int >= 0 (below 2**62), got {value!r}; "
                f"{'count epochs in whole numbers (epoch=step // steps_per_epoch)' if name == 'epoch' else 'seed the shuffle with an integer'}"
            )
    for name, value in (("shuffle", shuffle), ("drop_last", drop_last)):
        if not isinstance(value, bool):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise ValueError(f"shard_indices: {name} must be True or False, got {value!r}")
    if mesh is None:
        mesh = Mesh({"data": runtime.world_size()})
    world = runtime.world_size()
    if rank is None and mesh.size != world:
        raise ValueError(
            f"shard_indices: the mesh has {mesh.size} ranks but the world {world}; pass the "
            f"mesh the plan uses, or rank="
        )
    rank = runtime.rank() if rank is None else rank
    if isinstance(axes, str):
        raise ValueError(
            f"shard_indices: axes must be a list of mesh axis names, got the string {axes!r}; "
            f"pass axes=[{axes!r}]"
        )
    names = list(mesh.axis_names if axes is None else axes)
    for a in names:
        mesh.axis_index(a)  # names the axes there are
    twice = sorted({a for a in names if names.count(a) > 1})
    if twice:
        raise ValueError(
            f"shard_indices: axes {names} name {twice} more than once; a rank's replica is its "
            f"coordinate over each axis once (named twice, half the replicas would read nothing): "
            f"pass each axis once"
        )
    coords = dict(zip(mesh.axis_names, mesh.coords(rank)))
    replicas, replica = 1, 0
    for a in names:  # row-major over the axes, in the order given
        replica = replica * mesh.axis_size(a) + coords[a]
        replicas *= mesh.axis_size(a)
    if shuffle:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    else:
        order = list(range(n))
    if drop_last:
        total = (n // replicas) * replicas
        order = order[:total]
    else:
        total = math.ceil(n / replicas) * replicas
        pad = total - n
        if pad and order:
            order += (order * math.ceil(pad / len(order)))[:pad]
    return order[replica:total:replicas]
