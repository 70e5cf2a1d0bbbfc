"""Staging buffers reused across calls: all-gather outputs and reduce-scatter inputs.

Every unit's all-gather writes into a ``(group_size * numel,)`` buffer that is
unpacked into the unit's full leaves and then no longer needed, and every
unit's gradients are packed into a ``(group_size, numel)`` buffer that is only
read by its reduce-scatter. Allocating them afresh for every unit and step
costs more than the copies themselves where the allocator returns large blocks
to the system (fresh pages are faulted in and zeroed: 7.4 ms for 12 MiB against
0.9 ms into memory in use, measured on the benchmark's machine). A
:class:`BufferPool` keeps what was given back, per size and dtype, and hands it
out again.

[Note: staging lifetimes]
A buffer is given back only once no collective uses it: an all-gather output
after its wait and its unpacking, a reduce-scatter input after its wait. The
executor needs at most ``prefetch`` all-gather outputs and one reduce-scatter
input at once (the next unit's gradients are packed only after the reduction
before them finished, see ``MAX_PENDING`` in ``reduce.py``), so a step keeps
two pools, one of that depth for all-gather outputs and one of depth one for
reduce-scatter inputs, and they serve every unit of a stack of identical blocks
with no allocation after the first step. What the pools keep between calls
(:attr:`BufferPool.held_bytes`) is ``Step.stats.staging_bytes``, and the cost
model counts it as the staging buffers. After an error, buffers of collectives
in flight are dropped, never given back (the collective may still write).
"""

from __future__ import annotations

import torch

_Key = tuple[int, torch.dtype, torch.device]


class BufferPool:
    """Free staging buffers by (numel, dtype, device), at most ``depth`` of each; mutates.

    ``depth=0`` keeps nothing: the root unit's staging, used once a step and as large
    as the embeddings, would otherwise be held through every forward.
    """

    def __init__(self, depth: int = 1) -> None:
        if depth < 0:
            raise ValueError(f"a buffer pool needs a depth of at least 0, got {depth}")
        self.depth = depth
        self.allocations = 0  # buffers made because none of the kind was free
        self._free: dict[_Key, list[torch.Tensor]] = {}

    @property
    def held_bytes(self) -> int:
        """Bytes of the free buffers the pool keeps."""
        return sum(t.numel() * t.element_size() for ts in self._free.values() for t in ts)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A ``(numel,)`` buffer of uninitialized values: one given back before, or a new one.

        Example:
            >>> pool = BufferPool()
            >>> a = pool.take(4, torch.float32, torch.device("cpu"))
            >>> pool.give(a)
            >>> pool.take(4, torch.float32, torch.device("cpu")) is a
            True
        """
        free = self._free.get((numel, dtype, device))
        if free:
            return free.pop()
        self.allocations += 1
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, buffer: torch.Tensor, /) -> None:
        """Takes ``buffer`` back for reuse; the caller must not use it again (no collective may).

        Only whole buffers from :meth:`take` (or views of all of one) are kept;
        beyond ``depth`` of a kind, the buffer is dropped.
        """
        base = buffer if buffer._base is None else buffer._base
        if base.dim() != 1 or base.numel() != buffer.numel():
            return
        free = self._free.setdefault((base.numel(), base.dtype, base.device), [])
        if len(free) < self.depth:
            free.append(base)

    def clear(self) -> None:
        """Drops every free buffer."""
        self._free.clear()
