"""Host staging buffers for an asynchronous save: copies in batches, waited for on an event.

[Note: staging in batches]
An asynchronous save copies this rank's chunks to host memory before training
changes them. From a GPU the copies go into *pinned* host memory, so that they
run as DMA transfers the host does not wait for, and the save waits on one CUDA
event recorded after the last copy on the current stream: the copies and
everything queued before them, not the whole device (``torch.cuda.synchronize``
would also wait for every other stream's work). Pinned memory is slow to
allocate, so chunks share pinned buffers: they are packed, in order, into
batches of up to :data:`BATCH_BYTES` (a chunk larger than that is a batch of its
own), each one pinned allocation, each chunk a view at a 64-byte aligned offset.
The buffers are kept from one save to the next while the chunks keep their keys,
shapes and dtypes. On the CPU the same batches are plain memory, the copies are
synchronous and the event does nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

BATCH_BYTES = 256 << 20  # bytes of chunks per pinned allocation
_ALIGN = 64


class _NoEvent:
    """The CPU's event: its copies are done when issued."""

    def synchronize(self) -> None:
        return None


def record_event(device: torch.device, /) -> torch.cuda.Event | _NoEvent:
    """An event recorded now on ``device``'s current stream (on the CPU, one that waits for nothing)."""
    if device.type != "cuda":
        return _NoEvent()
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass
class Staging:
    """Host buffers for a set of chunks, reused while their keys, shapes and dtypes stay.

    Example:
        >>> s = Staging()
        >>> out = s.stage({"a": torch.arange(3.0), "b": torch.ones(2, dtype=torch.int64)})
        >>> out["a"], out["b"], s.held_bytes, s.batches
        (tensor([0., 1., 2.]), tensor([1, 1]), 128, 1)
    """

    batch_bytes: int = BATCH_BYTES
    _signature: tuple[tuple[str, tuple[int, ...], torch.dtype, str], ...] = ()
    _buffers: list[torch.Tensor] = field(default_factory=list)  # (n,) uint8, one per batch
    _views: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def held_bytes(self) -> int:
        """Bytes of host memory the buffers hold (the chunks', plus under 64 each to align them)."""
        return sum(b.numel() for b in self._buffers)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of the chunks the buffers hold."""
        return sum(v.numel() * v.element_size() for v in self._views.values())

    @property
    def views(self) -> dict[str, torch.Tensor]:
        """The staged chunks by key: views into the buffers."""
        return dict(self._views)

    @property
    def batches(self) -> int:
        """How many host allocations the buffers are."""
        return len(self._buffers)

    def stage(self, views: dict[str, torch.Tensor], /) -> dict[str, torch.Tensor]:
        """Copies ``views`` to host buffers and returns them once the copies are done; mutates the buffers.

        See [Note: staging in batches].
        """
        signature = tuple((k, tuple(v.shape), v.dtype, v.device.type) for k, v in views.items())
        if signature != self._signature:
            self._allocate(views)
            self._signature = signature
        devices = {v.device for v in views.values() if v.device.type == "cuda"}
        for key, view in views.items():
            out = self._views[key]
            out.copy_(view.detach(), non_blocking=out.is_pinned())
        for device in devices:  # one event per device, after its last copy
            record_event(device).synchronize()
        return dict(self._views)

    def clear(self) -> None:
        """Frees the buffers; mutates."""
        self._signature, self._buffers, self._views = (), [], {}

    def _allocate(self, views: dict[str, torch.Tensor]) -> None:
        pin = any(v.device.type == "cuda" for v in views.values())
        batches: list[list[tuple[str, int, torch.Tensor]]] = [[]]
        used = [0]
        for key, view in views.items():
            size = _aligned(view.numel() * view.element_size())
            if used[-1] and used[-1] + size > self.batch_bytes:
                batches.append([])
                used.append(0)
            batches[-1].append((key, used[-1], view))
            used[-1] += size
        self._buffers, self._views = [], {}
        for members, total in zip(batches, used):
            if not members:
                continue
            buffer = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pin)
            self._buffers.append(buffer)
            for key, offset, view in members:
                nbytes = view.numel() * view.element_size()
                part = buffer[offset : offset + nbytes]
                self._views[key] = part.view(view.dtype).view(view.shape)
