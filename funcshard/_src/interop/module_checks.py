"""What ``functionalize`` refuses up front: parameters it could not own, named with the fix.

See [Note: module code outside the call] in ``binding.py``: functionalize owns every
read of a module's parameters. Four kinds of parameter it could not own, where
training would otherwise go silently wrong or fail deep inside torch later:

- an uninitialized parameter of a lazy module (``nn.LazyLinear``): no shape to plan;
- a parameter with a tensor hook (``register_hook``,
  ``register_post_accumulate_grad_hook``): apply never differentiates the parameter
  itself, so the hook would never run;
- a sparse embedding (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag``): its
  sparse gradient cannot be reduce-scattered with the unit's dense ones;
- a complex parameter that requires grad: funcshard trains real floating leaves.

And a module compiled as a whole (``torch.compile(model)``, ``model.compile()``):
apply runs its units one call at a time; its units may be compiled.

:func:`refuse_hub_kernels` refuses a Hugging Face model whose config (its own or a
submodel's) names a Hub kernel as its attention (or experts) implementation
(``attn_implementation="kernels-community/flash-attn"``, any name with ``/``): such a
kernel is code transformers downloads and runs in every call. The refusal does not
depend on whether the ``kernels`` package is installed.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parameter import UninitializedParameter

__all__ = ["refuse_hub_kernels", "refuse_unownable"]

_IMPLEMENTATIONS = (
    ("attn_implementation", "_attn_implementation"),
    ("experts_implementation", "_experts_implementation"),
)


def refuse_unownable(module: nn.Module, /) -> None:
    """Raises for the first parameter of ``module`` that functionalize could not own.

    Raises:
        ValueError: the parameter (by its dotted name), what is wrong and the fix.

    Example:
        >>> net = nn.Linear(2, 2)
        >>> _ = net.weight.register_hook(lambda g: 2 * g)
        >>> refuse_unownable(net)
        Traceback (most recent call last):
        ...
        ValueError: functionalize: Linear's parameter 'weight' has a tensor hook (register_hook); ...
    """
    kind = type(module).__name__
    if hasattr(module, "_orig_mod") or vars(module).get("_compiled_call_impl") is not None:
        raise ValueError(
            f"functionalize: the {kind} is compiled as a whole (torch.compile(model) or "
            f"model.compile()); apply must run its units one call at a time. Fix: functionalize "
            f"the plain module and compile its units (block.compile() on each unit's module, "
            f"as in the conformance row compile/submodule)"
        )
    for name, p in module.named_parameters(remove_duplicate=False):
        if isinstance(p, UninitializedParameter):
            raise ValueError(
                f"functionalize: {kind}'s parameter {name!r} is uninitialized (a lazy module, "
                f"such as nn.LazyLinear); it has no shape to plan. Fix: run one forward of the "
                f"module on an example batch before functionalize, or use the module's "
                f"non-lazy class"
            )
        if p.is_complex() and p.requires_grad:
            raise ValueError(
                f"functionalize: {kind}'s parameter {name!r} is complex ({p.dtype}); funcshard "
                f"trains real floating parameters, so its gradient would be dropped. Fix: keep "
                f"it as real pairs (nn.Parameter(torch.view_as_real(w))) and view them as "
                f"complex in forward (torch.view_as_complex), or freeze it "
                f"(requires_grad_(False)) before functionalize"
            )
        hooks = [
            method
            for method, table in (
                ("register_hook", p._backward_hooks),
                ("register_post_accumulate_grad_hook", p._post_accumulate_grad_hooks),
            )
            if table
        ]
        if hooks:
            raise ValueError(
                f"functionalize: {kind}'s parameter {name!r} has a tensor hook "
                f"({', '.join(hooks)}); apply computes with the params' leaves, never with the "
                f"parameter, so the hook would not run. Fix: remove it (handle.remove()) and "
                f"transform the gradients the step returns (fs.tree.map over grads), or "
                f"register a full backward hook on the module"
            )
    for name, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse:
            raise ValueError(
                f"functionalize: {kind}'s submodule {name or '<the module>'!r} "
                f"({type(sub).__name__}) has sparse=True; its sparse gradient cannot be "
                f"reduce-scattered with the unit's dense ones. Fix: construct it with "
                f"sparse=False"
            )


def refuse_hub_kernels(module: nn.Module, /) -> None:
    """Raises if a Hugging Face config in ``module`` names a Hub kernel as an implementation.

    Every submodule's ``config`` is read (a model's, and those of the models inside
    it: a vision tower's, a language model's), whatever is installed.

    Raises:
        ValueError: naming the model, the field (``attn_implementation``), its value
            and the fix (``"sdpa"`` or ``"eager"``).

    Example:
        >>> from types import SimpleNamespace
        >>> net = nn.Linear(2, 2)
        >>> net.config = SimpleNamespace(_attn_implementation="kernels-community/flash-attn")
        >>> refuse_hub_kernels(net)
        Traceback (most recent call last):
        ...
        ValueError: functionalize: Linear's config has attn_implementation 'kernels-community/flash-attn', a kernel from the Hugging Face Hub: ...
    """
    for name, sub in module.named_modules():
        config = vars(sub).get("config")
        if config is None:
            continue
        for field, attribute in _IMPLEMENTATIONS:
            value = _read(config, attribute)
            values = list(value.values()) if isinstance(value, dict) else [value]  # pyright: ignore[reportUnknownMemberType, reportUnknownArgumentType]
            hub = next((v for v in values if isinstance(v, str) and "/" in v), None)  # pyright: ignore[reportUnknownVariableType]
            if hub is None:
                continue
            where = f"{type(module).__name__}'s config" + (
                f" (of its submodule {name!r}, {type(sub).__name__})" if name else ""
            )
            fix, other = ('"sdpa"', ' (or "eager")') if "attn" in field else ('"eager"', "")
            raise ValueError(
                f"functionalize: {where} has {field} {hub!r}, a kernel from the Hugging Face "
                f"Hub: transformers downloads its code and runs it in every call, and "
                f"funcshard does not train a model through fetched code, whether or not the "
                f"kernels package is installed. Fix: build the model with {field}={fix}"
                f"{other} (from_pretrained(..., {field}={fix}), or "
                f"model.set_{field}({fix}) before functionalize)"
            )


def _read(config: Any, attribute: str) -> Any:
    try:
        return getattr(config, attribute, None)
    except Exception:  # a config property that cannot say: nothing to refuse
        return None
