"""A collective in flight (:class:`Pending`), and how every collective is issued and fails.

:func:`issue` is the one door every collective of ``collectives.py`` goes through:
it refuses a process that is out of step, checks the transport settings every rank
agreed on (``preflight.py``), records the collective in the trace that agreements
compare, and turns a failure into a :class:`CollectiveError` naming the operation,
its unit, the mesh axes and the rank (see [Note: out of step] in ``channel.py``).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from funcshard._src.comm import channel, preflight, runtime
from funcshard._src.comm.algorithm import wait_work
from funcshard._src.comm.groups import BoundMesh
from funcshard._src.comm.runtime import CollectiveError

_all_gather_single = channel.all_gather_single
_reduce_scatter_single = channel.reduce_scatter_single


@dataclass
class Pending:
    """A collective in flight; :meth:`wait` blocks until ``result`` holds the data."""

    result: torch.Tensor
    work: Any = None  # a torch.distributed Work handle, or None when already done
    what: str = ""  # "all_gather of unit 'blocks/0' over ('fsdp',) on rank 1", for errors
    then: Callable[[], None] | None = None  # runs once the work is done (e.g. copy a chunk out)
    holds_copy: bool = False  # holds a copy of its input until done (shared memory: comm/shm/)

    def wait(self) -> torch.Tensor:
        """Blocks until the collective is done and returns its result.

        Raises:
            CollectiveError: the collective failed or timed out.
        """
        if self.work is not None:
            timeout = runtime.collective_timeout()
            try:
                if timeout is None:
                    self.work.wait()
                else:
                    self.work.wait(timeout=datetime.timedelta(seconds=timeout))
            except Exception as e:
                channel.mark_out_of_step(f"{self.what} failed")
                raise failure(self.what, e, timeout) from e
            self.work = None
            if self.then is not None:
                self.then()
                self.then = None
        return self.result


class Each:
    """Several collectives waited for as one, in the order they started."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        for work in self.works:
            wait_work(work, timeout)
        return True


def issue(
    op: str,
    tag: str,
    axes: tuple[str, ...],
    bound: BoundMesh,
    group: dist.ProcessGroup,
    tensor: torch.Tensor,
    call: Callable[[], Any],
) -> Pending:
    what = (
        f"{op}{f' of unit {tag!r}' if tag else ''} over mesh axes {list(axes)} on rank {bound.rank}"
    )
    channel.ensure_in_step(what)
    preflight.check(op, tag, group, tensor, what)  # see [Note: transport settings]
    channel.record_issued(op, tag, tensor.numel(), tensor.dtype)
    try:
        work = call()
    except Exception as e:
        channel.mark_out_of_step(f"{what} failed")
        raise failure(what, e, None) from e
    return Pending(tensor, work, what)


def failure(what: str, error: Exception, timeout: float | None) -> CollectiveError:
    timed_out = timeout is not None and "timed out" in str(error).lower()
    detail = f"the other ranks did not join within {timeout:g} s" if timed_out else str(error)
    return CollectiveError(
        f"{what} failed: {detail}. A peer rank died or is running other collectives (ranks out "
        f"of step); check the other ranks' logs, and FUNCSHARD_DEBUG=1 to compare the "
        f"collectives.{channel.peer_reports()}"
    )
