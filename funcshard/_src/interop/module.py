"""``functionalize``: an ``nn.Module`` as a parameter pytree and a pure ``apply`` over it.

[Note: module trees]
A module's trainable parameters become nested dicts keyed by submodule and parameter
name, so a leaf's path is its ``named_parameters`` name with ``/`` for ``.``
(``model/layers/3/self_attn/q_proj/weight``). A submodule whose entries are all named
``0`` .. ``n-1`` (``ModuleList``, ``Sequential``, ``ParameterList``) becomes a list:
dict keys flatten sorted as strings (``10`` before ``2``), a list keeps the module's
order, and the paths are the same. An entry without leaves is ``None``, an empty node,
so indices stay those of the module. A parameter reachable under several names (tied
weights) is one leaf, at the first name ``named_parameters`` gives.

Buffers and frozen parameters (``requires_grad=False``) are not leaves: they are the
module's non-trainable *state*, closed over by ``apply`` and replicated on every rank,
so they get no gradient and no optimizer state (``apply.state`` shows them).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from funcshard._src import tree
from funcshard._src.interop.apply import Apply, Leaf, Params
from funcshard._src.interop.module_tree import alias_groups, module_tree
from funcshard._src.interop.module_units import UnitPattern, resolve_units, unit_patterns

__all__ = ["Apply", "UnitPattern", "functionalize"]


def functionalize(
    module: nn.Module, /, *, units: Sequence[UnitPattern] = (), remat: bool = False
) -> tuple[Params, Apply]:
    """Splits ``module`` into its parameter pytree and a pure function ``apply`` over it.

    ``params`` holds the trainable parameters, nested by submodule (see
    ``[Note: module trees]``): ``model/layers/3/self_attn/q_proj/weight``. Tied
    parameters are one leaf; buffers and frozen parameters are carried by ``apply``
    as replicated state. ``apply(params, *args, **kwargs)`` is the module's forward
    with the leaves of ``params``. ``units`` name submodules whose forward becomes
    one :func:`funcshard.call` each; plan with ``units=apply.units``, and a step
    gathers each unit's parameters just for its forward, with no per-layer code.

    Args:
        module: any ``nn.Module`` (real or ``meta`` tensors; the leaves are detached
            views of its parameters, not copies).
        units: each a class (every instance is a unit), a class name (``"LlamaDecoderLayer"``),
            or a glob or ``re.Pattern`` over submodule paths (``"model/layers/*"``); a
            string that is a class name of a submodule is taken as the class. A
            pattern matching nested submodules makes the outermost a unit.
        remat: recompute each unit's activations in backward instead of keeping
            them (``fs.call(..., remat=True)``; its parameters are re-gathered for it).

    Returns:
        ``(params, apply)``.

    Raises:
        ValueError: a unit that names no submodule (the message lists the classes
            there are), units that overlap, tied parameters used by two units, or
            parameters that share memory as different tensors (overlapping views).
        TypeError: ``module`` is not an ``nn.Module`` or ``units`` is malformed.

    Example:
        >>> import torch, funcshard as fs
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
        >>> params, apply = functionalize(net, units=[nn.Linear])
        >>> fs.tree.leaf_paths(params)
        ['0/bias', '0/weight', '2/bias', '2/weight']
        >>> apply.unit_paths, apply.units
        (('0', '2'), ('*',))
        >>> plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=apply.units)
        >>> step = fs.value_and_grad(lambda p, x: apply(p, x).sum(), plan)
        >>> loss, grads = step(fs.shard(params, plan), torch.ones(4, 2))
        >>> torch.allclose(loss, net(torch.ones(4, 2)).sum())
        True
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"functionalize: expected an nn.Module, got {type(module).__name__}")
    groups = alias_groups(module)
    trainable = [g for g in groups if g.kind == "trainable"]
    carried = [g for g in groups if g.kind != "trainable"]
    params = module_tree(module, "", {g.names[0]: g.tensor.detach() for g in trainable}) or {}
    state = module_tree(module, "", {g.names[0]: g.tensor.detach() for g in carried}) or {}
    resolved = resolve_units(module, units, [g.names for g in trainable])
    leaves = [
        Leaf(g.names[0].replace(".", "/"), g.names, resolved.unit_of(g.names[0])) for g in trainable
    ]
    _, _, treedef = tree.flatten_with_paths(params)
    return params, Apply(
        module,
        treedef=treedef,
        leaves=leaves,
        state=state,
        state_leaves=[Leaf(g.names[0].replace(".", "/"), g.names, None) for g in carried],
        units=resolved,
        patterns=unit_patterns(resolved.paths, params),
        remat=remat,
    )
