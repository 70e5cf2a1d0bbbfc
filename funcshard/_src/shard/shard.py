"""shard and unshard: between a whole params tree and this rank's packed shards."""

from __future__ import annotations

import functools
from typing import Any

import torch

from funcshard._src import tree
from funcshard._src.comm import channel, collectives, groups, runtime, settle
from funcshard._src.comm.channel import Kind
from funcshard._src.comm.runtime import DesyncError
from funcshard._src.plan.plan import LeafPlan, Plan
from funcshard._src.shard.aliasing import first_shared
from funcshard._src.shard.digest import tensor_digest
from funcshard._src.shard.flat import FlatLayout, layouts, pack_local, unpack_gathered, whole_chunk
from funcshard._src.shard.sharded import FlatShard, ShardedTensor, flats_of


def shard(
    params: Any, plan: Plan, /, *, device: torch.device | str | None = None, verify: bool = True
) -> Any:
    """Keeps only this rank's shards of ``params``, packed per unit and dtype in flat buffers.

    Every rank calls it with the same full ``params`` (for example, initialized
    from the same seed). Each leaf of the result is a :class:`ShardedTensor`
    viewing its unit's flat buffer; nothing of the input is kept. Collective
    with ``verify``: the ranks compare a digest of ``params`` (one agreement).

    Args:
        params: the pytree ``plan`` was made for (same structure, shapes, dtypes).
        plan: the plan, on a mesh whose size is the world size.
        device: where the shards go; default: this rank's GPU under NCCL
            (``fs.device()``, ``cuda:LOCAL_RANK``), else where the leaves are.
        verify: check that every rank passed the same values (SHA-256 of every
            leaf, compared across ranks); ``False`` skips the hashing.

    Returns:
        A pytree of :class:`ShardedTensor` with the structure of ``params``.

    Raises:
        ValueError: the mesh does not match the world size, the tree, a shape or a
            dtype differs from the plan, leaves sit on different devices, two leaves
            share memory (a tie written as a view), some floating leaves require
            grad and others do not, ``device`` is not available here, or the
            shards would sit on a device the backend cannot carry (CUDA under
            gloo, the CPU under NCCL; see [Note: devices and backends] in
            ``comm/runtime.py``).
        TypeError: a leaf is not a tensor.
        DesyncError: with ``verify``, the ranks passed different values or plans; the
            message names the leaves that differ.

    Example:
        >>> import funcshard as fs
        >>> params = {"w": torch.arange(6.0).reshape(3, 2)}
        >>> sparams = fs.shard(params, fs.plan(params, fs.Mesh({"fsdp": 1})))
        >>> sparams["w"].local
        tensor([[0., 1.],
                [2., 3.],
                [4., 5.]])
    """
    target = _device(device)
    bound = groups.bind(plan.mesh)
    leaves = check_params(params, plan)
    target = _target(target, leaves)
    if verify:
        with settle.operation("fs.shard"):
            _agree_on_values(plan, leaves)
    return _shard(leaves, plan, bound.rank, target)


def shard_for_rank(
    params: Any, plan: Plan, rank: int, /, *, device: torch.device | str | None = None
) -> Any:
    """:func:`shard` for an explicit ``rank`` of ``plan.mesh``, with no process group.

    Pure: used by :func:`shard`, by tests that look at every rank from one
    process, and by tools that write per-rank files.
    """
    return _shard(check_params(params, plan), plan, rank, _device(device))


def _shard(leaves: list[torch.Tensor], plan: Plan, rank: int, device: torch.device | None) -> Any:
    target = device if device is not None else (leaves[0].device if leaves else torch.device("cpu"))
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
    with settle.operation("fs.unshard"):
        channel.agree_on(
            Kind.UNSHARD,
            "fs.unshard",
            {
                "buffers": [f"{f.layout.unit}:{f.layout.dtype}:{f.layout.numel}" for f in flats],
                "rank0_only": rank0_only,
            },
            hint="Every rank must unshard the same tree (same plan, same leaves)",
        )
        for flat in flats:
            data = whole_chunk(flat.layout, flat.data, flat.rank)  # the same size on every rank
            if rank0_only:
                gathered = collectives.gather_to_rank0(data, bound, tag=flat.layout.unit)
            else:
                gathered = collectives.all_gather(
                    data, bound, bound.mesh.axis_names, tag=flat.layout.unit
                ).wait()
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


def tree_difference(paths: list[str], plan: Plan, treedef: tree.TreeDef, /, *, given: str) -> str:
    """What differs between a tree of leaf ``paths`` and ``treedef`` and ``plan``'s, for messages."""
    expected = [leaf.path for leaf in plan.leaves]
    missing = [p for p in expected if p not in set(paths)]
    unexpected = [p for p in paths if p not in set(expected)]
    if missing or unexpected:
        return f"missing {missing}, unexpected {unexpected}"
    return f"the containers differ: plan {plan.treedef}, {given} {treedef}"


def check_leaf(where: str, leaf: Any, planned: LeafPlan, /, *, hint: str = "") -> None:
    """Raises unless ``leaf`` is a tensor of ``planned``'s shape and dtype; ``hint`` ends a TypeError.

    Raises:
        TypeError: ``leaf`` is not a tensor.
        ValueError: its shape or dtype is not the plan's.
    """
    if not isinstance(leaf, torch.Tensor):
        raise TypeError(f"{where}: leaf is a {type(leaf).__name__}, not a torch.Tensor{hint}")
    if tuple(leaf.shape) != planned.shape or leaf.dtype != planned.dtype:
        raise ValueError(
            f"{where}: leaf is {tuple(leaf.shape)} {leaf.dtype} but the plan has "
            f"{planned.shape} {planned.dtype}; plan these params"
        )


def check_params(params: Any, plan: Plan, /) -> list[torch.Tensor]:
    """The leaves of ``params`` if they fit ``plan``: same tree, tensors, shapes, dtypes, one device.

    Raises:
        ValueError: a mismatch; the message names the paths and what differs.
        TypeError: a leaf that is not a tensor.
    """
    paths, leaves, treedef = tree.flatten_with_paths(params)
    if treedef != plan.treedef:
        raise ValueError(
            f"params do not have the plan's tree structure: "
            f"{tree_difference(paths, plan, treedef, given='params')}; plan these params"
        )
    devices: dict[torch.device, str] = {}
    for path, leaf, lp in zip(paths, leaves, plan.leaves):
        check_leaf(path or "<root>", leaf, lp)
        devices.setdefault(leaf.device, path or "<root>")
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
    shared = first_shared(paths, leaves)
    if shared is not None:
        a, b, (s0, e0), (s1, e1) = shared
        raise ValueError(
            f"{b!r} shares memory with {a!r} (bytes [{s1}, {e1}) and [{s0}, {e0}) of one "
            f"storage): sharded, they would become two independent copies and drift apart "
            f"after the first update. A tied weight is one leaf: keep {a!r} in params and "
            f"derive the other inside loss_fn (for example params[...].T); or .clone() one of "
            f"them to untie"
        )
    floating = [
        (p, t)
        for p, t, lp in zip(paths, leaves, plan.leaves)
        if t.is_floating_point() and not lp.frozen
    ]
    if any(t.requires_grad for _, t in floating):
        frozen = [p or "<root>" for p, t in floating if not t.requires_grad]
        if frozen:
            raise ValueError(
                f"{frozen[:5]} have requires_grad=False while other leaves require grad: "
                f"funcshard computes gradients for every leaf of params that the plan does not "
                f"freeze, so requires_grad=False would be ignored. Freeze them in the plan: "
                f"fs.plan(..., frozen={frozen[:2]!r}) (sharded, no gradient, no optimizer "
                f"state), or give every leaf the same requires_grad"
            )
    return leaves


def _target(device: torch.device | None, leaves: list[torch.Tensor]) -> torch.device:
    """Where :func:`shard` puts the shards: ``device``, else the backend's default or the leaves' device.

    Raises:
        ValueError: the backend cannot carry tensors there; names the fix.
    """
    if device is None and runtime.backend() == "nccl":
        device = runtime.default_device()
    target = device or (leaves[0].device if leaves else torch.device("cpu"))
    shown = f"device={str(device)!r}" if device is not None else f"the leaves' device {target}"
    runtime.check_device(target, f"fs.shard: {shown}")
    return target


def _device(device: torch.device | str | None) -> torch.device | None:
    """``device`` as a ``torch.device`` this process can allocate on (``None`` stays ``None``).

    Raises:
        ValueError: not a device, or a device this torch cannot use here.
    """
    if device is None:
        return None
    try:
        target = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"fs.shard: device={device!r} is not a device ({e})") from None
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"fs.shard: device={device!r}, but this torch {torch.__version__} sees no CUDA device "
            f"(torch.cuda.is_available() is False); shard onto 'cpu', or install a CUDA build "
            f"of torch on a machine with a GPU"
        )
    try:
        torch.empty(0, device=target)
    except (RuntimeError, AssertionError) as e:
        raise ValueError(f"fs.shard: device={device!r} cannot be used here ({e})") from None
    return target


def _agree_on_values(plan: Plan, leaves: list[torch.Tensor]) -> None:
    """Every rank passed equal values to :func:`shard`; collective (one agreement, details on mismatch).

    Raises:
        DesyncError: the message names up to five leaves whose values differ from rank 0's.
    """
    digests = [tensor_digest(t) for t in leaves]
    everyone = channel.agree(
        Kind.SHARD, "fs.shard", channel.digest_of({"plan": plan.fingerprint(), "values": digests})
    )
    if everyone is None or all(d == everyone[0][0] for d, _ in everyone):
        return
    details = channel.all_gather_json(
        {"plan": plan.fingerprint(), "values": digests}, "the details of fs.shard"
    )
    reference = details[0]
    problems: list[str] = []
    for r, theirs in enumerate(details[1:], start=1):
        if theirs["plan"] != reference["plan"]:
            problems.append(
                f"rank {r}: plan fingerprint {theirs['plan']} (rank 0: {reference['plan']})"
            )
            continue
        differ = [
            leaf.path or "<root>"
            for leaf, mine, ref in zip(plan.leaves, theirs["values"], reference["values"])
            if mine != ref
        ]
        more = f" and {len(differ) - 5} more" if len(differ) > 5 else ""
        problems.append(f"rank {r}'s values of {differ[:5]}{more} differ from rank 0's")
    raise DesyncError(
        "fs.shard: ranks passed different plans or params: " + "; ".join(problems) + ". Every "
        "rank must build the same plan and pass the same full values (initialize with the same "
        "seed, or load one checkpoint); verify=False skips this check"
    )
