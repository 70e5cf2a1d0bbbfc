"""``fs.call``: run a function on one unit's parameters, gathered just for it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import torch
import torch.utils.checkpoint

from funcshard._src import tree
from funcshard._src.execute.compiled import compiled_call
from funcshard._src.execute.run import Run, current_run
from funcshard._src.execute.unit_state import UnitRuntime
from funcshard._src.shard.sharded import ShardedTensor

_R = TypeVar("_R")


def call(fn: Callable[..., _R], unit: Any, /, *args: Any, remat: bool = False, **kwargs: Any) -> _R:
    """Runs ``fn(unit, *args, **kwargs)`` with ``unit``'s parameters gathered: one unit, one all-gather.

    Inside a step of :func:`funcshard.value_and_grad`, ``unit`` must be exactly
    one unit's subtree of the params the step passed to ``loss_fn`` (for
    ``units=["blocks/*"]``, ``params["blocks"][i]``). Its leaves are gathered
    with one all-gather per dtype, ``fn`` runs on the full tensors, and the unit
    is freed again (``full_shard``); backward re-gathers it and reduce-scatters
    its gradients. Anywhere else, ``call`` is just ``fn(unit, *args, **kwargs)``.

    Args:
        fn: a function of the unit's subtree of full tensors and ``args``.
        unit: the unit's subtree.
        *args: further arguments of ``fn`` (activations, ...).
        remat: recompute ``fn``'s activations in backward instead of keeping them
            (non-reentrant checkpointing); the parameters are re-gathered for it.
        **kwargs: keyword arguments of ``fn``.

    Returns:
        What ``fn`` returns (floating outputs cast to ``MixedPrecision.output_dtype`` if set).

    Raises:
        ValueError: ``unit`` is not exactly one unit's subtree; the message lists the
            paths given and the units there are.
        RuntimeError: ``call`` inside another ``call``'s function.

    Example:
        >>> import torch
        >>> call(lambda p, x: x @ p["w"], {"w": torch.eye(2)}, torch.ones(1, 2))
        tensor([[1., 1.]])
    """
    if torch.compiler.is_compiling():  # see [Note: compiled calls] in compiled.py
        return compiled_call(fn, unit, args, kwargs, remat=remat)
    run = current_run()
    if run is None:
        _refuse_sharded_outside_a_step(unit)
        return fn(unit, *args, **kwargs)
    if run.active is not None:
        raise RuntimeError(
            f"nested fs.call: unit {_describe(unit)} was called inside the function of unit "
            f"{run.active.unit.name!r}; units cannot nest: call them one after the other from loss_fn"
        )
    runtime, leaves, treedef = _identify(run, unit)
    record, full = run.enter_call(runtime, leafwise=True)
    full_tree = tree.unflatten(
        treedef, [full[runtime.position[leaf.slot.index]] for leaf in leaves]
    )
    run.active = record
    try:
        if remat:

            def rerun(*full_leaves: torch.Tensor) -> Any:
                return fn(tree.unflatten(treedef, list(full_leaves)), *args, **kwargs)

            out = torch.utils.checkpoint.checkpoint(
                rerun, *tree.flatten(full_tree)[0], use_reentrant=False
            )
        else:
            out = fn(full_tree, *args, **kwargs)
    finally:
        run.active = None
    output_dtype = run.output_dtype
    if output_dtype is not None:
        out = tree.tree_map(
            lambda t: (
                t.to(output_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            ),
            out,
        )
    run.exit_call(record, out)
    return out


def _identify(run: Run, unit: Any) -> tuple[UnitRuntime, list[ShardedTensor], tree.TreeDef]:
    """The unit runtime behind ``unit``, its sharded leaves and structure; errors name what is wrong.

    The common case costs one flatten and a set comparison per call; paths and
    messages are built only for a subtree that is not exactly one unit's.
    """
    leaves, treedef = tree.flatten(unit)
    owner: UnitRuntime | None = None
    for leaf in leaves:
        if not isinstance(leaf, ShardedTensor):
            break
        found = run.flat_owner.get(id(leaf.flat))
        if found is None or (owner is not None and found is not owner):
            break
        owner = found
    else:
        if (
            owner is not None
            and len(leaves) == len(owner.slots)
            and {leaf.slot.index for leaf in leaves} == owner.index_set
        ):
            return owner, leaves, treedef
    return _refuse(run, unit)


def _refuse(run: Run, unit: Any) -> NoReturn:
    """Raises the error that says why ``unit`` is not exactly one unit's subtree of this step's params."""
    paths, leaves, _ = tree.flatten_with_paths(unit)
    units = sorted(run.units)
    if not leaves:
        raise ValueError(
            f"fs.call got a subtree without leaves; pass one unit's subtree (units: {units})"
        )
    for path, leaf in zip(paths, leaves):
        if isinstance(leaf, ShardedTensor):
            continue
        if id(leaf) in run.root_leaf_ids:
            raise ValueError(
                "fs.call got a leaf of the root unit: root-unit leaves are full tensors inside loss_fn; "
                f"use them directly, or name their subtree in plan(units=...) (units: {units})"
            )
        raise ValueError(
            f"fs.call got a {type(leaf).__name__} at {path or '<root>'!r} where a unit's leaves should be: "
            f"pass a subtree of the params that the step gave loss_fn, e.g. params['blocks'][0] (units: {units})"
        )
    sharded = [leaf for leaf in leaves if isinstance(leaf, ShardedTensor)]
    owners: dict[str, UnitRuntime] = {}
    for leaf in sharded:
        owner = run.flat_owner.get(id(leaf.flat))
        if owner is None:
            raise ValueError(
                f"fs.call got {leaf.path!r}, which is not from the params this step was called with; "
                f"pass subtrees of the params loss_fn receives"
            )
        owners[owner.name] = owner
    if len(owners) > 1:
        raise ValueError(
            f"fs.call got leaves of {len(owners)} units {sorted(owners)} ({[x.path for x in sharded]}); "
            f"pass exactly one unit's subtree (units: {units})"
        )
    (runtime,) = owners.values()
    given = [x.path for x in sharded]
    given_set = set(given)
    missing = [p for p in runtime.unit.paths if p not in given_set]
    twice = sorted({p for p in given if given.count(p) > 1})
    problem = f"missing {missing}" if missing else f"{twice} given twice"
    raise ValueError(
        f"fs.call got {len(given_set)} of the {len(runtime.unit.paths)} leaves of unit "
        f"{runtime.name!r} ({problem}); pass the unit's whole subtree"
    )


def _refuse_sharded_outside_a_step(unit: Any) -> None:
    for leaf in tree.leaves(unit):
        if isinstance(leaf, ShardedTensor):
            raise ValueError(
                f"fs.call got the sharded leaf {leaf.path!r} outside a step: sharded params are "
                f"gathered only by a step of fs.value_and_grad; outside one, pass full tensors "
                f"(fs.unshard gives them)"
            )


def _describe(unit: Any) -> str:
    leaves = tree.leaves(unit)
    names = sorted({leaf.unit for leaf in leaves if isinstance(leaf, ShardedTensor)})
    return repr(names[0]) if len(names) == 1 else repr(names)
