"""One unit submodule's call under ``apply``: through ``fs.call``, with its leaves bound for the call.

See [Note: module code outside the call] in ``binding.py``: the parent's call of the
unit's module is routed here; ``fs.call`` gathers the unit, and the module's own
``__call__`` (hooks, forward) runs inside ``functional_call`` with the gathered
leaves bound to its names and the binding current, so that a checkpoint taken or a
backward hook registered in it re-enters this call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from funcshard._src import tree
from funcshard._src.execute.call import call, running_unit
from funcshard._src.execute.call_record import in_memory_of
from funcshard._src.execute.replay import hold
from funcshard._src.execute.run import current_run, step_run
from funcshard._src.interop import hf_checkpointing as hf
from funcshard._src.interop.binding import Binding, UnitBinding, bound, current_binding
from funcshard._src.interop.hooks import backward_hooks_under
from funcshard._src.interop.inputs import cast_inputs
from funcshard._src.interop.module_layout import bind_once
from funcshard._src.interop.module_tree import subtree_at
from funcshard._src.interop.module_units import UnitInfo
from funcshard._src.interop.remat_state import kept_buffers, recompute_buffers
from funcshard._src.interop.unit_outputs import hidden_tensors

__all__ = ["unit_call"]


def unit_call(
    unit: UnitInfo,
    modules: Sequence[nn.Module],
    params: Any,
    by_path: Mapping[str, Any],
    *,
    remat: bool,
    caches: hf.CacheOff,
    redundant: frozenset[str] = frozenset(),
) -> Callable[..., Any]:
    """The target of ``unit.module``'s calls during one apply: ``fs.call`` of the unit.

    Args:
        unit: the unit.
        modules: ``unit.module`` and every submodule of it (whose backward hooks
            re-enter the call).
        params: the params apply got (the unit's subtree is taken from it).
        by_path: apply's leaves by path (the root-unit leaves the unit borrows).
        remat: recompute the unit in backward (``fs.call(..., remat=True)``).
        caches: the Hugging Face cache handling of the module.
        redundant: names under ``unit.module`` not to bind (``module_layout.redundant_names``).
    """
    subtree = subtree_at(params, unit.path)
    borrowed = {name: by_path[root_path] for name, root_path in unit.borrowed}

    def run(
        full: Any, args: tuple[Any, ...], kwargs: dict[str, Any], kept: dict[str, Any] | None
    ) -> Any:
        rel_paths, leaves, _ = tree.flatten_with_paths(full)
        tensors: dict[str, Any] = dict(borrowed)
        for rel, leaf in zip(rel_paths, leaves):
            tensors.update(dict.fromkeys(unit.own[rel], leaf))
        if kept is not None and running_unit() is None:  # remat's recompute in backward
            tensors.update(
                recompute_buffers(kept)
            )  # See [Note: remat and buffers] in ``interop/remat_state.py``
        bind_once(tensors, redundant)  # a module object at two paths
        binding = current_binding()
        if (
            binding is None
        ):  # a call of the module's own, re-entered by nothing: bind the unit alone
            binding = Binding(unit.module, {}, (), None)
        inside = binding.entering(UnitBinding(unit.path, unit.module, tensors, _holder()))
        # HF checkpointing stays off in the recompute too, which runs after apply restored it
        with (
            bound(inside),
            hf.checkpointing_off(m for _, m in hf.checkpointed(unit.module)),
            backward_hooks_under(inside, modules),
        ):
            out = torch.func.functional_call(
                unit.module, tensors, args, kwargs, tie_weights=False, strict=False
            )
        if current_run() is not None or step_run() is not None:  # a step's call or its replay
            _copy_kept_views(modules, leaves)
        return out, hidden_tensors(out, unit.path)

    def target(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = cast_inputs(args, caches.unit(unit.module, kwargs, remat=remat))
        if not (remat and torch.is_grad_enabled() and current_run() is not None):
            return call(functools.partial(run, kept=None), subtree, args, kwargs, remat=remat)[0]
        kept = kept_buffers(
            unit.module
        )  # See [Note: remat and buffers] in ``interop/remat_state.py``
        return call(functools.partial(run, kept=kept), subtree, args, kwargs, remat=remat)[0]

    return target


def _holder() -> Callable[[], object] | None:
    """How to hold the unit whose function runs now gathered again in backward (None outside a step)."""
    running = running_unit()
    if running is None:
        return None
    run, runtime = running
    return lambda: hold(run, runtime)


def _copy_kept_views(modules: Sequence[nn.Module], leaves: Sequence[torch.Tensor], /) -> None:
    """Copies each tensor a module kept on an attribute in the unit's gathered memory; mutates.

    ``self.cache = self.lin.weight.T`` in a unit's forward would read freed memory once
    the unit is released; see [Note: what a call may do to its parameters] in call_record.py.
    """
    lies_in = in_memory_of(leaves)
    tensor = torch.Tensor
    for module in modules:
        attributes = vars(module)
        kept = [n for n, v in attributes.items() if isinstance(v, tensor) and lies_in(v)]
        for name in kept:
            attributes[name] = attributes[name].clone()
