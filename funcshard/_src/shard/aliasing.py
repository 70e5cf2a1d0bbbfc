"""Tensors that share memory: the same view twice, or views that overlap.

A pytree holds independent leaves: two leaves that share memory (a tie written
as ``head = embed.T``, or one tensor placed at two paths) would be sharded as two
independent copies and drift apart after the first update. These helpers find
such pairs so that callers can refuse them with the byte ranges.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch


def extent(t: torch.Tensor, /) -> tuple[Any, int, int] | None:
    """``(storage key, first byte, end byte)`` of the memory ``t`` spans; ``None`` where unknowable.

    Example:
        >>> base = torch.zeros(4)
        >>> extent(base[2:])[1:]
        (8, 16)
    """
    if t.device.type == "meta" or t.numel() == 0:
        return None
    item = t.element_size()
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    start = int(t.storage_offset()) * item
    return (t.device, t.untyped_storage().data_ptr()), start, start + int(span) * item


def same_view(a: torch.Tensor, b: torch.Tensor, /) -> bool:
    """Whether ``a`` and ``b`` view the same elements of one storage the same way."""
    return (
        a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def first_shared(
    paths: Sequence[str], tensors: Sequence[torch.Tensor], /
) -> tuple[str, str, tuple[int, int], tuple[int, int]] | None:
    """The first two tensors (by path) whose memory overlaps, with their byte ranges; else ``None``.

    Example:
        >>> w = torch.zeros(2, 3)
        >>> first_shared(["embed", "head"], [w, w.T])
        ('embed', 'head', (0, 24), (0, 24))
        >>> first_shared(["a", "b"], [torch.zeros(2), torch.zeros(2)]) is None
        True
    """
    by_storage: dict[Any, list[tuple[int, int, str]]] = {}
    for path, t in zip(paths, tensors):
        found = extent(t)
        if found is not None:
            key, start, stop = found
            by_storage.setdefault(key, []).append((start, stop, path))
    for spans in by_storage.values():
        spans.sort()
        for (s0, e0, p0), (s1, e1, p1) in itertools.pairwise(spans):
            if s1 < e0:
                return p0, p1, (s0, e0), (s1, e1)
    return None
