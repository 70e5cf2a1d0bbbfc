"""The module as functionalize left it: checked at every apply, and the names that bind each tensor once.

See [Note: module code outside the call] in ``binding.py``. ``apply`` computes with
the params' leaves bound to the names functionalize recorded, so a module changed
after functionalize would train something else than it runs: a parameter replaced
(``load_state_dict(..., assign=True)``, ``m.lin.weight = nn.Parameter(...)``), a
submodule replaced or added (``m.blocks[0] = Block()``), a parameter added, or
``requires_grad`` flipped (``m.head.requires_grad_(False)``). :meth:`Layout.check`
refuses each at the next apply, naming it; it reads a few dict entries per module
and parameter.

A module object registered at two paths (``self.shared`` and ``self.enc.embed``)
holds each of its tensors under two dotted names. Binding both would make torch
restore one of them over the other after the call, leaving a gathered tensor in
the module, so the second name is bound not at all: :func:`redundant_names`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Layout", "bind_once", "layout_of", "redundant_names"]


@dataclass(frozen=True)
class Layout:
    """Every edge of the module tree, every parameter object and its ``requires_grad``, at functionalize."""

    root: str  # the module's class name, for messages
    edges: tuple[tuple[nn.Module, str, nn.Module, str], ...]  # parent, name, child, child's path
    params: tuple[
        tuple[nn.Module, str, torch.Tensor, bool, str], ...
    ]  # owner, attr, held, grad, name
    sizes: tuple[tuple[nn.Module, int, int, str], ...]  # module, #parameters, #children, path

    def check(self) -> None:
        """Raises where the module no longer is what functionalize left.

        Raises:
            UnboundParameterError: a submodule or parameter replaced or added, or
                ``requires_grad`` changed; the message names it and the fix.
        """
        from funcshard._src.interop.placeholders import UnboundParameterError

        for parent, name, child, path in self.edges:
            if parent._modules.get(name) is not child:
                raise UnboundParameterError(_changed(self.root, f"submodule {path!r} was replaced"))
        for module, n_params, n_children, path in self.sizes:
            if len(module._parameters) != n_params or len(module._modules) != n_children:
                what = "parameter" if len(module._parameters) != n_params else "submodule"
                where = repr(path) if path else "the module itself"
                raise UnboundParameterError(_changed(self.root, f"a {what} was added to {where}"))
        for owner, attr, held, grad, name in self.params:
            if owner._parameters.get(attr) is not held:
                raise UnboundParameterError(_changed(self.root, f"parameter {name!r} was replaced"))
            if held.requires_grad != grad:
                raise UnboundParameterError(
                    f"{self.root}'s parameter {name!r} had requires_grad set to "
                    f"{held.requires_grad} after functionalize; the plan decides what trains.\n"
                    f"Fix: set requires_grad before functionalize (apply.frozen then lists "
                    f"it), or freeze it in the plan: fs.plan(..., frozen=[{name.replace('.', '/')!r}])"
                )


def layout_of(module: nn.Module, /) -> Layout:
    """``module``'s structure now: what :meth:`Layout.check` compares with.

    Example:
        >>> net = nn.Sequential(nn.Linear(1, 1))
        >>> layout = layout_of(net)
        >>> net[0] = nn.Linear(1, 1)
        >>> try:
        ...     layout.check()
        ... except RuntimeError as e:
        ...     print(str(e).splitlines()[0])
        Sequential's submodule '0' was replaced after functionalize.
    """
    edges, params, sizes = [], [], []
    for path, m in module.named_modules(remove_duplicate=False):
        sizes.append((m, len(m._parameters), len(m._modules), path))
        for name, child in m._modules.items():
            if child is not None:
                edges.append((m, name, child, f"{path}.{name}" if path else name))
        for attr, p in m._parameters.items():
            if p is not None:
                params.append((m, attr, p, p.requires_grad, f"{path}.{attr}" if path else attr))
    return Layout(type(module).__name__, tuple(edges), tuple(params), tuple(sizes))


def redundant_names(module: nn.Module, /) -> frozenset[str]:
    """Dotted names of parameters and buffers whose (module object, attribute) an earlier name holds.

    Example:
        >>> shared = nn.Linear(1, 1)
        >>> net = nn.ModuleDict({"a": shared, "b": nn.Sequential(shared)})
        >>> sorted(redundant_names(net))
        ['b.0.bias', 'b.0.weight']
    """
    seen: set[tuple[int, str]] = set()
    out: set[str] = set()
    for path, m in module.named_modules(remove_duplicate=False):
        for attr in (*m._parameters, *m._buffers):
            key = (id(m), attr)
            if key in seen:
                out.add(f"{path}.{attr}" if path else attr)
            seen.add(key)
    return frozenset(out)


def bind_once(tensors: dict[str, object], redundant: frozenset[str], /) -> None:
    """Drops the names of ``redundant`` (:func:`redundant_names`) from a binding; mutates ``tensors``.

    Example:
        >>> names = {"a.weight": 1, "b.0.weight": 1}
        >>> bind_once(names, frozenset({"b.0.weight"}))
        >>> names
        {'a.weight': 1}
    """
    for name in redundant:
        tensors.pop(name, None)


def _changed(root: str, what: str) -> str:
    return (
        f"{root}'s {what} after functionalize.\n"
        f"apply binds the params' leaves to the names functionalize recorded, so the new "
        f"module or parameter would run untrained, or not at all.\n"
        f"Fix: change the module before functionalize, or load values into the params tree "
        f"(apply.load_pretrained, fs.checkpoint.load), not into the module"
    )
