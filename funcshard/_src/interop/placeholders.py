"""Placeholders: what a functionalized module holds where its parameters were.

A :class:`Placeholder` has the parameter's shape, dtype, device and
``requires_grad`` (so ``model.dtype``, ``model.device`` and shape checks work), is an
``nn.Parameter`` to ``isinstance``, and holds no values: any operation on it raises
:class:`UnboundParameterError`, which names the parameter, its unit, the code that
read it and the fix. See [Note: module code outside the call] in ``binding.py``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from funcshard._src.interop.binding import current_binding

__all__ = ["Placeholder", "UnboundParameterError", "install", "origin", "placeholder_of"]

# with the separator: site-packages/torchtitan is not torch
_HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


class UnboundParameterError(RuntimeError):
    """Module code read a functionalized module's parameter where ``apply`` does not bind it.

    Example:
        >>> import funcshard as fs
        >>> net = nn.Linear(2, 1)
        >>> params, apply = fs.interop.functionalize(net)
        >>> try:
        ...     net(torch.ones(2))
        ... except fs.interop.UnboundParameterError as e:
        ...     print(str(e).splitlines()[1])
        functionalize owns this module's parameters: the module holds placeholders, so that nothing reads values older than the params.
    """


@dataclasses.dataclass(frozen=True)
class ParameterInfo:
    """Which parameter a placeholder stands for."""

    module: str  # the functionalized module's class name
    name: str  # its first dotted name in the module
    path: str  # its leaf path in the params
    unit: str | None  # the unit path holding it; None: the root unit


class Placeholder(torch.Tensor):
    """Stands for one parameter of a functionalized module: its metadata, no values.

    Example:
        >>> p = Placeholder(torch.zeros(2, 3), ParameterInfo("Net", "w", "w", None))
        >>> p.shape, p.dtype, isinstance(p, nn.Parameter)
        (torch.Size([2, 3]), torch.float32, True)
        >>> p
        Placeholder('w', shape=(2, 3), dtype=torch.float32, unit=None)
    """

    __torch_function__ = torch._C._disabled_torch_function_impl  # pyright: ignore[reportAssignmentType]
    _funcshard_info: ParameterInfo
    _funcshard_origin: Any  # a weak reference to the value at functionalize, or None

    @staticmethod
    def __new__(  # pyright: ignore[reportInconsistentConstructor]
        cls, like: torch.Tensor, info: ParameterInfo, *, requires_grad: bool | None = None
    ) -> Placeholder:
        out = torch.Tensor._make_wrapper_subclass(  # pyright: ignore[reportAttributeAccessIssue]
            cls,
            like.shape,
            strides=like.stride(),
            dtype=like.dtype,
            device=like.device,
            requires_grad=like.requires_grad if requires_grad is None else requires_grad,
        )
        out._funcshard_info = info
        out._funcshard_origin = None if like.device.type == "meta" else weakref.ref(like)
        out._is_param = True  # isinstance(out, nn.Parameter), as nn.Module expects of _parameters
        return out

    def __init__(
        self, like: torch.Tensor, info: ParameterInfo, *, requires_grad: bool | None = None
    ) -> None:
        super().__init__()  # everything is set by __new__

    def __repr__(self) -> str:  # pyright: ignore[reportIncompatibleMethodOverride]
        info = self._funcshard_info
        return (
            f"Placeholder({info.name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"unit={info.unit!r})"
        )

    @property
    def grad(self) -> Any:  # pyright: ignore[reportIncompatibleVariableOverride]
        """Refused: a functionalized module's gradients are the grads tree a step returns."""
        raise UnboundParameterError(_grad_message(self._funcshard_info))

    @grad.setter
    def grad(self, value: Any) -> None:  # pyright: ignore[reportIncompatibleVariableOverride]
        raise UnboundParameterError(_grad_message(self._funcshard_info))

    def register_hook(self, hook: Any) -> Any:  # pyright: ignore[reportIncompatibleMethodOverride]
        """Refused: a hook on a functionalized module's parameter would never run."""
        raise UnboundParameterError(_hook_message(self._funcshard_info, "register_hook"))

    def register_post_accumulate_grad_hook(self, hook: Any) -> Any:  # pyright: ignore[reportIncompatibleMethodOverride]
        """Refused: a hook on a functionalized module's parameter would never run."""
        raise UnboundParameterError(
            _hook_message(self._funcshard_info, "register_post_accumulate_grad_hook")
        )

    @classmethod
    def __torch_dispatch__(  # pyright: ignore[reportIncompatibleMethodOverride]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        found = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, Placeholder)]
        raise UnboundParameterError(_message(found[0]._funcshard_info, func))


def install(
    module: nn.Module,
    groups: Iterable[tuple[tuple[str, ...], ParameterInfo, torch.Tensor]],
    /,
) -> None:
    """Replaces each parameter of ``module`` (every dotted name of it) by a placeholder; mutates ``module``.

    ``groups`` gives every name of one tensor, what it is, and the leaf of the params
    that holds its value (referred to weakly, for :func:`origin`). Tied names get
    one placeholder, as they had one parameter.
    """
    for names, info, leaf in groups:
        originals: dict[int, torch.Tensor] = {}
        for name in names:
            owner, _, attr = name.rpartition(".")
            parameter = module.get_submodule(owner)._parameters[attr]
            assert parameter is not None
            originals.setdefault(id(parameter), parameter)
        first, *others = originals.values()
        held: Any = _in_place_of(first, Placeholder(leaf, info, requires_grad=first.requires_grad))
        for other in others:  # tied names of distinct Parameter objects: each stands for the leaf
            _in_place_of(other, Placeholder(leaf, info, requires_grad=other.requires_grad))
        for name in names:  # an nn.Parameter to isinstance (_is_param), not to the type checker
            owner, _, attr = name.rpartition(".")
            module.get_submodule(owner)._parameters[attr] = held


def _in_place_of(parameter: torch.Tensor, placeholder: Placeholder) -> torch.Tensor:
    """``placeholder``'s contents in the ``parameter`` object itself, where torch can swap them.

    Code may hold the parameter outside the module (a list, a ``functools.partial``,
    a closure, an optimizer made before functionalize): swapped, every such reference
    reads the placeholder and raises, where a new object in the module's
    ``_parameters`` would leave them the stale initial values. The params leaf views
    the parameter's storage, which the swap leaves alone. Where torch refuses (a
    weak reference to the parameter, or autograd holding it), the placeholder only
    replaces it in the module. Returns the object that now is the placeholder.
    """
    try:
        torch.utils.swap_tensors(parameter, placeholder)
    except RuntimeError:
        return placeholder
    return parameter


def placeholder_of(module: nn.Module, /) -> Placeholder | None:
    """A placeholder among ``module``'s parameters, if it was functionalized.

    Example:
        >>> placeholder_of(nn.Linear(1, 1)) is None
        True
    """
    return next((p for p in module.parameters() if isinstance(p, Placeholder)), None)


def origin(tensor: torch.Tensor, /) -> torch.Tensor | None:
    """The value a placeholder stood for at functionalize, while the params still hold it.

    ``tensor`` itself where it is not a placeholder; ``None`` where the value is gone
    (the params :func:`functionalize` returned were dropped) or was ``meta``.
    """
    if not isinstance(tensor, Placeholder):
        return tensor
    ref = tensor._funcshard_origin
    return None if ref is None else ref()


# -- the message -----------------------------------------------------------------------


def _parameter(info: ParameterInfo) -> str:
    """``"Net's parameter 'blocks.1.fc.weight' (unit 'blocks/1')"``: how every message names it."""
    where = f"unit {info.unit!r}" if info.unit is not None else "the root unit"
    return f"{info.module}'s parameter {info.name!r} ({where})"


def _message(info: ParameterInfo, func: Any) -> str:
    where = f"unit {info.unit!r}" if info.unit is not None else "the root unit"
    what = _parameter(info)
    site = _reader()
    by = f", by {_op_name(func)}" + (f" at {site}" if site else "")
    binding = current_binding()
    backward = torch._C._current_graph_task_id() != -1  # pyright: ignore[reportAttributeAccessIssue]
    own_call = binding is not None and (
        binding.unit.path == info.unit if binding.unit is not None else info.unit is None
    )
    if own_call:  # apply binds the module's names here: the read went around them
        return (
            f"{what} was read through a reference kept outside the module's parameters{by}.\n"
            f"apply binds the module's attributes; a list, dict, functools.partial, closure "
            f"or optimizer that holds the parameter object itself is not rebound.\n"
            f"Fix: read the parameter as its module's attribute (self.lin.weight) inside "
            f"forward, register it on the module that uses it (nn.Parameter, or tie it by "
            f"assigning it as that module's attribute), and make optimizers over the params "
            f"tree (fs.optim), not over model.parameters()"
        )
    if binding is not None and binding.unit is not None and binding.unit.path != info.unit:
        reader = binding.unit.path
        return (
            f"{what} was read inside the call of unit {reader!r}{by}.\n"
            f"A unit's parameters are gathered only for its own call.\n"
            f"Fix: put both in one unit (a units pattern naming a module that holds "
            f"{info.unit!r} and {reader!r}), or leave {info.unit!r} out of units so that its "
            f"parameters are in the root unit, gathered for the whole step"
        )
    if binding is not None:
        return (
            f"{what} was read by the root module's code, outside the call of {where}{by}.\n"
            f"A unit's parameters are gathered only while its own module runs.\n"
            f"Fix: read it inside that module's forward (or a hook on that module), or leave "
            f"{info.unit!r} out of units so that its parameters are in the root unit"
        )
    hook = _state_dict_hook()
    if hook is not None:
        module_path, kind, name = hook
        by_whom = (
            f"{name} of module {module_path!r}"
            if kind == "call"
            else f"the {kind} {name} of module {module_path!r}"
        )
        return (
            f"{what} was read by {by_whom}, outside apply{by}.\n"
            f"The module holds placeholders: its state dict (and its hooks) need values bound.\n"
            f"Fix: apply.state_dict(fs.unshard(sparams)), fs.checkpoint.save_dcp(path, sparams, "
            f"apply=apply) or fs.checkpoint.load_dcp(path, like, apply=apply), which run the "
            f"module's hooks on the gathered parameters; or `with apply.bound(full_params): "
            f"module.state_dict()`"
        )
    if backward:
        return (
            f"{what} was read in backward, after apply returned{by}.\n"
            f"Code reran the module outside apply: an activation checkpoint other than "
            f"torch.utils.checkpoint's, or a hook kept from another call.\n"
            f"Fix: checkpoint with torch.utils.checkpoint (or functionalize(..., remat=True)), "
            f"which funcshard reruns with the gathered parameters"
        )
    return (
        f"{what} was read outside apply{by}.\n"
        f"functionalize owns this module's parameters: the module holds placeholders, so "
        f"that nothing reads values older than the params.\n"
        f"Fix: run the module through apply(params, ...), read the params tree, or bind "
        f"values to the module for a block: `with apply.bound(full_params): ...`"
    )


def _grad_message(info: ParameterInfo) -> str:
    return (
        f"{info.module}'s parameter {info.name!r} has no .grad: functionalize owns the module's "
        f"parameters, and their gradients are the grads tree the step returns.\n"
        f"Fix: clip with fs.optim.clip_by_global_norm(grads, max_norm), update with an fs.optim "
        f"optimizer, and drop model.zero_grad() (each step returns new gradients)"
    )


def _hook_message(info: ParameterInfo, method: str) -> str:
    return (
        f"{_parameter(info)} got a hook ({method}) after functionalize.\n"
        f"apply computes with the params' leaves, never with this parameter, so the hook "
        f"would never run.\n"
        f"Fix: transform the gradients the step returns (fs.tree.map over grads), or "
        f"register a full backward hook on the module"
    )


def _state_dict_hook() -> tuple[str, str, str] | None:
    """(module path, hook kind, hook name) when a module's state-dict hook runs now, else None.

    Found on the stack: the innermost frame of torch's ``state_dict`` or
    ``_load_from_state_dict`` names the module (its ``prefix``); the frame it called
    outside torch and funcshard is the hook.
    """
    frame = sys._getframe(2)
    hook_frame = None
    while frame is not None:
        code = frame.f_code
        inside = os.path.abspath(code.co_filename).startswith((_HERE, _TORCH))
        if not inside and not code.co_filename.startswith("<frozen"):
            hook_frame = frame
        elif code.co_name in ("state_dict", "_load_from_state_dict"):
            owner = frame.f_locals.get("self")
            prefix = frame.f_locals.get("prefix")
            if isinstance(owner, nn.Module) and isinstance(prefix, str):
                where = prefix.rstrip(".") or "<root>"
                saving = code.co_name == "state_dict"
                if hook_frame is None:  # torch's own copy: state_dict() or load_state_dict()
                    call = "state_dict()" if saving else "load_state_dict()"
                    return where, "call", f"{type(owner).__name__}.{call}"
                kind = "state-dict hook" if saving else "load-state-dict hook"
                code = hook_frame.f_code
                return where, kind, getattr(code, "co_qualname", code.co_name)  # 3.11+: Class.fn
        frame = frame.f_back
    return None


def _op_name(func: Any) -> str:
    name = str(func)
    return name.removesuffix(".default")


def _reader() -> str:
    """``file:line`` of the innermost frame outside torch and funcshard: the code that read it."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith("<") or not os.path.abspath(filename).startswith((_HERE, _TORCH)):
            return f"{os.path.basename(filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return ""
