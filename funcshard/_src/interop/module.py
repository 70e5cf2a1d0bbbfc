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

Frozen parameters (``requires_grad=False``) are leaves too, listed in ``apply.frozen``:
planned with ``fs.plan(..., frozen=apply.frozen)`` they are sharded, gathered and freed
per unit like the others (and cast by mixed precision), with no gradient and no
optimizer state. Buffers are not leaves: they are the module's *state*, closed over by
``apply`` and replicated on every rank (``apply.state`` shows them).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from funcshard._src import tree
from funcshard._src.interop import placeholders
from funcshard._src.interop.apply import Apply, Leaf, Params
from funcshard._src.interop.hf_checkpointing import cache_off, resolve_remat
from funcshard._src.interop.module_checks import refuse_hub_kernels, refuse_unownable
from funcshard._src.interop.module_tree import alias_groups, module_tree
from funcshard._src.interop.module_units import UnitPattern, resolve_units, unit_patterns

__all__ = ["Apply", "UnitPattern", "functionalize"]


def functionalize(
    module: nn.Module, /, *, units: Sequence[UnitPattern] = (), remat: bool = False
) -> tuple[Params, Apply]:
    """Splits ``module`` into its parameter pytree and a pure function ``apply`` over it.

    ``params`` holds the trainable parameters, nested by submodule (see
    ``[Note: module trees]``): ``model/layers/3/self_attn/q_proj/weight``. Tied
    parameters are one leaf; frozen parameters are leaves named by ``apply.frozen``
    (plan them with ``frozen=apply.frozen``); buffers are carried by ``apply`` as
    replicated state. Mutates ``module``: it holds placeholders where its parameters
    were, so that no code reads values older than the params (a read outside
    apply's calls raises ``UnboundParameterError``; ``apply.bound(params)`` binds
    values for a block; see [Note: module code outside the call] in ``interop/binding.py``). ``apply(params, *args, **kwargs)`` is the module's forward
    with the leaves of ``params``. ``units`` name submodules whose forward becomes
    one :func:`funcshard.call` each; plan with ``units=apply.units``, and a step
    gathers each unit's parameters just for its forward, with no per-layer code.

    Hugging Face models: ``model.gradient_checkpointing_enable()`` (a truthy
    ``gradient_checkpointing`` on the model's stacks or layers) becomes
    ``remat=True`` when every checkpointed layer is a unit or inside one; HF's own
    checkpointing, whose recompute would read the module's stale weights, never
    runs inside ``apply`` (its flags are ``False`` while apply runs and restored
    exactly after). Its options (``every_n_layers``, ``offload``, use_reentrant)
    do not carry over: every unit is rematerialized. A checkpointed layer that no
    unit holds is refused. Checkpointing enabled after ``functionalize`` is refused
    by ``apply`` in training with grad, unless apply already rematerializes every
    checkpointed layer. As HF's checkpointing does, in a step that rematerializes
    (``remat=True``, grad enabled) a unit's forward gets ``use_cache=False`` and no
    cache (``cache``, ``past_key_value(s)``, ``layer_past``) kwargs, and the
    model's forward ``use_cache=False`` when it takes ``use_cache`` and the caller
    passes none: a recomputed forward must not fill a cache again. Loss and logits
    are unchanged; the output's cache is then empty or ``None``.

    Args:
        module: any ``nn.Module`` (real or ``meta`` tensors; the leaves are detached
            views of its parameters, not copies).
        units: each a class (every instance is a unit), a class name (``"LlamaDecoderLayer"``),
            or a glob or ``re.Pattern`` over submodule paths (``"model/layers/*"``); a
            string that is a class name of a submodule is taken as the class. A
            pattern matching nested submodules makes the outermost a unit.
        remat: recompute each unit's activations in backward instead of keeping
            them (``fs.call(..., remat=True)``; its parameters are re-gathered for it).
            Turned on by Hugging Face gradient checkpointing (see above).

    Returns:
        ``(params, apply)``.

    Raises:
        ValueError: a unit that names no submodule (the message lists the classes
            there are), units that overlap, tied parameters used by two units,
            parameters that share memory as different tensors (overlapping views), or
            Hugging Face gradient checkpointing on in a layer that no unit holds (the
            fix: those layers as units with ``remat=True``, or
            ``model.gradient_checkpointing_disable()``); or a Hugging Face config in
            the module whose ``attn_implementation`` (or ``experts_implementation``)
            names a Hub kernel (``"kernels-community/flash-attn"``: code transformers
            downloads and runs), refused whatever is installed (the fix: ``"sdpa"`` or
            ``"eager"``).
        TypeError: ``module`` is not an ``nn.Module`` or ``units`` is malformed.

    Example:
        >>> import torch, funcshard as fs
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
        >>> expected = net(torch.ones(4, 2)).sum()
        >>> params, apply = functionalize(net, units=[nn.Linear])
        >>> fs.tree.leaf_paths(params)
        ['0/bias', '0/weight', '2/bias', '2/weight']
        >>> apply.unit_paths, apply.units
        (('0', '2'), ('*',))
        >>> plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=apply.units)
        >>> step = fs.value_and_grad(lambda p, x: apply(p, x).sum(), plan)
        >>> loss, grads = step(fs.shard(params, plan), torch.ones(4, 2))
        >>> torch.allclose(loss, expected)
        True
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"functionalize: expected an nn.Module, got {type(module).__name__}")
    held = placeholders.placeholder_of(module)
    if held is not None:
        raise ValueError(
            f"functionalize: {type(module).__name__} was functionalized already (it holds a "
            f"placeholder for {held._funcshard_info.name!r}); use the params and apply that "
            f"functionalize returned, or functionalize a copy made before it "
            f"(copy.deepcopy(model) first)"
        )
    refuse_unownable(module)
    refuse_hub_kernels(module)
    groups = alias_groups(module)
    trainable = [g for g in groups if g.kind != "buffer"]
    carried = [g for g in groups if g.kind == "buffer"]
    params = module_tree(module, "", {g.names[0]: g.tensor.detach() for g in trainable}) or {}
    state = module_tree(module, "", {g.names[0]: g.tensor.detach() for g in carried}) or {}
    resolved = resolve_units(module, units, [g.names for g in trainable])
    leaves = [
        Leaf(
            g.names[0].replace(".", "/"),
            g.names,
            resolved.unit_of(g.names[0]),
            frozen=g.kind == "frozen",
        )
        for g in trainable
    ]
    _, values, treedef = tree.flatten_with_paths(params)
    value_of = {leaf.path: v for leaf, v in zip(_in_tree_order(leaves, params), values)}
    name = type(module).__name__
    placeholders.install(
        module,
        [
            (
                leaf.names,
                placeholders.ParameterInfo(name, leaf.names[0], leaf.path, leaf.unit),
                value_of[leaf.path],
            )
            for leaf in leaves
        ],
    )  # See [Note: module code outside the call] in binding.py
    return params, Apply(
        module,
        treedef=treedef,
        leaves=leaves,
        state=state,
        state_leaves=[Leaf(g.names[0].replace(".", "/"), g.names, None) for g in carried],
        units=resolved,
        patterns=unit_patterns(resolved.paths, params),
        remat=resolve_remat(module, resolved.paths, remat=remat),
        caches=cache_off(module),
    )


def _in_tree_order(leaves: list[Leaf], params: Params) -> list[Leaf]:
    by_path = {leaf.path: leaf for leaf in leaves}
    return [by_path[path] for path in tree.leaf_paths(params)]
