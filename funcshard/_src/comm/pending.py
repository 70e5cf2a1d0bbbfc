"""A collective in flight (:class:`Pending`), and how every collective is issued and fails.

:func:`issue` is the one door every collective of ``collectives.py`` goes through:
it refuses a process that is out of step, checks the transport settings every rank
agreed on (``preflight.py``), records the collective in the trace that agreements
compare, and turns a failure into a :class:`CollectiveError` naming the operation,
its unit, the mesh axes and the rank (see [Note: out of step] in ``comm/settle.py``).

[Note: waits that never block the host]
On NCCL, ``Work.wait()`` makes the current CUDA stream wait for the collective
and returns at once; ``Work.wait(timeout=...)`` instead blocks the host thread
until the collective has finished. A timed wait would stall the host at every
gather and reduction, so it could never run ahead of the GPU. So no timeout
reaches a wait anywhere but on gloo, and :func:`runtime.wait_timeout_s` is the
one place that decides: on NCCL the process group's own timeout (``fs.init``
passes ``timeout_s`` to ``init_process_group``) and its watchdog end a
collective that never completes; on gloo, where every wait blocks the host
anyway, the collective timeout bounds it and its error names the collective.
:func:`wait_for` is the wait that every :class:`Pending` goes through.
"""

from __future__ import annotations

import datetime
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from funcshard._src.comm import channel, preflight, runtime
from funcshard._src.comm.groups import BoundMesh
from funcshard._src.comm.runtime import CollectiveError, wait_work

_all_gather_single = channel.all_gather_single
_reduce_scatter_single = channel.reduce_scatter_single


@dataclass
class Pending:
    """A collective in flight; :meth:`wait` blocks until ``result`` holds the data."""

    result: torch.Tensor
    work: Any = None  # a torch.distributed Work handle, or None when already done
    # "all_gather of unit 'blocks/0' over ('fsdp',) on rank 1", for errors: a str, or an
    # object that formats as one when shown (issue)
    what: object = ""
    then: Callable[[], None] | None = None  # runs once the work is done (e.g. copy a chunk out)
    holds_copy: bool = False  # holds a copy of its input until done (shared memory: comm/shm/)
    backend: str | None = None  # the backend of its group: what its wait may pass (wait_for)
    # an event recorded on its side stream after it, for the consumer's stream to wait on
    # (see [Note: streams and buffer lifetimes] in ``execute/streams.py``); None on the CPU
    event: Any = None

    def wait(self) -> torch.Tensor:
        """Returns the result once the collective is done (on NCCL: once the current stream waits for it).

        Raises:
            CollectiveError: the collective failed or timed out.
        """
        if self.work is not None:
            try:
                wait_for(self.work, self.backend)
            except WaitError as e:
                channel.mark_out_of_step(f"{self.what} failed")
                raise failure(self.what, e.error, e.timeout) from e.error
            self.work = None
            if self.then is not None:
                self.then()
                self.then = None
        return self.result


class WaitError(Exception):
    """A wait of :func:`wait_for` raised ``error`` after waiting with ``timeout`` seconds."""

    def __init__(self, error: Exception, timeout: float | None) -> None:
        super().__init__(str(error))
        self.error, self.timeout = error, timeout


def wait_for(work: Any, backend: str | None, /) -> None:
    """Waits for ``work`` of a collective issued on ``backend``: with a timeout on gloo alone.

    See [Note: waits that never block the host]. On NCCL ``work.wait()`` gets no
    argument, so the host goes on and the current stream waits for the collective.

    Raises:
        WaitError: the wait raised; it carries the error and the timeout used.

    Example:
        >>> class Work:
        ...     def wait(self, **kwargs):
        ...         print(kwargs)
        >>> wait_for(Work(), "nccl")
        {}
    """
    timeout = runtime.wait_timeout_s(backend)
    try:
        wait_work(work, None if timeout is None else datetime.timedelta(seconds=timeout))
    except Exception as e:
        raise WaitError(e, timeout) from e


def issue(
    op: str,
    tag: str,
    axes: tuple[str, ...],
    bound: BoundMesh,
    group: dist.ProcessGroup,
    tensor: torch.Tensor,
    call: Callable[[], Any],
) -> Pending:
    def what() -> str:  # for errors alone: formatted only when one is raised
        return f"{op}{f' of unit {tag!r}' if tag else ''} over mesh axes {list(axes)} on rank {bound.rank}"

    ch = channel.existing_channel()
    if ch is not None:
        if ch.out_of_step is not None:
            channel.ensure_in_step(what())
        ch.record_issued(op, tag, tensor.numel(), tensor.dtype)
    preflight.check(
        ch, op, tag, group, tensor, what
    )  # [Note: transport settings] in comm/preflight.py
    try:
        work = call()
    except Exception as e:
        channel.mark_out_of_step(f"{what()} failed")
        raise failure(what(), e, None) from e
    return Pending(tensor, work, _What(what), backend=backend_of(group))


class _What:
    """A collective's description for errors, formatted when first shown."""

    __slots__ = ("_format", "_text")

    def __init__(self, format: Callable[[], str]) -> None:
        self._format, self._text = format, None

    def __str__(self) -> str:
        if self._text is None:
            self._text = self._format()
        return self._text

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


_BACKENDS: weakref.WeakKeyDictionary[dist.ProcessGroup, str] = weakref.WeakKeyDictionary()


def backend_of(group: dist.ProcessGroup, /) -> str:
    """``group``'s backend (``"gloo"``, ``"nccl"``, ``"fake"``), looked up once per group."""
    backend = _BACKENDS.get(group)
    if backend is None:
        backend = _BACKENDS[group] = str(dist.get_backend(group))
    return backend


def failure(what: str, error: Exception, timeout: float | None) -> CollectiveError:
    timed_out = timeout is not None and "timed out" in str(error).lower()
    detail = f"the other ranks did not join within {timeout:g} s" if timed_out else str(error)
    return CollectiveError(
        f"{what} failed: {detail}. A peer rank died or is running other collectives (ranks out "
        f"of step); check the other ranks' logs, and FUNCSHARD_DEBUG=1 to compare the "
        f"collectives.{channel.peer_reports()}"
    )
