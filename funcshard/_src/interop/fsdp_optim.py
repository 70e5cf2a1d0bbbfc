"""funcshard's optimizer states as ``torch.optim`` keeps them: per parameter, by state name.

``torch.optim.AdamW`` (and ``Adam``) keep ``exp_avg``, ``exp_avg_sq`` and a 0-d
float ``step`` per parameter; ``SGD`` keeps ``momentum_buffer``; an elementwise
optimizer run through ``fs.optim.from_torch`` keeps its own names. funcshard's
``AdamWState`` holds the same moments as trees like the params (``mu``, ``nu``)
and one ``count``; ``SGDState`` its ``momentum``; ``TorchOptimState`` torch's
names. :func:`torch_slots` finds those states anywhere in an optimizer state
(inside ``chain``, ``masked``, ``partition``, ``skip_nonfinite``) and says how
each maps; a state with per-parameter tensors that torch has no name for
(Lion, Adafactor, EMA params) is refused, naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from funcshard._src import tree
from funcshard._src.optim.adamw import AdamWState
from funcshard._src.optim.sgd import SGDState
from funcshard._src.optim.torch_optim import TorchOptimState
from funcshard._src.shard.sharded import ShardedTensor


@dataclass(frozen=True)
class TorchSlots:
    """One optimizer state node as torch keeps it: per-parameter tensors and 0-d values."""

    where: str  # its path in the optimizer state, for messages
    tensors: Mapping[str, Any]  # torch's state name -> a tree like the params (None: no state)
    scalars: Mapping[str, torch.Tensor]  # torch's state name -> its 0-d value, as torch keeps it
    sinks: Mapping[str, tuple[torch.Tensor, ...]]  # where a loaded 0-d value goes
    started: tuple[torch.Tensor, ...] = ()  # 0-d flags a load sets: the state holds values

    def leaves(self) -> dict[str, dict[str, ShardedTensor]]:
        """Per leaf path with state: torch's state name -> its sharded tensor, names sorted.

        Sorted, not in the state's order: every rank must save the same entries in the
        same order, and a state built from a set differs per process (PYTHONHASHSEED).
        """
        out: dict[str, dict[str, ShardedTensor]] = {}
        for name, slot in sorted(self.tensors.items()):
            paths, values, _ = tree.flatten_with_paths(slot)
            for path, value in zip(paths, values):
                if isinstance(value, ShardedTensor):
                    out.setdefault(path, {})[name] = value
        return out


def torch_slots(state: Any, /) -> list[TorchSlots]:
    """Every AdamW, SGD and ``from_torch`` state in ``state``, as torch keeps it.

    Raises:
        ValueError: a state with per-parameter tensors that torch has no name for, or
            two states that both hold a leaf.

    Example:
        >>> import funcshard as fs
        >>> p = {"w": torch.ones(2)}
        >>> sp = fs.shard(p, fs.plan(p, fs.Mesh({"x": 1})))
        >>> [sorted(s.tensors) for s in torch_slots(fs.optim.adamw(lr=0.1).init(sp))]
        [['exp_avg', 'exp_avg_sq']]
    """
    found: list[TorchSlots] = []
    _visit(state, "", None, found)
    owner: dict[str, str] = {}
    for slots in found:
        for path in slots.leaves():
            if path in owner:
                raise ValueError(
                    f"{path}: optimizer states {owner[path] or '<root>'!r} and "
                    f"{slots.where or '<root>'!r} both hold it; torch keeps one state per parameter"
                )
            owner[path] = slots.where
    return found


def _visit(node: Any, where: str, owner: str | None, found: list[TorchSlots]) -> None:
    if isinstance(node, AdamWState):
        step = node.count.to(torch.float32)  # torch's AdamW keeps a float step
        found.append(
            TorchSlots(
                where,
                {"exp_avg": node.mu, "exp_avg_sq": node.nu},
                {"step": step},
                {"step": (node.count,)},
            )
        )
    elif isinstance(node, SGDState):
        tensors = {} if node.momentum is None else {"momentum_buffer": node.momentum}
        found.append(TorchSlots(where, tensors, {}, {}))  # torch's SGD keeps no step
    elif isinstance(node, TorchOptimState):
        scalars = dict(sorted(node.scalars.items()))
        sinks = {k: (v, node.count) if k == "step" else (v,) for k, v in scalars.items()}
        tensors = dict(sorted(node.tensors.items()))
        found.append(TorchSlots(where, tensors, scalars, sinks, (node.started,)))
    elif isinstance(node, ShardedTensor):
        raise ValueError(
            f"{where or '<root>'}: a {owner or 'optimizer state'} holds per-parameter state that "
            f"torch.optim has no name for; DCP checkpoints map fs.optim.adamw (torch's AdamW and "
            f"Adam), fs.optim.sgd and fs.optim.from_torch(...) states"
        )
    elif isinstance(node, tuple):
        fields = getattr(node, "_fields", None)
        kind = type(node).__name__ if fields is not None else owner
        for i, child in enumerate(node):  # pyright: ignore[reportUnknownVariableType, reportUnknownArgumentType]
            name = fields[i] if fields is not None else str(i)
            _visit(child, f"{where}/{name}" if where else name, kind, found)
    elif isinstance(node, list | dict):
        items = node.items() if isinstance(node, dict) else enumerate(node)  # pyright: ignore[reportUnknownVariableType, reportUnknownMemberType, reportUnknownArgumentType]
        for key, child in items:  # pyright: ignore[reportUnknownVariableType]
            _visit(child, f"{where}/{key}" if where else str(key), owner, found)  # pyright: ignore[reportUnknownArgumentType]
