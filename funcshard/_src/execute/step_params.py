"""What a step accepts as params: the plan's tree of this rank's sharded leaves, found by unit."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from funcshard._src import tree
from funcshard._src.comm import devices, groups
from funcshard._src.plan.plan import Plan
from funcshard._src.shard.flat import FlatLayout
from funcshard._src.shard.flat_shard import FlatShard
from funcshard._src.shard.sharded import ShardedTensor

__all__ = ["check_devices", "shards_by_unit"]


def shards_by_unit(
    sparams: Any,
    plan: Plan,
    layouts: Sequence[FlatLayout],
    /,
    *,
    batches: Sequence[tuple[tuple[Any, ...], dict[str, Any]]] = (),
) -> dict[str, list[FlatShard]]:
    """``sparams``' flat shards by unit (one per part, in ``layouts``' order), if sharded with ``plan``.

    The shards, and the tensors of ``batches`` (:func:`check_devices`), must be
    on a device the backend carries.

    Raises:
        ValueError: another tree structure, shards of another plan or rank, or a
            shard or batch tensor on a device the backend cannot carry.
        TypeError: a leaf that is not sharded.
    """
    leaves, treedef = tree.flatten(sparams)
    if treedef != plan.treedef:
        raise ValueError(
            "the params passed to the step do not have the plan's tree structure; pass the tree "
            "fs.shard(params, plan) returned (or an optimizer's update of it)"
        )
    if not all(isinstance(leaf, ShardedTensor) for leaf in leaves):
        paths, leaves, _ = tree.flatten_with_paths(sparams)
        path, leaf = next((p, x) for p, x in zip(paths, leaves) if not isinstance(x, ShardedTensor))
        raise TypeError(
            f"{path or '<root>'}: the step needs sharded params (from fs.shard), got a "
            f"{type(leaf).__name__}"
        )
    bound = groups.bind(plan.mesh)
    found: dict[FlatLayout, FlatShard] = {}
    expected = {(lt.unit, lt.dtype, lt.frozen): lt for lt in layouts}
    for flat in dict.fromkeys(leaf.flat for leaf in leaves):  # flats_of, without a flatten
        layout = expected.get((flat.layout.unit, flat.layout.dtype, flat.layout.frozen))
        if (
            layout is None
            or (flat.layout is not layout and flat.layout != layout)
            or flat.rank != bound.rank
        ):
            raise ValueError(
                f"unit {flat.layout.unit!r}: the params were sharded with another plan or rank than "
                f"this step's (plan fingerprint {plan.fingerprint()}); shard them with this plan"
            )
        found[layout] = flat
    by_unit: dict[str, list[FlatShard]] = {}
    for layout in layouts:  # each unit's parts in the order of its runtime's
        if layout in found:
            by_unit.setdefault(layout.unit, []).append(found[layout])
    check_devices(by_unit, batches)
    return by_unit


def check_devices(
    by_unit: dict[str, list[FlatShard]],
    batches: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
    /,
) -> None:
    """Refuses shards or batch tensors on a device the backend cannot carry, before any collective.

    ``batches``: each call's ``(args, kwargs)`` after the params; argument paths
    count from 0 after the params (``loss_fn's argument 0`` is the first).

    See [Note: devices and backends] in ``comm/devices.py``; nothing to check
    outside a distributed run or under the fake process group.

    Raises:
        ValueError: names the unit or the batch leaf, its device, the backend and the fix.
    """
    if devices.backend() in (None, "fake"):
        return
    devices.check_tensors(
        (
            (f"{flat.layout.slots[0].path} (unit {unit!r})", flat.data)
            for unit, flats in by_unit.items()
            for flat in flats
            if flat.layout.slots
        ),
        "the params",
    )
    for i, (args, kwargs) in enumerate(batches):
        where = f"micro-batch {i}" if len(batches) > 1 else "the batch"
        for kind, part in (("argument", args), ("keyword argument", kwargs)):
            paths, leaves, _ = tree.flatten_with_paths(part)
            devices.check_tensors(
                (
                    (f"loss_fn's {kind} {p}", x)
                    for p, x in zip(paths, leaves)
                    if isinstance(x, torch.Tensor)
                ),
                where,
            )
