"""A module's tensors as a pytree: tied and overlapping tensors, and the tree of submodule names.

[Note: tied parameters]
A tensor reachable under several names (``lm_head.weight`` is ``model.embed_tokens.weight``,
or two ``Parameter`` objects viewing exactly the same memory) is one leaf, named by
its first name in ``named_parameters`` order. Its gradient is the sum over every use,
as autograd gives it. Every use must be where the leaf is full: in the leaf's own
unit, or anywhere if the leaf is in the root unit (a unit then borrows it from the
root, whose leaves are full throughout ``loss_fn``). Different tensors whose memory
overlaps cannot be leaves of a pytree, which holds independent values: an error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import nn

from funcshard._src.shard.aliasing import extent, same_view

Kind = Literal["trainable", "frozen", "buffer"]


@dataclasses.dataclass(frozen=True)
class TensorGroup:
    """One tensor of a module and every dotted name under which the module holds it."""

    tensor: torch.Tensor
    names: tuple[str, ...]
    kind: Kind


def alias_groups(module: nn.Module, /) -> list[TensorGroup]:
    """Parameters and buffers of ``module``, one group per distinct tensor, in module order.

    Raises:
        ValueError: two different tensors share memory (see ``[Note: tied parameters]``).
    """
    found: dict[int, tuple[torch.Tensor, list[str], Kind]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        kind: Kind = "trainable" if p.requires_grad else "frozen"
        found.setdefault(id(p), (p, [], kind))[1].append(name)
    for name, b in module.named_buffers(remove_duplicate=False):
        found.setdefault(id(b), (b, [], "buffer"))[1].append(name)
    groups = [TensorGroup(t, tuple(names), kind) for t, names, kind in found.values()]
    return _merge_identical_views(groups)


def module_tree(module: nn.Module, prefix: str, wanted: Mapping[str, torch.Tensor], /) -> Any:
    """The tree of the tensors in ``wanted`` (by dotted name) under ``module``; ``None`` if none.

    See ``[Note: module trees]`` in ``module.py``: submodules and tensors by name, a list
    where the entries are named ``0`` .. ``n-1``, ``None`` for an entry without tensors.

    Example:
        >>> net = nn.Sequential(nn.Linear(1, 1), nn.ReLU())
        >>> module_tree(net, "", {"0.bias": torch.zeros(1)})
        [{'bias': tensor([0.])}, None]
    """
    names = [
        *module._parameters,
        *module._buffers,
        *module._modules,
    ]
    entries: dict[str, Any] = {}
    for name in names:
        full = prefix + name
        child = module._modules.get(name)
        if full in wanted:
            entries[name] = wanted[full]
        elif child is not None:
            sub = module_tree(child, full + ".", wanted)
            if sub is not None:
                entries[name] = sub
    if not entries:
        return None
    if sorted(names, key=lambda n: (len(n), n)) == [str(i) for i in range(len(names))]:
        return [entries.get(str(i)) for i in range(len(names))]
    return entries


def subtree_at(params: Any, path: str, /) -> Any:
    """The subtree of ``params`` (nested dicts and lists) at ``path``.

    Example:
        >>> subtree_at({"blocks": [{"w": 1}, {"w": 2}]}, "blocks/1")
        {'w': 2}
    """
    node = params
    for key in path.split("/") if path else []:
        node = node[int(key)] if isinstance(node, list) else node[key]
    return node


def _merge_identical_views(groups: list[TensorGroup]) -> list[TensorGroup]:
    """Merges groups that view exactly the same memory; refuses partial overlaps."""
    merged: list[TensorGroup] = []
    seen: dict[Any, list[int]] = {}  # storage -> indices into merged
    for group in groups:
        span = extent(group.tensor)
        if span is None:
            merged.append(group)
            continue
        key, start, stop = span
        for k in seen.get(key, []):
            other = merged[k]
            _, o_start, o_stop = extent(other.tensor) or (None, 0, 0)
            if start >= o_stop or o_start >= stop:
                continue
            if same_view(group.tensor, other.tensor) and group.kind == other.kind:
                merged[k] = dataclasses.replace(other, names=other.names + group.names)
                break
            raise ValueError(
                f"{other.kind} {other.names[0]!r} and {group.kind} {group.names[0]!r} are "
                f"different tensors that share memory (bytes [{o_start}, {o_stop}) and "
                f"[{start}, {stop}) of one storage); a pytree holds independent leaves, so this "
                f"sharing cannot be expressed: tie them (assign one Parameter to both names) "
                f"or give each its own memory (nn.Parameter(t.clone()))"
            )
        else:
            seen.setdefault(key, []).append(len(merged))
            merged.append(group)
    return merged
