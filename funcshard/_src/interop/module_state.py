"""A functionalized module's state: its buffers, replicated on every rank, held by the module too.

Buffers are not leaves of the params: ``apply`` binds these tensors to their names
in every call, and the module holds the same tensors between calls, so a read of a
buffer anywhere sees the current value (see [Note: module code outside the call] in
``binding.py``). A forward that updates a buffer in place (batch-norm statistics)
updates it here; one that assigns it anew (``self.steps = self.steps + 1``) is adopted
after the call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from funcshard._src import tree
from funcshard._src.comm import runtime
from funcshard._src.interop.leaf_check import Leaf

__all__ = ["ModuleState"]


class ModuleState:
    """The buffers of one functionalized module, as a tree and by dotted name; mutable.

    Example:
        >>> bn = nn.BatchNorm1d(2)
        >>> state = ModuleState(bn, {"running_mean": bn.running_mean}, [Leaf("running_mean", ("running_mean",), None)])
        >>> state.replace([torch.ones(2)])
        >>> bn.running_mean
        tensor([1., 1.])
    """

    def __init__(self, module: nn.Module, state: Any, leaves: Sequence[Leaf], /) -> None:
        self._module = module
        self._leaves = tuple(leaves)
        self.tree: Any = state  # the buffers as a tree like the params
        self.tensors: dict[str, torch.Tensor] = {}  # every dotted name of every buffer
        paths, values, _ = tree.flatten_with_paths(state)
        by_path = dict(zip(paths, values))
        self.replace([by_path[leaf.path] for leaf in self._leaves])

    @property
    def leaves(self) -> tuple[Leaf, ...]:
        """One per buffer (its names, the first initialized first)."""
        return self._leaves

    def replace(self, values: Sequence[torch.Tensor], /) -> None:
        """Makes ``values`` (one per buffer, in order) the buffers; mutates this and the module."""
        by_path = {leaf.path: v for leaf, v in zip(self._leaves, values)}
        paths, _, treedef = tree.flatten_with_paths(self.tree)
        self.tree = tree.unflatten(treedef, [by_path[path] for path in paths])
        self.tensors = {name: v for leaf, v in zip(self._leaves, values) for name in leaf.names}
        for name, value in self.tensors.items():  # never stale: the module holds them too
            owner, _, attr = name.rpartition(".")
            self._module.get_submodule(owner)._buffers[attr] = value

    def broadcast(self, *, src: int = 0) -> None:
        """Every rank's buffers become rank ``src``'s, in place; collective (DDP's ``broadcast_buffers``)."""
        if not runtime.is_distributed() or runtime.world_size() == 1:
            return
        if not 0 <= src < runtime.world_size():
            raise ValueError(
                f"apply.broadcast_state: src={src!r} is not a rank of this run (0 to "
                f"{runtime.world_size() - 1})"
            )
        for leaf in self._leaves:
            tensor = self.tensors[leaf.names[0]]
            if tensor.device.type == "meta":
                raise ValueError(
                    f"apply.broadcast_state: buffer {leaf.path!r} is on the meta device; give "
                    f"the buffers values first (apply.materialize or apply.materialize_state)"
                )
            dist.broadcast(tensor, src)

    def adopt(self, bound: Mapping[str, Any], /) -> None:
        """Keeps the buffers a call assigned anew (``bound``: what it bound, after it); mutates this."""
        values = [bound[leaf.names[0]] for leaf in self._leaves]
        if any(v is not self.tensors[leaf.names[0]] for leaf, v in zip(self._leaves, values)):
            self.replace(values)
