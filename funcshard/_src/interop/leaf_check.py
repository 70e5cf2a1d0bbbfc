"""The params ``apply`` gets, checked against the tree :func:`functionalize` returned and the step's plan."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from funcshard._src import tree
from funcshard._src.execute.run import current_run
from funcshard._src.shard.sharded import ShardedTensor

__all__ = ["Leaf", "leaf_values"]


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One tensor of the params or state tree and every dotted name the module uses for it."""

    path: str
    names: tuple[str, ...]
    unit: str | None  # the unit path holding it; None: the root unit (or state)
    frozen: bool = False  # a parameter with requires_grad=False


def leaf_values(
    params: Any,
    /,
    *,
    treedef: tree.TreeDef,
    leaves: Sequence[Leaf],
    module: str,
    what: str = "apply",
) -> dict[str, Any]:
    """The leaves of ``params`` by path, checked against ``treedef`` and, in a step, the plan.

    Args:
        params: what apply (or another method) got.
        treedef: the structure :func:`functionalize` returned.
        leaves: the leaves of that tree.
        module: the module's class name, for messages.
        what: the method, for messages.

    Raises:
        ValueError: another structure; a sharded leaf outside a step; in a step, a
            plan with other units or other frozen leaves than ``functionalize``'s.

    Example:
        >>> leaf = Leaf("w", ("w",), None)
        >>> _, _, treedef = tree.flatten_with_paths({"w": torch.ones(1)})
        >>> leaf_values({"w": torch.ones(1)}, treedef=treedef, leaves=[leaf], module="Net")
        {'w': tensor([1.])}
    """
    paths, values, got = tree.flatten_with_paths(params)
    if got != treedef:
        raise ValueError(
            f"{what}: params do not have the structure functionalize returned for "
            f"{module} (got {got}); pass that tree, its fs.shard, or what a step gives loss_fn"
        )
    by_path = dict(zip(paths, values))
    run = current_run()
    for leaf in leaves:
        value = by_path[leaf.path]
        sharded = isinstance(value, ShardedTensor)
        if run is None and sharded:
            raise ValueError(
                f"{leaf.path}: {what} got a sharded leaf outside a step; pass full tensors "
                f"(fs.unshard(sparams)), or call apply inside the loss_fn of fs.value_and_grad"
            )
        if run is None:
            continue
        planned = value.unit if isinstance(value, ShardedTensor) else None
        # a root-unit leaf arrives whole: frozen ones do not require grad
        frozen = value.frozen if sharded else not value.requires_grad
        if frozen != leaf.frozen and (sharded or torch.is_grad_enabled()):
            said = "frozen" if frozen else "trainable"
            really = "a frozen parameter" if leaf.frozen else "a trainable parameter"
            raise ValueError(
                f"{leaf.path}: the plan makes this leaf {said}, but it is {really} of "
                f"{module}; plan with fs.plan(params, mesh, units=apply.units, frozen=apply.frozen)"
            )
        if planned != leaf.unit:
            where = f"in unit {planned!r}" if planned else "in the root unit"
            mine = f"unit {leaf.unit!r}" if leaf.unit else "the root unit"
            raise ValueError(
                f"{leaf.path}: the plan puts this leaf {where}, but functionalize made it part "
                f"of {mine}; plan with the same units: fs.plan(params, mesh, units=apply.units)"
            )
    return by_path
