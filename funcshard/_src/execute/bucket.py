"""Buckets: which consecutive small units form one gather group.

A collective over a few hundred kilobytes costs its latency, not its bytes: on
gloo at W=2 a round trip is about as long as moving a megabyte. :func:`make_groups`
joins consecutive units of the plan (same strategy, same collective axes, same
parts by dtype) up to ``bucket_bytes`` of gathered parameters into one
:class:`GatherGroup`, as DDP buckets its all-reduces; every other unit is a group
of its own. How a bucket shares its collectives is ``gather_group.py``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

from funcshard._src.execute.buffers import BufferPool
from funcshard._src.execute.gather_group import GatherGroup
from funcshard._src.execute.unit_state import UnitRuntime

# Gathered bytes below which a collective is latency-bound, per backend: on gloo at W=2
# here a reduce-scatter of 256 KiB took 2.7 ms and one of 16 MiB 19 ms
# (bench/reduce_scatter.py), so latency x bandwidth is about 2 MB; a bucket of twice that
# keeps the latency to about a third of its time. NCCL is not bucketed by default: the
# CUDA path is untested here; pass bucket_bytes to bucket there.
DEFAULT_BUCKET_BYTES = {"gloo": 4 << 20}


def default_bucket_bytes(backend: str | None, /) -> int:
    """The default ``bucket_bytes`` on ``backend`` (``None``: not distributed, no buckets).

    Example:
        >>> default_bucket_bytes("gloo"), default_bucket_bytes("nccl"), default_bucket_bytes(None)
        (4194304, 0, 0)
    """
    return 0 if backend is None else DEFAULT_BUCKET_BYTES.get(backend, 0)


def make_groups(
    units: Sequence[UnitRuntime],
    bucket_bytes: int,
    gather_pool: BufferPool,
    reduce_pool: BufferPool,
    /,
) -> list[GatherGroup]:
    """Every unit's gather group, in ``units``' order: buckets of consecutive units up to ``bucket_bytes``.

    Units join when they have the same strategy, collective axes and parts
    (dtype, compute and gradient dtype, frozen, aliased), no part of one leaf
    gathered in place, no partial copy and not the root unit, and their full leaves together stay
    within ``bucket_bytes`` (``0``: no buckets). Every other unit is a group of one.
    Mutates a bucket's members: they gather their leaves packed
    (:meth:`UnitRuntime.pack_gathers`).
    """
    groups: list[GatherGroup] = []
    run: list[UnitRuntime] = []
    size = 0

    def close() -> None:
        if run:
            groups.append(GatherGroup(run, gather_pool, reduce_pool))
        run.clear()

    for unit in units:
        nbytes = unit.full_numel_bytes
        if not _eligible(unit) or nbytes > bucket_bytes:
            close()
            size = 0
            groups.append(GatherGroup([unit], gather_pool, reduce_pool))
            continue
        if run and (_signature(run[0]) != _signature(unit) or size + nbytes > bucket_bytes):
            close()
            size = 0
        run.append(unit)
        size += nbytes
    close()
    return groups


def _eligible(unit: UnitRuntime) -> bool:
    if (
        unit.unit.is_root
        or any(p.in_place and not p.by_leaf for p in unit.parts)
        or not unit.parts
        or unit.partial.lifetime is not None  # its partial copy is per unit
        or unit.weight_block  # quantized collectives are per unit
        or unit.grad_block
    ):
        return False
    if unit.group_size > 1:
        return True
    return unit.replica_size > 1 and all(p.aliased for p in unit.parts)  # no_shard: reductions


def _signature(unit: UnitRuntime) -> tuple[object, ...]:
    return (
        unit.unit.strategy,
        unit.axes,
        unit.replica_axes,
        tuple(
            (p.layout.dtype, p.compute_dtype, p.grad_dtype, p.layout.frozen, p.aliased)
            for p in unit.parts
        ),
    )
