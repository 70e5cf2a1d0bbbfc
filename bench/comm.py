"""Counting the bytes PyTorch's own collectives move, by wrapping torch.distributed's Python functions.

The count uses the same convention as funcshard's ledger (bandwidth-optimal
algorithms): an all-gather or reduce-scatter over ``g`` ranks sends ``(g-1)/g``
of the full buffer per rank, an all-reduce twice that. DDP's reducer calls the
process group from C++, where Python cannot see it: its bytes are given
analytically instead.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

_GATHERS = ("all_gather_single", "all_gather_into_tensor", "_all_gather_base")
_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base")


class Counter:
    """Bytes sent per rank by the wrapped collectives while :meth:`counting` is active."""

    def __init__(self) -> None:
        self.bytes = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        originals: dict[str, Any] = {}

        def wrap(name: str, count: Any) -> None:
            fn = getattr(dist, name, None)
            if fn is None:
                return
            originals[name] = fn
            signature = inspect.signature(fn)

            def wrapped(*args: Any, **kwargs: Any) -> Any:
                bound = signature.bind(*args, **kwargs)
                values = list(bound.arguments.values())  # first two: output/input (or tensor/list)
                group = bound.arguments.get("group")
                g = dist.get_world_size(group)
                self.bytes += int(count(*values[:2]) * (g - 1) / g)
                return fn(*args, **kwargs)

            setattr(dist, name, wrapped)

        for name in _GATHERS:
            wrap(name, lambda out, inp: _nbytes(out))
        for name in _SCATTERS:
            wrap(name, lambda out, inp: _nbytes(inp))
        wrap("all_reduce", lambda t, op=None: 2 * _nbytes(t))
        wrap("all_gather", lambda outs, t: sum(map(_nbytes, outs)))
        wrap("reduce_scatter", lambda out, ins: sum(map(_nbytes, ins)))
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
