"""Backward hooks of a functionalized module: they run under the binding of the call they belong to.

A module's backward hooks (``register_full_backward_hook``,
``register_full_backward_pre_hook``, ``register_backward_hook`` and the global
``register_module_full_backward_hook``-style ones) are collected when the module is
called and fire in backward, after apply returned. While a call runs, each
module's hook is handed to that call as :meth:`Binding.reentering` of it, so when it
fires it sees the parameters its module saw (held gathered for it), not
placeholders. See [Note: module code outside the call] in ``binding.py``.
Forward hooks need nothing: they run inside the call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from typing import Any

from torch import nn
from torch.nn.modules import module as torch_module

from funcshard._src.interop.binding import Binding

__all__ = ["backward_hooks_under"]

_GLOBAL = ("_global_backward_hooks", "_global_backward_pre_hooks")


@contextlib.contextmanager
def backward_hooks_under(binding: Binding, modules: Sequence[nn.Module], /) -> Iterator[None]:
    """Backward hooks that ``modules`` (or the global ones) hand out in the block run under ``binding``.

    Mutates the hook dicts while the block runs, keeping their keys (a hook's
    handle still removes it); each gets back its own hook on exit.
    """
    tables: list[MutableMapping[int, Callable[..., Any]]] = [
        getattr(torch_module, name) for name in _GLOBAL if getattr(torch_module, name)
    ]
    for m in modules:
        if m._backward_hooks:
            tables.append(m._backward_hooks)
        if m._backward_pre_hooks:
            tables.append(m._backward_pre_hooks)
    if not tables:
        yield
        return
    saved = [(table, dict(table)) for table in tables]
    try:
        for table, hooks in saved:
            for key, hook in hooks.items():
                table[key] = binding.reentering(getattr(hook, "_funcshard_reentered", hook))
        yield
    finally:
        for table, hooks in saved:
            for key, hook in hooks.items():
                if key in table:
                    table[key] = hook
