"""shard and unshard: between a whole params tree and this rank's packed shards."""

from __future__ import annotations

import functools
from typing import Any

import torch

from funcshard._src import tree
from funcshard._src.comm import collectives, groups
from funcshard._src.plan.plan import Plan
from funcshard._src.shard.flat import FlatLayout, layouts, pack_local, unpack_gathered
from funcshard._src.shard.sharded import FlatShard, ShardedTensor, flats_of


def shard(params: Any, plan: Plan, /, *, device: torch.device | str | None = None) -> Any:
    """Keeps only this rank's shards of ``params``, packed per unit and dtype in flat buffers.

    Every rank calls it with the same full ``params`` (for example, initialized
    from the same seed). Each leaf of the result is a :class:`ShardedTensor`
    viewing its unit's flat buffer; nothing of the input is kept.

    Args:
        params: the pytree ``plan`` was made for (same structure, shapes, dtypes).
        plan: the plan, on a mesh whose size is the world size.
        device: where the shards go; default: where the leaves are.

    Returns:
        A pytree of :class:`ShardedTensor` with the structure of ``params``.

    Raises:
        ValueError: the mesh does not match the world size, the tree, a shape or a
            dtype differs from the plan, or leaves sit on different devices.
        TypeError: a leaf is not a tensor.

    Example:
        >>> import funcshard as fs
        >>> params = {"w": torch.arange(6.0).reshape(3, 2)}
        >>> sparams = fs.shard(params, fs.plan(params, fs.Mesh({"fsdp": 1})))
        >>> sparams["w"].local
        tensor([[0., 1.],
                [2., 3.],
                [4., 5.]])
    """
    bound = groups.bind(plan.mesh)
    return shard_for_rank(params, plan, bound.rank, device=device)


def shard_for_rank(
    params: Any, plan: Plan, rank: int, /, *, device: torch.device | str | None = None
) -> Any:
    """:func:`shard` for an explicit ``rank`` of ``plan.mesh``, with no process group.

    Pure: used by :func:`shard`, by tests that look at every rank from one
    process, and by tools that write per-rank files.
    """
    leaves = check_params(params, plan)
    target = (
        torch.device(device)
        if device is not None
        else (leaves[0].device if leaves else torch.device("cpu"))
    )
    out: list[Any] = [None] * len(leaves)
    for layout in plan_layouts(plan):
        data = pack_local(layout, [leaves[s.index].detach() for s in layout.slots], rank).to(target)
        flat = FlatShard(layout, data, rank)
        for slot in layout.slots:
            out[slot.index] = ShardedTensor(flat, slot)
    return tree.unflatten(plan.treedef, out)


def unshard(sparams: Any, /, *, rank0_only: bool = False) -> Any:
    """Reassembles the whole tree from every rank's shards (collective: every rank calls it).

    One all-gather (or gather) per flat buffer. Leaves that are not
    :class:`ShardedTensor` pass through unchanged.

    Args:
        sparams: a sharded pytree, e.g. from :func:`shard` or an optimizer.
        rank0_only: gather to global rank 0 only; other ranks get ``None``.

    Returns:
        The pytree with full tensors (new storage) in place of sharded leaves.

    Example:
        >>> import funcshard as fs
        >>> params = {"w": torch.arange(4.0)}
        >>> fs.unshard(fs.shard(params, fs.plan(params, fs.Mesh({"fsdp": 1}))))
        {'w': tensor([0., 1., 2., 3.])}
    """
    flats = flats_of(sparams)
    if not flats:
        return sparams
    meshes = {f.layout.mesh for f in flats}
    if len(meshes) > 1:
        raise ValueError(
            f"unshard: the sharded leaves come from different meshes {sorted(map(repr, meshes))}"
        )
    bound = groups.bind(flats[0].layout.mesh)
    # keyed by flat buffer and leaf: trees like {"params", "opt"} share slots across buffers
    full: dict[tuple[int, int], torch.Tensor] = {}
    for flat in flats:
        if rank0_only:
            gathered = collectives.gather_to_rank0(flat.data, bound)
        else:
            gathered = collectives.all_gather(flat.data, bound, bound.mesh.axis_names).wait()
        if gathered is None:
            continue
        for slot, leaf in zip(flat.layout.slots, unpack_gathered(flat.layout, gathered)):
            full[(id(flat), slot.index)] = leaf
    if rank0_only and bound.rank != 0:
        return None
    return tree.tree_map(
        lambda x: full[(id(x.flat), x.slot.index)] if isinstance(x, ShardedTensor) else x, sparams
    )


@functools.lru_cache(maxsize=64)
def plan_layouts(plan: Plan, /) -> tuple[FlatLayout, ...]:
    """:func:`layouts` of ``plan``, computed once per plan."""
    return layouts(plan)


def check_params(params: Any, plan: Plan, /) -> list[torch.Tensor]:
    """The leaves of ``params`` if they fit ``plan``: same tree, tensors, shapes, dtypes, one device.

    Raises:
        ValueError: a mismatch; the message names the paths and what differs.
        TypeError: a leaf that is not a tensor.
    """
    paths, leaves, treedef = tree.flatten_with_paths(params)
    if treedef != plan.treedef:
        expected = [leaf.path for leaf in plan.leaves]
        missing = [p for p in expected if p not in set(paths)]
        unexpected = [p for p in paths if p not in set(expected)]
        detail = (
            f"missing {missing}, unexpected {unexpected}"
            if missing or unexpected
            else f"the containers differ: plan {plan.treedef}, params {treedef}"
        )
        raise ValueError(
            f"params do not have the plan's tree structure: {detail}; plan these params"
        )
    devices: dict[torch.device, str] = {}
    for path, leaf, lp in zip(paths, leaves, plan.leaves):
        where = path or "<root>"
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"{where}: leaf is a {type(leaf).__name__}, not a torch.Tensor")
        if tuple(leaf.shape) != lp.shape or leaf.dtype != lp.dtype:
            raise ValueError(
                f"{where}: leaf is {tuple(leaf.shape)} {leaf.dtype} but the plan has "
                f"{lp.shape} {lp.dtype}; plan these params"
            )
        devices.setdefault(leaf.device, where)
    if len(devices) > 1:
        listed = ", ".join(f"{p!r} on {d}" for d, p in devices.items())
        raise ValueError(
            f"leaves are on different devices ({listed}); move every leaf to one device first"
        )
    if torch.device("meta") in devices:
        raise ValueError(
            f"{devices[torch.device('meta')]!r} is on the meta device: shard needs values; "
            f"materialize the params (plan works on meta tensors, shard does not)"
        )
    return leaves
