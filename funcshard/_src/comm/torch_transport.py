"""torch.distributed's collectives as a :class:`~funcshard._src.comm.transport.Transport`.

The default transport, always there ([Note: transports] in ``transport.py``):
the backend's own collectives on NCCL; on gloo the backend's own or the
point-to-point rings (``all_gather.py``, ``reduce_scatter.py``), as
``FUNCSHARD_ALL_GATHER`` and ``FUNCSHARD_REDUCE_SCATTER`` choose among the
socket algorithms.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from funcshard._src.comm import all_gather as _ag
from funcshard._src.comm import reduce_scatter as _rs
from funcshard._src.comm.algorithm import Timeout, wait_work
from funcshard._src.comm.pending import Each
from funcshard._src.comm.transport import Capabilities, OwnTerm, Transport, Work, torch_capabilities


class _Torch:
    """torch.distributed's collectives: gloo (its own or the rings) and NCCL; see [Note: transports] in ``comm/transport.py``.

    The algorithm for gloo is chosen in ``all_gather.py`` and ``reduce_scatter.py``;
    this class is the interface's view of them.
    """

    def all_gather(
        self,
        group: Any,
        flat: torch.Tensor,
        pieces: Sequence[tuple[int, torch.Tensor]],
        /,
        *,
        stable: bool = False,
    ) -> Work | None:
        size = dist.get_world_size(group)
        gloo = dist.get_backend(group) == "gloo"
        each = []
        for lo, rows in pieces:
            nbytes = rows.numel() * rows.element_size()
            chosen = _ag.fallback(_ag.default_algorithm(), size, nbytes) if gloo else "native"
            each.append(_ag.start(chosen, flat[lo : lo + rows.shape[1]], rows, group))
        return Each(each)

    def reduce_scatter(
        self,
        group: Any,
        rows: torch.Tensor,
        out: torch.Tensor,
        /,
        *,
        own: OwnTerm | None = None,
    ) -> Work | None:
        if own is not None:
            return None
        size = dist.get_world_size(group)
        nbytes = rows.numel() * rows.element_size()
        gloo = dist.get_backend(group) == "gloo"
        chosen = _rs.fallback(_rs.default_algorithm(), size, nbytes) if gloo else "native"
        return _rs.start(chosen, rows, out, group)

    def all_reduce(
        self, group: Any, buf: torch.Tensor, /, *, out: torch.Tensor | None = None
    ) -> Work | None:
        work = dist.all_reduce(buf, group=group, async_op=True)  # in place
        return work if out is None else _CopiedOut(work, buf, out)

    def input_rows(
        self, group: Any, rows: int, numel: int, dtype: torch.dtype, /
    ) -> torch.Tensor | None:
        return None

    def holds_copy(self, work: Work, /) -> bool:
        return False

    def owns(self, group: Any, rows: torch.Tensor, /) -> bool:
        return False

    def settle(self) -> None:
        return None

    def capabilities(self, backend: str, group_size: int, /) -> Capabilities:
        return torch_capabilities(backend, group_size)


class _CopiedOut:
    """An all-reduce in place whose sum is then copied into ``out``."""

    def __init__(self, work: Any, buf: torch.Tensor, out: torch.Tensor) -> None:
        self.work, self.buf, self.out = work, buf, out

    def wait(self, timeout: Timeout = None) -> bool:
        wait_work(self.work, timeout)
        self.out.copy_(self.buf)
        return True


TORCH: Transport = _Torch()
