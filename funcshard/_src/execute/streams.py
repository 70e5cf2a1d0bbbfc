"""The side streams a parameter group issues its collectives on, and the events that order them.

As FSDP2 (``_fsdp_param_group.py``), a device with streams gets four of its own,
high priority, shared by every group on that device: one that casts and packs a
unit's shards for its all-gather (copy-in), one for all-gathers, one for
reduce-scatters and one for all-reduces. The compute stream never waits on the
host for them: after each collective an event is recorded on its stream, and
the stream that uses the result waits on that event.

Written against the device's own Stream and Event API
(``torch.get_device_module``). On the CPU there are no streams: :func:`streams_for`
gives :data:`NO_STREAMS`, whose :attr:`~Streams.active` is false; the parameter
group checks the device's type before it asks for streams at all
(``param_group._side``), so the CPU path does no extra work, enters no extra
file, and its results are the same bits.

[Note: streams and buffer lifetimes]
A tensor made on one stream and used on another stays valid by one of three rules:

* The staging buffers (all-gather inputs and outputs, packed gradients) are made
  on the compute stream (a ``BufferPool`` or the ``Reducer``) and are referenced
  by the host until the compute stream has waited on the event recorded after the
  collective that last uses them (:meth:`Streams.wait_for`); only then are they
  given back to a pool or dropped. A side stream waits on the compute stream
  (:meth:`Streams.after_compute`) before it reads or writes them, so a buffer
  given back and handed out again is never written while a collective still
  reads it.
* A tensor made while a side stream is current (a cast for the all-gather, a
  collective's own result) is marked with ``record_stream`` for the stream that
  uses it next (:meth:`Streams.keep_for`), so the allocator does not hand its memory
  out again before that use is done.
* Every input of a collective is marked with ``record_stream`` for the side stream
  it was issued on: NCCL's work keeps its inputs only until its wait, which
  :meth:`Streams.issued` calls at once, and a host reference may end before the
  consumer waits (the root unit's packed gradients, a cast shard, a partial copy).

On NCCL a collective issued with ``async_op`` runs on NCCL's stream;
``Work.wait()`` makes the current stream wait for it and returns at once (see
[Note: waits that never block the host] in ``comm/collectives.py``). So
:meth:`Streams.issued` waits on the work while the collective's side stream is
current and records the event there: the host never waits inside a step. On
gloo, whose wait blocks the host, the wait is left to the consumer, as on the CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from funcshard._src.comm import runtime
from funcshard._src.comm.collectives import Pending


class Streams:
    """A device's side streams for collectives; this base is the CPU's: no streams, nothing to order.

    Example:
        >>> s = streams_for(torch.device("cpu"))
        >>> s.active
        False
        >>> with s.use(s.all_gather):
        ...     pass
    """

    active = False
    copy_in: Any = None
    all_gather: Any = None
    reduce_scatter: Any = None
    all_reduce: Any = None

    def use(self, stream: Any, /) -> contextlib.AbstractContextManager[Any]:
        """Makes ``stream`` current inside the ``with`` block (on the CPU: nothing)."""
        return contextlib.nullcontext()

    def after_compute(self, stream: Any, /) -> None:
        """``stream`` waits for what the compute stream has queued so far."""

    def after(self, stream: Any, other: Any, /) -> None:
        """``stream`` waits for what ``other`` has queued so far."""

    def issued(self, pending: Pending, stream: Any, /) -> None:
        """``pending`` was just issued on ``stream``: records the event its consumer waits on."""

    def wait_for(self, pending: Pending, /) -> None:
        """The current (compute) stream waits on ``pending``'s event, and keeps its result."""

    def keep_for(self, tensor: torch.Tensor, stream: Any, /) -> None:
        """``tensor``, made on another stream, is in use on ``stream`` too (``record_stream``)."""


NO_STREAMS = Streams()


class DeviceStreams(Streams):
    """Four high-priority side streams of one device, from its device module; see [Note: streams and buffer lifetimes]."""

    active = True

    def __init__(
        self,
        module: Any,
        /,
        *,
        record_stream: Callable[[torch.Tensor, Any], None] = torch.Tensor.record_stream,
    ) -> None:
        self.module = module
        self._record_stream = record_stream
        # priority -1 is high on CUDA, as FSDP2's streams
        self.copy_in = module.Stream(priority=-1)
        self.all_gather = module.Stream(priority=-1)
        self.reduce_scatter = module.Stream(priority=-1)
        self.all_reduce = module.Stream(priority=-1)

    @contextlib.contextmanager
    def _using(self, stream: Any) -> Iterator[Any]:
        with self.module.stream(stream):
            yield stream

    def use(self, stream: Any, /) -> contextlib.AbstractContextManager[Any]:
        return self._using(stream)

    def after_compute(self, stream: Any, /) -> None:
        stream.wait_stream(self.module.current_stream())

    def after(self, stream: Any, other: Any, /) -> None:
        stream.wait_stream(other)

    def issued(self, pending: Pending, stream: Any, /) -> None:
        if pending.work is not None and runtime.wait_timeout_s(pending.backend) is not None:
            return  # gloo: its wait blocks the host, the consumer waits as on the CPU
        with self.module.stream(stream):
            pending.wait()  # NCCL: this stream waits for the collective, the host goes on
            event = self.module.Event()
            event.record(stream)
        pending.event = event

    def wait_for(self, pending: Pending, /) -> None:
        event = pending.event
        if event is None:
            return
        current = self.module.current_stream()
        current.wait_event(event)
        self.keep_for(pending.result, current)
        pending.event = None

    def keep_for(self, tensor: torch.Tensor, stream: Any, /) -> None:
        self._record_stream(tensor, stream)


_BY_DEVICE: dict[torch.device, Streams] = {}


def streams_for(device: torch.device, /) -> Streams:
    """The side streams of ``device``, made once per device; :data:`NO_STREAMS` on the CPU or a device without streams.

    Example:
        >>> streams_for(torch.device("cpu")) is NO_STREAMS
        True
    """
    if device.type == "cpu":
        return NO_STREAMS
    found = _BY_DEVICE.get(device)
    if found is None:
        module = torch.get_device_module(device)
        if not hasattr(module, "Stream") or not hasattr(module, "Event"):
            found = NO_STREAMS
        else:
            with module.device(device):
                found = DeviceStreams(module)
        _BY_DEVICE[device] = found
    return found
