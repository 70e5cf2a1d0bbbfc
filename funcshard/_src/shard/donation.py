"""Donation: buffers handed over by their owner, which a producer may write its next result into.

An optimizer ``update`` donates the gradients it consumed (as ``jax.jit``'s
``donate_argnums`` does); the next step of the same plan then writes its
gradients into those buffers instead of allocating new ones. A donated buffer
must not be read again by whoever donated it.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from funcshard._src.shard.sharded import flats_of

_DONATED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def donate(tree: Any, /) -> None:
    """Marks the flat buffers behind ``tree``'s sharded leaves as donated.

    Example:
        >>> import funcshard as fs
        >>> grads = fs.shard({"w": torch.ones(2)}, fs.plan({"w": torch.ones(2)}, fs.Mesh({"x": 1})))
        >>> donate(grads)
        >>> take_donated(grads["w"].flat.data), take_donated(grads["w"].flat.data)
        (True, False)
    """
    for flat in flats_of(tree):
        _DONATED[id(flat.data)] = flat.data


def take_donated(buffer: torch.Tensor, /) -> bool:
    """Whether ``buffer`` was donated; if so, it is the caller's from now on (unmarked)."""
    if _DONATED.get(id(buffer)) is buffer:
        del _DONATED[id(buffer)]
        return True
    return False
