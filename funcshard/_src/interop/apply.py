"""``Apply``: a module's forward as a pure function of its parameter pytree.

See [Note: module trees] in ``module.py`` for the tree it takes, and
[Note: tied parameters] in ``module_tree.py`` for tensors used in several places.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeAlias

import torch
import torch.func
from torch import nn

from funcshard._src import tree
from funcshard._src.execute.call import call
from funcshard._src.execute.run import current_run
from funcshard._src.interop import hf_checkpointing as hf
from funcshard._src.interop.forwards import Runner, hidden_tensors, replaced_forwards
from funcshard._src.interop.module_init import materialize_buffers, materialize_module
from funcshard._src.interop.module_tree import subtree_at
from funcshard._src.interop.module_units import UnitInfo, Units
from funcshard._src.plan.plan import Plan
from funcshard._src.shard.sharded import ShardedTensor

Params: TypeAlias = Any  # nested dicts and lists of tensors, see [Note: module trees]


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One tensor of the params or state tree and every dotted name the module uses for it."""

    path: str
    names: tuple[str, ...]
    unit: str | None  # the unit path holding it; None: the root unit (or state)
    frozen: bool = False  # a parameter with requires_grad=False


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
        frozen: the paths of frozen parameters (``requires_grad=False``), for
            ``fs.plan(..., frozen=apply.frozen)``.
        state: the buffers as a tree like the params; ``apply`` uses exactly these,
            replicated on every rank.
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
        caches: hf.CacheOff | None = None,  # a Hugging Face model's: hf.cache_off(module)
    ) -> None:
        self._module = module
        self._treedef = treedef
        self._leaves = tuple(leaves)
        self._state = state
        self._state_leaves = tuple(state_leaves)
        self._state_tensors = {
            name: tensor
            for leaf, tensor in zip(state_leaves, _by_paths(state, state_leaves))
            for name in leaf.names
        }
        self._units = units
        self._patterns = patterns
        self._remat = remat
        self._caches = caches or hf.CacheOff()
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
    def frozen(self) -> tuple[str, ...]:
        """Paths of the frozen parameters: pass them as ``fs.plan(..., frozen=apply.frozen)``."""
        return tuple(leaf.path for leaf in self._leaves if leaf.frozen)

    @property
    def state(self) -> Any:
        """Buffers as a tree like the params (``{}`` if there are none)."""
        return self._state

    def __call__(self, params: Params, /, *args: Any, **kwargs: Any) -> Any:
        """Runs the module's forward on ``args`` and ``kwargs`` with the leaves of ``params``.

        Pure in ``params``: the module's own parameters are neither read nor changed.
        While it runs, each unit submodule's ``forward`` is replaced by one that goes
        through :func:`funcshard.call` (an instance attribute, removed again when apply
        returns or raises), so one module serves one ``apply`` at a time. A forward that
        updates buffers in place (batch-norm statistics) updates ``apply.state``, on
        each rank separately. Hugging Face checkpointing and, in a rematerialized step,
        caches are off (see [Note: Hugging Face checkpointing] in ``hf_checkpointing.py``).

        Args:
            params: the tree :func:`functionalize` returned, or one of its structure:
                full tensors, or inside a step's ``loss_fn`` the params the step passes.
            *args: positional arguments of the module's ``forward``.
            **kwargs: keyword arguments of the module's ``forward``.

        Returns:
            What the module's forward returns.

        Raises:
            ValueError: ``params`` has another structure, holds sharded leaves outside a
                step, or was planned with other units than ``apply.units``; HF gradient
                checkpointing enabled after :func:`functionalize`, where apply cannot remat.
            RuntimeError: ``apply`` called inside a forward of the same module.
        """
        by_path = self._leaf_values(params)
        # See [Note: Hugging Face checkpointing]
        flagged = hf.checked_at_apply(self._module, self._units.paths, remat=self._remat)
        kwargs = self._caches.top_level(args, kwargs, remat=self._remat)
        tensors: dict[str, Any] = dict(self._state_tensors)
        for leaf in self._leaves:
            if leaf.unit is None:
                tensors.update(dict.fromkeys(leaf.names, by_path[leaf.path]))
        forwards = [
            (unit.module, self._unit_forward(unit, unit.module.forward, params, by_path))
            for unit in self._units.infos
        ]
        with self._forwards_through_call(forwards), hf.checkpointing_off(m for _, m in flagged):
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

    def load_pretrained(
        self,
        path: str | os.PathLike[str],
        plan: Plan,
        /,
        *,
        ignore_unexpected: Sequence[str | re.Pattern[str]] = (),
        device: torch.device | str | None = None,
    ) -> Params:
        """This rank's shards of a Hugging Face safetensors checkpoint; mutates ``apply.state``.

        Each rank reads only its slices, a leaf under any of its module's names; meta
        buffers get values first (:meth:`materialize_state`), then persistent ones are
        copied from the file. Arguments, unexpected keys and errors:
        ``funcshard._src.interop.safetensors_io.load_pretrained``, which has an example.
        """
        from funcshard._src.interop.safetensors_io import load_pretrained

        if any(t.device.type == "meta" for t in self._state_tensors.values()):
            self.materialize_state(device=device)
        return load_pretrained(
            path, plan, module=self._module, treedef=self._treedef, leaves=self._leaves,
            state=self._state_tensors, ignore_unexpected=ignore_unexpected, device=device,
        )  # fmt: skip

    def save_pretrained(
        self,
        sparams: Params,
        path: str | os.PathLike[str],
        /,
        *,
        max_shard_size: int | str = "5GB",
        safe_serialization: bool = True,
    ) -> os.PathLike[str]:
        """Writes ``sparams`` as ``from_pretrained`` loads them; collective, rank 0 writes.

        HF key names, tied weights once, frozen parameters and persistent buffers, in files
        of at most ``max_shard_size``, one flat buffer gathered at a time. Returns the
        directory (a ``Path``). Details and an example:
        ``funcshard._src.interop.hf_export.save_pretrained``.
        """
        from funcshard._src.interop.hf_export import save_pretrained

        return save_pretrained(
            sparams, path, module=self._module, treedef=self._treedef, leaves=self._leaves,
            state=self._state_tensors, max_shard_size=max_shard_size,
            safe_serialization=safe_serialization,
        )  # fmt: skip

    def materialize(
        self, plan: Plan, /, *, seed: int = 0, device: torch.device | str | None = None
    ) -> Params:
        """This rank's sharded params from the module's own initialization, one submodule at a time.

        For a module built on the meta device: each submodule that owns tensors is
        initialized in turn by the module's own code (Hugging Face ``_init_weights``,
        else ``reset_parameters``); this rank keeps its shards, so the peak is its
        shards plus one submodule. Values depend only on ``(seed, submodule name)``,
        not on the world size, mesh or units ([Note: materializing a module]).
        Buffers become real too (mutates ``apply.state``). No collective.

        Args:
            plan: the plan of the params :func:`functionalize` returned.
            seed: the seed every rank uses.
            device: where the shards and buffers go (default: CPU).

        Returns:
            Sharded params, as ``fs.shard`` of the initialized params would return.

        Raises:
            ValueError: the plan is for other params, or the module's initialization
                left a tensor unset (the message names it).

        Example:
            >>> import funcshard as fs
            >>> with torch.device("meta"):
            ...     net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
            >>> params, apply = fs.interop.functionalize(net, units=[torch.nn.Linear])
            >>> plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=apply.units)
            >>> sparams = apply.materialize(plan, seed=0)
            >>> apply(fs.unshard(sparams), torch.ones(1, 4)).shape
            torch.Size([1, 2])
        """
        sparams, buffers = materialize_module(
            self._module,
            plan,
            {leaf.path: leaf.names for leaf in self._leaves},
            [leaf.names for leaf in self._state_leaves],
            seed=seed,
            device=torch.device("cpu" if device is None else device),
        )
        self._replace_state(buffers)
        return sparams

    def materialize_state(self, *, device: torch.device | str | None = None) -> None:
        """Gives meta buffers values from the module's own initialization; mutates ``apply.state``.

        For params made without :meth:`materialize` (``fs.materialize``) on a meta
        module. Buffers that have values keep them; every rank builds them alike.
        """
        target = torch.device("cpu" if device is None else device)
        names = [leaf.names for leaf in self._state_leaves]
        self._replace_state(materialize_buffers(self._module, names, device=target))

    def _replace_state(self, values: Sequence[torch.Tensor]) -> None:
        """Makes ``values`` (one per state leaf, in order) the buffers apply uses; mutates apply."""
        by_path = {leaf.path: v for leaf, v in zip(self._state_leaves, values)}
        paths, _, treedef = tree.flatten_with_paths(self._state)
        self._state = tree.unflatten(treedef, [by_path[path] for path in paths])
        self._state_tensors = {
            name: value for leaf, value in zip(self._state_leaves, values) for name in leaf.names
        }

    def __repr__(self) -> str:
        return (
            f"Apply({type(self._module).__name__}, {len(self._leaves)} leaves, "
            f"units={list(self.units)})"
        )

    @contextlib.contextmanager
    def _forwards_through_call(
        self, forwards: Sequence[tuple[nn.Module, Callable[..., Any]]]
    ) -> Iterator[None]:
        """:func:`replaced_forwards` for one apply; refuses an apply inside its own module's forward.

        One module serves one apply at a time: an apply inside the module's own
        forward would route the inner forward through the outer one's units.

        Raises:
            RuntimeError: apply called inside its own module's forward.
        """
        if self._active:
            raise RuntimeError(
                f"apply of {type(self._module).__name__} was called inside its own forward; "
                f"apply does not nest"
            )
        self._active = True
        try:
            with replaced_forwards(forwards):
                yield
        finally:
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
            # a root-unit leaf arrives whole: frozen ones do not require grad
            frozen = value.frozen if sharded else not value.requires_grad
            if frozen != leaf.frozen and (sharded or torch.is_grad_enabled()):
                said = "frozen" if frozen else "trainable"
                really = "a frozen parameter" if leaf.frozen else "a trainable parameter"
                raise ValueError(
                    f"{leaf.path}: the plan makes this leaf {said}, but it is {really} of "
                    f"{type(self._module).__name__}; plan with "
                    f"fs.plan(params, mesh, units=apply.units, frozen=apply.frozen)"
                )
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
        runner = Runner(unit.module, forward)

        def run(full: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            rel_paths, leaves, _ = tree.flatten_with_paths(full)
            tensors: dict[str, Any] = {}
            for rel, leaf in zip(rel_paths, leaves):
                tensors.update(dict.fromkeys((f"m.{name}" for name in unit.own[rel]), leaf))
            for name, root_path in unit.borrowed:
                tensors[f"m.{name}"] = by_path[root_path]
            # off in the recompute too, which runs after apply restored the flags
            with hf.checkpointing_off(m for _, m in hf.checkpointed(unit.module)):
                out = torch.func.functional_call(
                    runner, tensors, args, kwargs, tie_weights=False, strict=False
                )
            return out, hidden_tensors(out, unit.path)

        def unit_forward(*args: Any, **kwargs: Any) -> Any:
            kwargs = self._caches.unit(unit.module, kwargs, remat=self._remat)
            return call(run, subtree, args, kwargs, remat=self._remat)[0]

        return unit_forward


def _by_paths(tree_: Any, leaves: Sequence[Leaf]) -> list[torch.Tensor]:
    paths, values, _ = tree.flatten_with_paths(tree_)
    by_path = dict(zip(paths, values))
    return [by_path[leaf.path] for leaf in leaves]
