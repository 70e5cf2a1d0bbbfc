"""Cost model, first cut: bytes each rank holds and sends per step, exactly as the executor does.

Sizes include padding: a rank holds each leaf's padded chunk
(:meth:`NamedSharding.shard_shape`), and a unit's collectives move the padded
flat buffer of every rank. Communication follows the ledger's convention
(bandwidth-optimal algorithms; see ``funcshard._src.comm.ledger``).
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from funcshard._src.plan.plan import Plan
from funcshard._src.plan.precision import FULL_PRECISION, MixedPrecision
from funcshard._src.plan.strategy import shard_axes
from funcshard._src.plan.units import Unit

Key = tuple[str, tuple[str, ...]]


def shard_numel(plan: Plan, unit: Unit, /) -> dict[torch.dtype, int]:
    """Elements of ``unit``'s flat buffer on one rank, per dtype (padding included)."""
    out: dict[torch.dtype, int] = {}
    for path in unit.paths:
        leaf = plan.leaf(path)
        out[leaf.dtype] = out.get(leaf.dtype, 0) + math.prod(
            leaf.sharding(plan.mesh).shard_shape(leaf.shape)
        )
    return out


def param_bytes_per_rank(plan: Plan, /) -> int:
    """Bytes of sharded parameters one rank holds (gradients take the same).

    Example:
        >>> from funcshard._src.plan.plan import plan as make_plan
        >>> from funcshard._src.spec.mesh import Mesh
        >>> param_bytes_per_rank(make_plan({"w": torch.zeros(10, 4)}, Mesh({"fsdp": 4})))
        48
    """
    return sum(
        n * dtype.itemsize for unit in plan.units for dtype, n in shard_numel(plan, unit).items()
    )


def comm_bytes_per_step(
    plan: Plan, /, mixed_precision: MixedPrecision | None = None
) -> Counter[Key]:
    """Bytes one rank sends in one step (forward and backward of one batch), by ``(op, axes)``.

    Per unit and dtype, with ``B`` its flat buffer's bytes on one rank and ``g`` the
    size of its shard group: a ``full_shard`` unit is all-gathered twice (forward,
    and again for backward), the root unit and ``shard_grad_op`` units once; each
    sends ``(g - 1) * B`` bytes. Floating-point gradients are reduce-scattered
    once (``(g - 1) * B``), then all-reduced across replica axes of size ``r``
    (``2 * (r - 1) / r * B``): ``hybrid_shard`` across ``dp``, ``no_shard`` across
    every axis. Gathers move ``param_dtype`` bytes, reductions ``reduce_dtype`` bytes.
    """
    mp = mixed_precision or FULL_PRECISION
    mesh = plan.mesh
    total: Counter[Key] = Counter()
    for unit in plan.units:
        axes = shard_axes(unit.strategy, mesh)
        replica = tuple(a for a in mesh.axis_names if a not in axes)
        g = math.prod(mesh.axis_size(a) for a in axes)
        r = math.prod(mesh.axis_size(a) for a in replica)
        gathers = 2 if unit.strategy == "full_shard" and not unit.is_root else 1
        for dtype, numel in shard_numel(plan, unit).items():
            if g > 1:
                total[("all_gather", axes)] += (
                    gathers * (g - 1) * numel * mp.compute_dtype(dtype).itemsize
                )
            if not dtype.is_floating_point:
                continue
            grad_bytes = numel * mp.gradient_dtype(dtype).itemsize
            if g > 1:
                total[("reduce_scatter", axes)] += (g - 1) * grad_bytes
            if r > 1:
                total[("all_reduce", replica)] += 2 * grad_bytes * (r - 1) // r
    return total
