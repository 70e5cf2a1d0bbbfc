"""Bindings: which tensors a functionalized module's names hold while its code runs, and re-entry.

[Note: module code outside the call]
``torch.func.functional_call`` binds tensors to a module's names only while it runs.
Code that runs at another time and reads the module's parameters (an activation
checkpoint's recompute in backward, a hook, another unit's code) would see
whatever the module holds then. So a functionalized module holds nothing readable,
and every read goes through a binding:

1. **Placeholders.** :func:`functionalize` replaces each parameter, trainable or
   frozen, by a ``Placeholder`` (``placeholders.py``): its shape, dtype and device,
   no values; any operation on it raises ``UnboundParameterError``, naming the
   parameter, its unit, the code that read it and the fix. Buffers are apply's
   state tensors themselves, replicated on every rank, so they are never stale.
2. **Bindings.** ``apply`` binds the root unit's leaves and the state for its
   whole call, and each unit's leaves for that unit's call (a :class:`Binding`,
   current in a ``ContextVar``). A unit's call is its module's whole ``__call__``:
   apply routes the module's ``_compiled_call_impl`` (:func:`routed`), the
   attribute ``nn.Module.__call__`` consults before running hooks, so its forward
   pre- and post-hooks and the global module hooks run inside ``fs.call``, after
   the unit's all-gather and before it is freed.
3. **Re-entry.** Code that belongs to a call but runs after it runs under the
   call's binding again (:meth:`Binding.reentering`): the recompute of a
   ``torch.utils.checkpoint`` made while apply runs (``recompute.py``) and the
   backward hooks the module registers for it (``hooks.py``). Re-entry first holds
   the unit (and the root unit) gathered, re-gathering one that was released, and
   refuses one whose gradients are already reduced: it never reads freed memory.
   A unit called by a recompute replays its call ([Note: recomputes in backward] in ``execute/replay.py``).
4. **Everything else meets a placeholder**: a read of another unit's parameter,
   the module run outside apply, a recompute funcshard does not know.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

__all__ = [
    "Binding",
    "UnitBinding",
    "bound",
    "current_binding",
    "reentered",
    "routed",
    "swapped",
]

_F = TypeVar("_F", bound=Callable[..., Any])
_BOUND: ContextVar[Binding | None] = ContextVar("funcshard_binding", default=None)
_MISSING = object()


@dataclasses.dataclass(frozen=True, eq=False)
class UnitBinding:
    """One unit's call: the tensors bound to its module's names, and how to hold them gathered."""

    path: str  # the unit's path in the params
    module: nn.Module
    tensors: Mapping[str, torch.Tensor]  # names under ``module``
    hold: Callable[[], object] | None  # in a step: holds the unit gathered (re-gathers it)


@dataclasses.dataclass(frozen=True, eq=False)
class Binding:
    """One apply: the tensors bound to the module's names, the units' routes, the unit running."""

    module: nn.Module
    tensors: Mapping[str, torch.Tensor]  # the root unit's leaves and the state, by dotted name
    routes: tuple[tuple[nn.Module, Callable[..., Any]], ...]  # each unit's module and its call
    hold: Callable[[], object] | None  # in a step: checks the root unit still holds its leaves
    unit: UnitBinding | None = None
    # keeps the buffers (by name) that code re-entering this apply assigned anew
    adopt: Callable[[Mapping[str, torch.Tensor]], None] | None = None

    def entering(self, unit: UnitBinding, /) -> Binding:
        """This binding inside ``unit``'s call."""
        return dataclasses.replace(self, unit=unit)

    def reentering(self, fn: _F, /) -> _F:
        """``fn``, run under this binding again wherever it is called (a recompute, a hook)."""

        def again(*args: Any, **kwargs: Any) -> Any:
            with reentered(self):
                return fn(*args, **kwargs)

        again._funcshard_reentered = fn  # pyright: ignore[reportFunctionMemberAccess]
        return again  # pyright: ignore[reportReturnType]


def current_binding() -> Binding | None:
    """The binding of the apply (or re-entered call) whose module code runs now, if any."""
    return _BOUND.get()


@contextlib.contextmanager
def bound(binding: Binding, /) -> Iterator[None]:
    """Makes ``binding`` current while the block runs (apply's call, a unit's call)."""
    token = _BOUND.set(binding)
    try:
        yield
    finally:
        _BOUND.reset(token)


@contextlib.contextmanager
def reentered(binding: Binding, /) -> Iterator[None]:
    """Binds ``binding``'s tensors and routes to the module again while the block runs; mutates it.

    See [Note: module code outside the call]. The units are held first; what the
    module held before (placeholders, another binding's tensors) is restored on exit.
    """
    if binding.hold is not None:
        binding.hold()
    if binding.unit is not None and binding.unit.hold is not None:
        binding.unit.hold()
    tensors = dict(binding.tensors)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(bound(binding))
            stack.enter_context(routed(binding.routes))
            stack.enter_context(swapped(binding.module, tensors))
            if binding.unit is not None:
                stack.enter_context(swapped(binding.unit.module, dict(binding.unit.tensors)))
            yield
    finally:  # torch stops a recompute early by raising: what it assigned until then counts
        if binding.adopt is not None:  # a buffer assigned anew is kept, as torch's own is
            changed = {k: v for k, v in tensors.items() if v is not binding.tensors.get(k)}
            if changed:
                binding.adopt(changed)


@contextlib.contextmanager
def swapped(module: nn.Module, tensors: dict[str, torch.Tensor], /) -> Iterator[None]:
    """``module``'s names hold ``tensors`` while the block runs (as in ``functional_call``); mutates both.

    On exit the module holds what it held before, and ``tensors`` what its names
    held at the end (a forward may assign a buffer anew).

    Example:
        >>> lin = nn.Linear(1, 1)
        >>> with swapped(lin, {"weight": torch.full((1, 1), 2.0)}):
        ...     float(lin.weight)
        2.0
        >>> isinstance(lin.weight, nn.Parameter)
        True
    """
    with _reparametrize_module(module, tensors, tie_weights=False, strict=False):
        yield


class _Route:
    """A unit module's ``_compiled_call_impl`` while it is routed: outside its own call, ``target``."""

    def __init__(self, module: nn.Module, target: Callable[..., Any], inner: Any) -> None:
        self.module = module
        self.target = target
        self.inner = inner  # what the module had: a compiled call (module.compile()) or nothing

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        binding = _BOUND.get()
        if binding is not None and binding.unit is not None and binding.unit.module is self.module:
            inner = self.inner if self.inner is not _MISSING else None
            return (inner or self.module._call_impl)(*args, **kwargs)
        return self.target(*args, **kwargs)


@contextlib.contextmanager
def routed(routes: Sequence[tuple[nn.Module, Callable[..., Any]]], /) -> Iterator[None]:
    """Routes each module's calls to its target while the block runs; mutates the modules.

    A call of the module from outside its own call (its parent's forward, a
    recompute) goes to the target, which is ``fs.call`` of the unit; inside the
    unit's call (the binding's unit is that module) it runs as the module would,
    hooks included. On exit each module gets back exactly what it had.

    Example:
        >>> lin = nn.Linear(1, 1)
        >>> with routed([(lin, lambda x: x + 1)]):
        ...     lin(torch.zeros(1))
        tensor([1.])
        >>> "_compiled_call_impl" in vars(lin)
        False
    """
    saved: list[tuple[nn.Module, Any]] = []
    try:
        for module, target in routes:
            instance = vars(module)
            inner = instance.get("_compiled_call_impl", _MISSING)
            saved.append((module, inner))
            instance["_compiled_call_impl"] = _Route(module, target, inner)
        yield
    finally:
        for module, inner in reversed(saved):
            if inner is _MISSING:
                del vars(module)["_compiled_call_impl"]
            else:
                vars(module)["_compiled_call_impl"] = inner
