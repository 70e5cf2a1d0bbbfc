"""``fs.call``: run a function on one unit's parameters, gathered just for it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import torch
import torch.utils.checkpoint

from funcshard._src import tree
from funcshard._src.execute.call_record import CallRecord, owned, watch
from funcshard._src.execute.compiled import compiled_call
from funcshard._src.execute.replay import replay
from funcshard._src.execute.run import Run, current_run, step_run
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

    In backward, a call is the recompute of an activation checkpoint
    (``torch.utils.checkpoint.checkpoint``, reentrant or not, around ``fs.call``):
    it runs ``fn`` again on the unit's gathered leaves, re-gathering the unit if it
    was released (see [Note: recomputes in backward] in ``replay.py``).

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
        backward = step_run()
        if backward is not None and backward.forward_done and _holds_sharded(unit):
            return _replay(backward, fn, unit, args, kwargs, remat=remat)
        _refuse_sharded_outside_a_step(unit)
        return fn(unit, *args, **kwargs)
    _refuse_nesting(run, unit)
    runtime, leaves, treedef = _identify(run, unit)
    record, full = run.enter_call(runtime, leafwise=True)
    full_tree = tree.unflatten(
        treedef, [full[runtime.position[leaf.slot.index]] for leaf in leaves]
    )
    # See [Note: what a call may do to its parameters] in call_record.py
    guard = watch(runtime.name, runtime.slots, full)
    out = _run_fn(run, record, fn, full_tree, args, kwargs, remat=remat)
    guard.check()
    out = owned(out, full)
    run.exit_call(record, out)
    return out


def _replay(
    run: Run,
    fn: Callable[..., _R],
    unit: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    remat: bool,
) -> _R:
    """A call in backward: ``fn`` again on the unit's gathered leaves; see [Note: recomputes in backward] in ``execute/replay.py``.

    It computes what the forward's call computed, in the same way (``remat``, the
    output cast), so that a checkpoint's recompute saves the same tensors.
    """
    _refuse_nesting(run, unit)
    runtime, leaves, treedef = _identify(run, unit)
    full = replay(run, runtime)
    full_tree = tree.unflatten(
        treedef, [full[runtime.position[leaf.slot.index]] for leaf in leaves]
    )
    return owned(_run_fn(run, runtime, fn, full_tree, args, kwargs, remat=remat), full)


def _run_fn(
    run: Run,
    record: CallRecord | UnitRuntime,
    fn: Callable[..., _R],
    full_tree: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    remat: bool,
) -> _R:
    """``fn(full_tree, *args, **kwargs)`` as a call of ``run``: ``record``, or a replay of that unit's."""
    if isinstance(record, CallRecord):
        run.active = record
    else:
        run.replaying = record
    try:
        if remat:
            treedef = tree.flatten(full_tree)[1]

            def rerun(*full_leaves: torch.Tensor) -> Any:
                return fn(tree.unflatten(treedef, list(full_leaves)), *args, **kwargs)

            out = torch.utils.checkpoint.checkpoint(
                rerun, *tree.flatten(full_tree)[0], use_reentrant=False
            )
        else:
            out = fn(full_tree, *args, **kwargs)
    finally:
        run.active = None
        run.replaying = None
    output_dtype = run.output_dtype
    if output_dtype is not None:
        out = tree.tree_map(
            lambda t: (
                t.to(output_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            ),
            out,
        )
    return out


def _refuse_nesting(run: Run, unit: Any) -> None:
    inside = run.active.unit if run.active is not None else run.replaying
    if inside is not None:
        raise RuntimeError(
            f"nested fs.call: unit {_describe(unit)} was called inside the function of unit "
            f"{inside.name!r}; units cannot nest: call them one after the other from loss_fn"
        )


def _holds_sharded(unit: Any) -> bool:
    return any(isinstance(leaf, ShardedTensor) for leaf in tree.leaves(unit))


def running_unit() -> tuple[Run, UnitRuntime] | None:
    """The run and the unit whose function ``fs.call`` is running now (a call, or its replay in backward).

    Example:
        >>> running_unit() is None
        True
    """
    run = current_run()
    if run is not None and run.active is not None:
        return run, run.active.unit
    backward = step_run()
    if backward is not None and backward.replaying is not None:
        return backward, backward.replaying
    return None


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
        found = run.flat_owner.get(leaf.flat)
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
        owner = run.flat_owner.get(leaf.flat)
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
