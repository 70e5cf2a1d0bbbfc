"""``Apply``: a module's forward as a pure function of its parameter pytree.

See [Note: module trees] in ``module.py`` for the tree it takes, and
[Note: tied parameters] in ``module_tree.py`` for tensors used in several places.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeAlias

import torch
import torch.func
from torch import nn

from funcshard._src import tree
from funcshard._src.execute.reference import in_plain
from funcshard._src.execute.replay import hold
from funcshard._src.execute.run import current_run
from funcshard._src.interop import hf_checkpointing as hf
from funcshard._src.interop.binding import Binding, bound, routed, swapped
from funcshard._src.interop.hooks import backward_hooks_under
from funcshard._src.interop.inputs import cast_inputs
from funcshard._src.interop.leaf_check import Leaf, leaf_values
from funcshard._src.interop.module_layout import bind_once, layout_of, redundant_names
from funcshard._src.interop.module_state import ModuleState
from funcshard._src.interop.module_units import Units
from funcshard._src.interop.recompute import intercepted
from funcshard._src.interop.unit_call import unit_call
from funcshard._src.interop.weights import Weights
from funcshard._src.shard.sharded import ShardedTensor

__all__ = ["Apply", "Leaf", "Params"]

Params: TypeAlias = (
    Any  # nested dicts and lists of tensors, see [Note: module trees] in ``interop/module.py``
)


class Apply(Weights):
    """A module as a pure function of its params: ``apply(params, *args, **kwargs)``.

    Built by :func:`functionalize`. ``apply`` runs the module's own ``forward`` through
    ``torch.func.functional_call`` with the leaves of ``params``; inside the ``loss_fn``
    of :func:`funcshard.value_and_grad`, each unit submodule's call goes through
    :func:`funcshard.call` by itself, so its parameters are gathered just for it.
    The module holds placeholders where its parameters were: outside apply's calls
    nothing reads stale values (see [Note: module code outside the call] in ``binding.py``).

    Attributes:
        module: the module (it holds placeholders for its parameters, and its state).
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
        self._root_leaves = tuple(leaf for leaf in self._leaves if leaf.unit is None)
        self._state = ModuleState(module, state, state_leaves)
        self._units = units
        self._patterns = patterns
        self._remat = remat
        self._caches = caches or hf.CacheOff()
        self._active = False
        inside = {id(m): u.path for u in units.infos for m in u.module.modules()}
        self._unit_modules = {
            u.path: list(u.module.modules()) for u in units.infos
        }  # whose backward hooks re-enter the unit's call; see hooks.py
        self._root_modules = [m for m in module.modules() if id(m) not in inside]
        self._all_modules = list(module.modules())  # a plain reference's; see reference.py
        # See module_layout.py: the module as functionalize left it, and names bound once
        self._layout = layout_of(module)
        self._redundant = redundant_names(module)
        self._unit_redundant = {u.path: redundant_names(u.module) for u in units.infos}

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
        return self._state.tree

    def broadcast_state(self, *, src: int = 0) -> None:
        """Makes every rank's buffers rank ``src``'s, in place; collective; mutates ``apply.state``.

        Buffers are kept per rank (each rank's forward updates its own batch-norm
        statistics, as FSDP2 keeps them); this is DDP's ``broadcast_buffers=True``:
        call it before each step to train as DDP does, or before an evaluation.
        Outside a distributed run it does nothing.

        Raises:
            ValueError: ``src`` is not a rank, or a buffer is still on the meta device.

        Example:
            >>> import funcshard as fs
            >>> params, apply = fs.interop.functionalize(torch.nn.BatchNorm1d(2))
            >>> apply.broadcast_state()  # one process: nothing to do
        """
        self._state.broadcast(src=src)

    def __call__(self, params: Params, /, *args: Any, **kwargs: Any) -> Any:
        """Runs the module's forward on ``args`` and ``kwargs`` with the leaves of ``params``.

        Pure in ``params``. While it runs, the root unit's leaves and the state are
        bound to the module's names, and each unit submodule's call (its hooks and
        forward) goes through :func:`funcshard.call` with the unit's leaves bound; one
        module serves one ``apply`` at a time. A torch activation checkpoint taken in
        the module recomputes with the same leaves in backward, and backward hooks see
        them too ([Note: module code outside the call] in ``binding.py``). A forward that
        updates buffers in place (batch-norm statistics) or assigns them anew updates
        ``apply.state``, on each rank separately. Hugging Face checkpointing and, in a
        rematerialized step, caches are off (see [Note: Hugging Face checkpointing] in
        ``hf_checkpointing.py``).

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
        self._layout.check()
        if (
            in_plain() and current_run() is None
        ):  # See [Note: plain references] in ``execute/reference.py``
            return self._plain(by_path, args, kwargs)
        # See [Note: Hugging Face checkpointing] in ``interop/hf_checkpointing.py``
        flagged = hf.checked_at_apply(self._module, self._units.paths, remat=self._remat)
        args, kwargs = cast_inputs(args, self._caches.top_level(args, kwargs, remat=self._remat))
        tensors: dict[str, Any] = dict(self._state.tensors)
        for leaf in self._root_leaves:
            tensors.update(dict.fromkeys(leaf.names, by_path[leaf.path]))
        bind_once(tensors, self._redundant)
        routes = tuple(
            (
                unit.module,
                unit_call(
                    unit,
                    self._unit_modules[unit.path],
                    params,
                    by_path,
                    remat=self._remat,
                    caches=self._caches,
                    redundant=self._unit_redundant[unit.path],
                ),
            )
            for unit in self._units.infos
        )
        binding = Binding(self._module, tensors, routes, _root_holder(), adopt=self._adopt_changed)
        with self._entered(binding), hf.checkpointing_off(m for _, m in flagged):
            out = torch.func.functional_call(
                self._module, tensors, args, kwargs, tie_weights=False, strict=False
            )
        self._state.adopt(tensors)
        return out

    @contextlib.contextmanager
    def bound(self, params: Params, /) -> Iterator[nn.Module]:
        """Binds full ``params`` (and the state) to the module's names while the block runs; mutates it.

        For code that runs the module itself rather than through ``apply`` (an
        evaluation loop, Hugging Face's ``generate``, ``module.state_dict()``): inside
        the block the module holds the leaves of ``params``, outside it placeholders
        again (see [Note: module code outside the call] in ``binding.py``). Each name
        holds a view of its leaf that is an ``nn.Parameter`` to ``isinstance``, so
        torch's ``get_parameter`` and ``named_parameters`` work; gradients flow to
        the leaf. ``apply.state_dict``, ``fs.checkpoint.save_dcp`` and
        ``apply.save_pretrained`` work inside the block as outside it.

        Raises:
            ValueError: ``params`` has another structure or holds sharded leaves
                (``fs.unshard`` them first).

        Example:
            >>> import funcshard as fs
            >>> net = torch.nn.Linear(2, 1)
            >>> params, apply = fs.interop.functionalize(net)
            >>> with apply.bound(fs.tree.map(torch.zeros_like, params)) as module:
            ...     module(torch.ones(2))
            tensor([0.])
        """
        by_path = self._leaf_values(params, what="bound")
        sharded = [p for p, v in by_path.items() if isinstance(v, ShardedTensor)]
        if sharded:
            raise ValueError(
                f"{sharded[0]}: apply.bound needs full tensors, got a sharded leaf; pass "
                f"fs.unshard(sparams)"
            )
        self._layout.check()
        tensors: dict[str, Any] = dict(self._state.tensors)
        for leaf in self._leaves:
            tensors.update(dict.fromkeys(leaf.names, _as_parameter(by_path[leaf.path])))
        bind_once(tensors, self._redundant)
        try:
            with swapped(self._module, tensors):
                yield self._module
        finally:
            self._state.adopt(tensors)

    def __repr__(self) -> str:
        return (
            f"Apply({type(self._module).__name__}, {len(self._leaves)} leaves, "
            f"units={list(self.units)})"
        )

    def _plain(self, by_path: dict[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The module's own call with every leaf bound and no units; see [Note: plain references] in ``execute/reference.py``."""
        tensors: dict[str, Any] = {name: t.clone() for name, t in self._state.tensors.items()}
        for leaf in self._leaves:
            tensors.update(dict.fromkeys(leaf.names, by_path[leaf.path]))
        bind_once(tensors, self._redundant)
        binding = Binding(self._module, tensors, (), None)
        with bound(binding), intercepted(), backward_hooks_under(binding, self._all_modules):
            return torch.func.functional_call(
                self._module, tensors, args, kwargs, tie_weights=False, strict=False
            )

    def _adopt_changed(self, changed: Mapping[str, Any], /) -> None:
        """Keeps the buffers a recompute or hook in backward assigned anew (``changed``, by name)."""
        self._state.adopt({**self._state.tensors, **changed})

    @contextlib.contextmanager
    def _entered(self, binding: Binding) -> Iterator[None]:
        """Makes ``binding`` the module's for one apply; refuses an apply inside its own module's forward.

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
            with (
                bound(binding),
                routed(binding.routes),
                intercepted(),
                backward_hooks_under(binding, self._root_modules),
            ):
                yield
        finally:
            self._active = False

    def _leaf_values(self, params: Params, *, what: str = "apply") -> dict[str, Any]:
        """The leaves of ``params`` by path, checked against the tree and, in a step, the plan."""
        return leaf_values(
            params,
            treedef=self._treedef,
            leaves=self._leaves,
            module=type(self._module).__name__,
            what=what,
        )


def _as_parameter(value: Any) -> Any:
    """A view of ``value`` that is an ``nn.Parameter`` to ``isinstance`` (``value`` itself unmarked).

    torch's ``get_parameter`` checks ``isinstance(p, nn.Parameter)``, which holds for a
    tensor with ``_is_param`` set (as for placeholders). A view shares the values and
    passes gradients on to ``value``.
    """
    if not isinstance(value, torch.Tensor) or isinstance(value, nn.Parameter):
        return value
    view = value.view_as(value)
    view._is_param = True  # pyright: ignore[reportAttributeAccessIssue]
    return view


def _root_holder() -> Any:
    """How to check, in backward, that the step's root unit still holds its leaves (None outside one)."""
    run = current_run()
    if run is None or run.root is None:
        return None
    root = run.root.unit
    return lambda: hold(run, root)
