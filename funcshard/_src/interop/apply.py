"""``Apply``: a module's forward as a pure function of its parameter pytree.

See [Note: module trees] in ``module.py`` for the tree it takes, and
[Note: tied parameters] in ``module_tree.py`` for tensors used in several places.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeAlias

import torch
import torch.func
from torch import nn

from funcshard._src import tree
from funcshard._src.execute.call import call
from funcshard._src.execute.run import current_run
from funcshard._src.interop.module_tree import subtree_at
from funcshard._src.interop.module_units import UnitInfo, Units
from funcshard._src.shard.sharded import ShardedTensor

Params: TypeAlias = Any  # nested dicts and lists of tensors, see [Note: module trees]


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One tensor of the params or state tree and every dotted name the module uses for it."""

    path: str
    names: tuple[str, ...]
    unit: str | None  # the unit path holding it; None: the root unit (or state)


class Apply:
    """A module as a pure function of its params: ``apply(params, *args, **kwargs)``.

    Built by :func:`functionalize`. ``apply`` runs the module's own ``forward`` through
    ``torch.func.functional_call`` with the leaves of ``params``; inside the ``loss_fn``
    of :func:`funcshard.value_and_grad`, each unit submodule's forward goes through
    :func:`funcshard.call` by itself, so its parameters are gathered just for it.

    Attributes:
        module: the module (its parameters are not used by ``apply``; its state is).
        units: unit patterns for :func:`funcshard.plan` (``units=apply.units``).
        unit_paths: the path of every unit submodule, in module order.
        state: the non-trainable tensors (buffers, frozen parameters) as a tree like
            the params; ``apply`` uses exactly these, replicated on every rank.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        treedef: tree.TreeDef,
        leaves: Sequence[Leaf],
        state: Any,
        state_leaves: Sequence[Leaf],
        units: Units,
        patterns: tuple[str | re.Pattern[str], ...],
        remat: bool = False,
    ) -> None:
        self._module = module
        self._treedef = treedef
        self._leaves = tuple(leaves)
        self._state = state
        self._state_tensors = {
            name: tensor
            for leaf, tensor in zip(state_leaves, _by_paths(state, state_leaves))
            for name in leaf.names
        }
        self._units = units
        self._patterns = patterns
        self._remat = remat
        self._active = False

    @property
    def module(self) -> nn.Module:
        """The functionalized module."""
        return self._module

    @property
    def units(self) -> tuple[str | re.Pattern[str], ...]:
        """Patterns naming exactly the unit subtrees: pass them as ``fs.plan(..., units=apply.units)``."""
        return self._patterns

    @property
    def unit_paths(self) -> tuple[str, ...]:
        """The path of every unit submodule (``model/layers/0``, ...), in module order."""
        return self._units.paths

    @property
    def state(self) -> Any:
        """Buffers and frozen parameters as a tree like the params (``{}`` if there are none)."""
        return self._state

    def __call__(self, params: Params, /, *args: Any, **kwargs: Any) -> Any:
        """Runs the module's forward on ``args`` and ``kwargs`` with the leaves of ``params``.

        Pure in ``params``: the module's own parameters are neither read nor changed.
        While it runs, each unit submodule's ``forward`` is replaced by one that goes
        through :func:`funcshard.call` (an instance attribute, removed again when apply
        returns or raises), so one module serves one ``apply`` at a time. A forward that
        updates buffers in place (batch-norm statistics) updates ``apply.state``, on
        each rank separately.

        Args:
            params: the tree :func:`functionalize` returned, or one of its structure:
                full tensors, or inside a step's ``loss_fn`` the params the step passes.
            *args: positional arguments of the module's ``forward``.
            **kwargs: keyword arguments of the module's ``forward``.

        Returns:
            What the module's forward returns.

        Raises:
            ValueError: ``params`` has another structure, holds sharded leaves outside a
                step, or was planned with other units than ``apply.units``.
            RuntimeError: ``apply`` called inside a forward of the same module.
        """
        by_path = self._leaf_values(params)
        tensors: dict[str, Any] = dict(self._state_tensors)
        for leaf in self._leaves:
            if leaf.unit is None:
                tensors.update(dict.fromkeys(leaf.names, by_path[leaf.path]))
        forwards = [
            (unit.module, self._unit_forward(unit, unit.module.forward, params, by_path))
            for unit in self._units.infos
        ]
        with self._forwards_through_call(forwards):
            return torch.func.functional_call(
                self._module, tensors, args, kwargs, tie_weights=False, strict=False
            )

    def state_dict(self, params: Params, /) -> dict[str, torch.Tensor]:
        """The module's ``state_dict`` with the values of ``params`` (and of the state).

        For ``module.load_state_dict`` or a Hugging Face ``save_pretrained``: every key
        of ``module.state_dict()``, tied names included.

        Raises:
            ValueError: ``params`` has another structure or holds sharded leaves
                (``fs.unshard`` them first).

        Example:
            >>> import funcshard as fs
            >>> lin = torch.nn.Linear(2, 1)
            >>> params, apply = fs.interop.functionalize(lin)
            >>> sorted(apply.state_dict(params)) == sorted(lin.state_dict())
            True
        """
        by_path = self._leaf_values(params, what="state_dict")
        values: dict[str, Any] = dict(self._state_tensors)
        for leaf in self._leaves:
            values.update(dict.fromkeys(leaf.names, by_path[leaf.path]))
        return {
            key: values[key] if key in values else value.detach()
            for key, value in self._module.state_dict(keep_vars=True).items()
        }

    def __repr__(self) -> str:
        return (
            f"Apply({type(self._module).__name__}, {len(self._leaves)} leaves, "
            f"units={list(self.units)})"
        )

    # -- internals ---------------------------------------------------------------

    @contextlib.contextmanager
    def _forwards_through_call(
        self, forwards: Sequence[tuple[nn.Module, Callable[..., Any]]]
    ) -> Iterator[None]:
        """Replaces each unit submodule's ``forward`` for the duration of one apply; mutates the modules.

        The replacement is an instance attribute, which ``nn.Module.__call__`` finds
        before the class's ``forward``; on exit (return or error) every module gets
        back exactly what it had (no instance attribute, or its own). One module
        serves one apply at a time: an apply inside the module's own forward would
        route the inner forward through the outer one's units, so it is refused.

        Raises:
            RuntimeError: apply called inside its own module's forward.
        """
        if self._active:
            raise RuntimeError(
                f"apply of {type(self._module).__name__} was called inside its own forward; "
                f"apply does not nest"
            )
        self._active = True
        saved: list[tuple[nn.Module, Any]] = []
        try:
            for module, forward in forwards:
                instance = vars(module)
                saved.append((module, instance.get("forward", _MISSING)))
                instance["forward"] = forward
            yield
        finally:
            for module, forward in saved:
                if forward is _MISSING:
                    del vars(module)["forward"]
                else:
                    vars(module)["forward"] = forward
            self._active = False

    def _leaf_values(self, params: Params, *, what: str = "apply") -> dict[str, Any]:
        """The leaves of ``params`` by path, checked against the tree and, in a step, the plan."""
        paths, values, treedef = tree.flatten_with_paths(params)
        if treedef != self._treedef:
            raise ValueError(
                f"{what}: params do not have the structure functionalize returned for "
                f"{type(self._module).__name__} (got {treedef}); pass that tree, its fs.shard, "
                f"or what a step gives loss_fn"
            )
        by_path = dict(zip(paths, values))
        run = current_run()
        for leaf in self._leaves:
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
            if planned != leaf.unit:
                where = f"in unit {planned!r}" if planned else "in the root unit"
                mine = f"unit {leaf.unit!r}" if leaf.unit else "the root unit"
                raise ValueError(
                    f"{leaf.path}: the plan puts this leaf {where}, but functionalize made it part "
                    f"of {mine}; plan with the same units: fs.plan(params, mesh, units=apply.units)"
                )
        return by_path

    def _unit_forward(
        self, unit: UnitInfo, forward: Callable[..., Any], params: Params, by_path: dict[str, Any]
    ) -> Callable[..., Any]:
        """The forward that replaces ``unit.module.forward`` during one apply."""
        subtree = subtree_at(params, unit.path)
        runner = _Runner(unit.module, forward)

        def run(full: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            rel_paths, leaves, _ = tree.flatten_with_paths(full)
            tensors: dict[str, Any] = {}
            for rel, leaf in zip(rel_paths, leaves):
                tensors.update(dict.fromkeys((f"m.{name}" for name in unit.own[rel]), leaf))
            for name, root_path in unit.borrowed:
                tensors[f"m.{name}"] = by_path[root_path]
            out = torch.func.functional_call(
                runner, tensors, args, kwargs, tie_weights=False, strict=False
            )
            return out, _hidden_tensors(out, unit.path)

        def unit_forward(*args: Any, **kwargs: Any) -> Any:
            return call(run, subtree, args, kwargs, remat=self._remat)[0]

        return unit_forward


class _Runner(nn.Module):
    """Runs one submodule's ``forward`` (not its ``__call__``, whose hooks already ran)."""

    def __init__(self, module: nn.Module, forward: Callable[..., Any]) -> None:
        super().__init__()
        self.m = module
        self._forward = forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(*args, **kwargs)


_MISSING = object()


def _by_paths(tree_: Any, leaves: Sequence[Leaf]) -> list[torch.Tensor]:
    paths, values, _ = tree.flatten_with_paths(tree_)
    by_path = dict(zip(paths, values))
    return [by_path[leaf.path] for leaf in leaves]


def _hidden_tensors(out: Any, unit: str) -> list[torch.Tensor]:
    """Tensors that need grad in ``out`` but that funcshard's tree does not flatten to.

    fs.call hooks a unit's outputs to re-gather the unit before its backward; outputs
    inside containers the tree does not know (a Hugging Face ``ModelOutput``) are
    handed to it here as well.
    """
    reachable = {id(t) for t in tree.leaves(out) if isinstance(t, torch.Tensor)}
    found: list[torch.Tensor] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            if x.requires_grad and id(x) not in reachable:
                found.append(x)
        elif isinstance(x, Mapping):
            for v in x.values():  # pyright: ignore[reportUnknownVariableType]
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:  # pyright: ignore[reportUnknownVariableType]
                walk(v)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            for f in dataclasses.fields(x):
                walk(getattr(x, f.name))

    walk(out)
    run = current_run()
    if found and run is not None and run.output_dtype is not None:
        raise ValueError(
            f"unit {unit!r} returned a {type(out).__name__}, whose tensors funcshard's tree "
            f"does not reach, so MixedPrecision(output_dtype=...) cannot cast them; return "
            f"tensors, tuples or dicts from the unit's forward, or leave output_dtype unset"
        )
    return found
