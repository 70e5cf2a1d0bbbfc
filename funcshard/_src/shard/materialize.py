"""``fs.materialize``: each rank generates only the shards it keeps, with values independent of the mesh.

The result is what :func:`funcshard.shard` would return for the whole
initialized tree, but no rank ever holds a whole leaf: every element comes from
its initializer as a function of ``(seed, leaf path, flat index)`` (see
[Note: counter rng v1] in ``shard/counter_rng.py``), generated block by block straight into the rank's
flat buffers. ``fs.unshard(fs.materialize(...))`` is therefore the same for
every world size, mesh, strategy and unit grouping.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from funcshard._src import tree
from funcshard._src.comm import runtime
from funcshard._src.plan.plan import Plan
from funcshard._src.plan.rules import matches, pattern_repr
from funcshard._src.shard import counter_rng
from funcshard._src.shard.flat import pieces
from funcshard._src.shard.initializers import Initializer, Key
from funcshard._src.shard.shard import (  # pyright: ignore[reportPrivateUsage]
    _device,
    check_leaf,
    plan_layouts,
    tree_difference,
)
from funcshard._src.shard.sharded import FlatShard, ShardedTensor


def materialize(
    abstract: Any,
    plan: Plan,
    init: Any,
    /,
    *,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> Any:
    """This rank's shards of the initialized params, generated in place: no rank builds a whole leaf.

    Not collective: each rank generates the elements it keeps, in blocks of at
    most ``2**20``, straight into its flat buffers (padding zero). Values are a
    function of ``(seed, leaf path, flat index)`` only, so
    ``fs.unshard(fs.materialize(...))`` is bit-identical for every world size,
    mesh, strategy and unit grouping.

    Args:
        abstract: the params' shapes and dtypes: a pytree of tensors, typically on
            the ``meta`` device, with ``plan``'s structure (real tensors are read
            for their shape and dtype only).
        plan: the plan, on a mesh whose size is the world size.
        init: a pytree of :class:`~funcshard.initializers.Initializer` with the
            params' structure, or rules ``[(pattern, initializer), ...]`` over leaf
            paths (the first match wins; patterns as in ``fs.plan``'s rules).
        seed: an int in ``[0, 2**64)``.
        device: where the shards go; default: this rank's GPU under NCCL
            (``fs.device()``), else the leaves' device, or the CPU for ``meta``
            leaves. Values are computed on the CPU whatever it is.

    Returns:
        A pytree of :class:`ShardedTensor` with the structure of ``abstract``:
        what :func:`funcshard.shard` returns for the whole initialized tree.

    Raises:
        ValueError: the mesh does not match the world size; the tree, a shape or a
            dtype differs from the plan; a leaf no rule matches or a rule that
            matches no leaf; an initializer that does not fit its leaf's shape; a
            seed out of range; ``device`` is not available here.
        TypeError: a leaf that is not a tensor, an ``init`` that is not
            initializers, a random initializer on an integer leaf, or a seed that
            is not an int.

    Example:
        >>> import funcshard as fs
        >>> abstract = {"w": torch.empty(4, 2, device="meta"), "b": torch.empty(2, device="meta")}
        >>> plan = fs.plan(abstract, fs.Mesh({"fsdp": 1}))
        >>> init = [("**/b", fs.initializers.zeros), ("**", fs.initializers.normal(0.02))]
        >>> sparams = fs.materialize(abstract, plan, init, seed=0)
        >>> sparams["b"].local
        tensor([0., 0.])
        >>> w = fs.unshard(sparams)["w"]
        >>> torch.equal(w, fs.initializers.normal(0.02)(fs.initializers.Key(0, "w"), (4, 2)))
        True
    """
    world_size = runtime.world_size()
    if plan.mesh.size != world_size:
        hint = (
            "run under torchrun and call funcshard.init() first, or plan for a mesh of size 1 "
            "(materialize_for_rank builds any rank's shards in one process)"
            if not runtime.is_distributed()
            else f"make the product of the axis sizes {world_size}"
        )
        raise ValueError(
            f"{plan.mesh!r} has {plan.mesh.size} ranks but the world size is {world_size}; {hint}"
        )
    if device is None and runtime.backend() == "nccl":
        device = runtime.default_device()  # See [Note: devices and backends] (comm/runtime.py)
    return materialize_for_rank(abstract, plan, init, runtime.rank(), seed=seed, device=device)


def materialize_for_rank(
    abstract: Any,
    plan: Plan,
    init: Any,
    rank: int,
    /,
    *,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> Any:
    """:func:`materialize` for an explicit ``rank`` of ``plan.mesh``, with no process group.

    Pure: used by :func:`materialize`, by tests that look at every rank from one
    process, and by tools that write per-rank files. Equals
    ``shard_for_rank(full, plan, rank)`` of the whole initialized tree.

    Example:
        >>> import funcshard as fs
        >>> abstract = {"w": torch.empty(3, device="meta")}
        >>> plan = fs.plan(abstract, fs.Mesh({"fsdp": 2}))
        >>> [materialize_for_rank(abstract, plan, {"w": fs.initializers.ones}, r)["w"].local for r in (0, 1)]
        [tensor([1., 1.]), tensor([1.])]
    """
    counter_rng.check_seed(seed)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < plan.mesh.size:  # pyright: ignore[reportUnnecessaryIsInstance]
        raise ValueError(
            f"rank must be an int in [0, {plan.mesh.size}) for {plan.mesh!r}, got {rank!r}"
        )
    leaves = check_abstract(abstract, plan)
    inits = resolve_init(init, plan)
    for leaf, initializer in zip(plan.leaves, inits):  # every rank refuses the same leaves
        initializer.check(leaf.path, leaf.shape, leaf.dtype)
    target = _device(device)
    if target is None:
        real = {t.device for t in leaves if t.device.type != "meta"}
        target = real.pop() if len(real) == 1 else torch.device("cpu")
    out: list[Any] = [None] * len(leaves)
    for layout in plan_layouts(plan):
        data = torch.zeros(layout.numel, dtype=layout.dtype, device=target)  # (numel,) padding 0
        for slot in layout.slots:
            for index, view in pieces(data, slot, rank):  # one box, or a flat range's boxes
                corner = tuple(s.indices(n)[0] for s, n in zip(index, slot.shape))
                inits[slot.index].fill_(view, Key(seed, slot.path), slot.shape, corner)
        flat = FlatShard(layout, data, rank)
        for slot in layout.slots:
            out[slot.index] = ShardedTensor(flat, slot)
    return tree.unflatten(plan.treedef, out)


def check_abstract(abstract: Any, plan: Plan, /) -> list[torch.Tensor]:
    """The leaves of ``abstract`` if they fit ``plan``: same tree, tensors, shapes and dtypes.

    Raises:
        ValueError: a mismatch; the message names the paths and what differs.
        TypeError: a leaf that is not a tensor.
    """
    paths, leaves, treedef = tree.flatten_with_paths(abstract)
    if treedef != plan.treedef:
        raise ValueError(
            f"abstract does not have the plan's tree structure: "
            f"{tree_difference(paths, plan, treedef, given='given')}; plan these params"
        )
    for path, leaf, lp in zip(paths, leaves, plan.leaves):
        check_leaf(
            path or "<root>",
            leaf,
            lp,
            hint="; abstract params are tensors, e.g. torch.empty(shape, dtype=..., device='meta')",
        )
    return leaves


def resolve_init(init: Any, plan: Plan, /) -> list[Initializer]:
    """One initializer per leaf of ``plan`` (leaf order), from a pytree of them or from rules.

    Raises:
        ValueError: the tree does not match the plan's; a leaf no rule matches; a rule
            that initializes no leaf.
        TypeError: an entry that is not an initializer, or a malformed rule.

    Example:
        >>> import funcshard as fs
        >>> plan = fs.plan({"w": torch.empty(2, 2), "b": torch.empty(2)}, fs.Mesh({"x": 1}))
        >>> resolve_init([("b", fs.initializers.zeros), ("**", fs.initializers.normal(0.02))], plan)
        [zeros, normal(std=0.02)]
    """
    paths = [leaf.path for leaf in plan.leaves]
    if _is_rules(init):
        return _from_rules(init, paths)
    inits_paths, inits, treedef = tree.flatten_with_paths(init)
    if treedef != plan.treedef:
        raise ValueError(
            f"init is not a pytree of initializers with the params' structure: "
            f"{tree_difference(inits_paths, plan, treedef, given='given')}; give every leaf an initializer, "
            f"or pass rules [(pattern, initializer), ...] ending with a catch-all "
            f"('**', fs.initializers.normal(0.02))"
        )
    for path, value in zip(inits_paths, inits):
        if not isinstance(value, Initializer):
            raise TypeError(_not_an_initializer(path or "<root>", value))
    return list(inits)


def _is_rules(init: Any) -> bool:
    """Whether ``init`` is a rule list: a list or tuple of ``(pattern, initializer)`` pairs."""
    return (
        isinstance(init, (list, tuple))
        and not hasattr(init, "_fields")  # a namedtuple is a tree node
        and len(init) > 0  # pyright: ignore[reportUnknownArgumentType]
        and all(
            isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[0], (str, re.Pattern))  # pyright: ignore[reportUnknownArgumentType]
            for rule in init  # pyright: ignore[reportUnknownVariableType]
        )
    )


def _from_rules(rules: Sequence[tuple[Any, Any]], paths: list[str]) -> list[Initializer]:
    for i, (pattern, value) in enumerate(rules):
        if not isinstance(value, Initializer):
            raise TypeError(
                f"init rules[{i}] ({pattern_repr(pattern)}, {value!r}): "
                + _not_an_initializer(None, value)
            )
    used = [False] * len(rules)
    out: list[Initializer] = []
    for path in paths:
        i = next((i for i, (pattern, _) in enumerate(rules) if matches(pattern, path)), None)
        if i is None:
            raise ValueError(
                f"{path or '<root>'}: no init rule matches this leaf; add a rule for it, e.g. "
                f"({path!r}, fs.initializers.zeros), or end the rules with a catch-all "
                f"('**', fs.initializers.normal(0.02))"
            )
        used[i] = True
        out.append(rules[i][1])
    unused = [i for i, hit in enumerate(used) if not hit]
    if unused:
        i = unused[0]
        pattern = rules[i][0]
        earlier = [
            j
            for j in range(i)
            if any(matches(pattern, p) and matches(rules[j][0], p) for p in paths)
        ]
        why = (
            f"every leaf it matches is initialized by an earlier rule "
            f"({', '.join(f'rules[{j}]' for j in earlier)}), since the first match wins. Move "
            f"it before them, or drop it"
            if earlier
            else f"it matches no leaf (leaf paths look like {', '.join(map(repr, paths[:6]))}); "
            f"fix the pattern, or drop the rule"
        )
        raise ValueError(
            f"init rules[{i}] ({pattern_repr(pattern)}, {rules[i][1]!r}) initializes no leaf: {why}"
        )
    return out


def _not_an_initializer(path: str | None, value: object) -> str:
    where = f"{path}: " if path is not None else ""
    what = (
        f"a tensor {tuple(value.shape)} {value.dtype}"
        if isinstance(value, torch.Tensor)
        else f"{type(value).__name__} {value!r}"
    )
    fix = (
        "init takes initializers, not values: materialize generates the values"
        if isinstance(value, torch.Tensor)
        else f"use fs.initializers.constant({value!r})"
        if isinstance(value, (int, float)) and not isinstance(value, bool)
        else "use one of fs.initializers (zeros, normal(0.02), ...), or elementwise(fn) for your own"
    )
    return f"{where}{what} is not an initializer; {fix}"
