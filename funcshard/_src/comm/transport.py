"""The transport: how a collective's bytes cross between ranks, behind one interface.

[Note: transports]
Every data collective of funcshard (``collectives.py``) goes through a
:class:`Transport`: an all-gather, a reduce-scatter, an all-reduce, input
buffers a collective may send as they are, and the :class:`Capabilities` the
planner and the executor ask about. Two implement it:

- torch.distributed's collectives (``torch_transport.TORCH``): the backend's own on NCCL,
  and on gloo the backend's own or its point-to-point rings. Always there.
- the shared-memory transport for gloo ranks on one host (the package
  ``funcshard._src.comm.shm``, [Note: shared-memory collectives] in ``comm/shm/__init__.py`` there): a
  plug-in. Nothing outside that package names its modules or types; it is
  imported only when chosen, by :func:`shared_memory`, and never where
  ``FUNCSHARD_SHM=0`` or the host has no ``memfd``. Where its package is
  missing (deleted, or its import fails) gloo and NCCL run as with
  ``FUNCSHARD_SHM=0``.

A plug-in's methods return ``None`` where they cannot serve a group (its ranks
cannot share memory); the caller then runs torch's collective, the same on
every rank. The choice is made the same way on every rank: the settings that
decide it are agreed on before the first collective ([Note: transport
settings] in ``collectives.py``).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from funcshard._src.comm import runtime
from funcshard._src.plan.strategy import Capabilities, declare_transport

SHM_ENV = "FUNCSHARD_SHM"
SHM_PACKAGE = "funcshard._src.comm.shm"
# a reduce-scatter input at least this large is reduced a range of columns at a time
# (execute/param_group.py, [Note: reductions in chunks]); the shared-memory transport gives a
# region this large its pages back while it is free
LARGE_BYTES = 32 << 20
# collectives of fewer bytes keep gloo's own. 0: every collective of a group that shares
# memory goes through it; with descriptors on the board (shm/board.py) a tiny one takes
# 0.13 ms at W=2 against 0.19 ms for gloo's own (python -m bench.all_gather), though with
# gloo's all-gather of descriptors (not x86) 0.36 ms; a threshold measured per machine is
# not done
SHM_MIN_BYTES = 0


class OwnTerm(Protocol):
    """This rank's own row of a reduce-scatter, made when summed: ``out = base + row`` (``row`` for ``None``)."""

    def __call__(self, out: torch.Tensor, base: torch.Tensor | None, /) -> None: ...


class Work(Protocol):
    """A collective in flight, as ``torch.distributed``'s ``Work``: ``wait`` finishes it."""

    def wait(self, timeout: Any = None) -> bool: ...


class Transport(Protocol):
    """How collectives cross between the ranks of a process group; see [Note: transports].

    Each method starts a collective and returns its :class:`Work`, or ``None``
    where this transport cannot serve ``group`` (every rank alike).
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
        """Gathers pieces ``(offset, rows)`` of every rank's ``flat``: rank ``j``'s ``flat[offset:offset + n]`` into ``rows[j]``."""
        ...

    def reduce_scatter(
        self,
        group: Any,
        rows: torch.Tensor,
        out: torch.Tensor,
        /,
        *,
        own: OwnTerm | None = None,
    ) -> Work | None:
        """Sums ``rows`` ``(W, n)`` over the group into ``out`` ``(n,)``, row ``i`` to group rank ``i``."""
        ...

    def all_reduce(
        self, group: Any, buf: torch.Tensor, /, *, out: torch.Tensor | None = None
    ) -> Work | None:
        """Sums ``buf`` over the group, in place or into ``out``."""
        ...

    def input_rows(
        self, group: Any, rows: int, numel: int, dtype: torch.dtype, /
    ) -> torch.Tensor | None:
        """A ``(rows, numel)`` buffer the next collective on ``group`` sends as it is, or ``None``."""
        ...

    def holds_copy(self, work: Work, /) -> bool:
        """Whether ``work`` holds a copy of its input until it is done."""
        ...

    def owns(self, group: Any, rows: torch.Tensor, /) -> bool:
        """Whether ``rows`` came from :meth:`input_rows` for the next collective on ``group``."""
        ...

    def settle(self) -> None:
        """Returns once every peer has read what this rank published in place."""
        ...

    def capabilities(self, backend: str, group_size: int, /) -> Capabilities:
        """What this transport does for a group of ``group_size`` ranks on ``backend``."""
        ...


def shm_enabled() -> bool:
    """Whether the shared-memory transport may be chosen: ``memfd`` exists and ``FUNCSHARD_SHM`` is not ``0``.

    Its package may still be missing; :func:`shared_memory` says whether it is there.

    Example:
        >>> isinstance(shm_enabled(), bool)
        True
    """
    # [Note: settings held through a step] in comm/runtime.py
    return hasattr(os, "memfd_create") and runtime.setting(SHM_ENV, "1").strip() != "0"


@functools.cache
def _plugin() -> Transport | None:
    try:
        module = importlib.import_module(SHM_PACKAGE)
    except ImportError:  # deleted, or blocked: gloo's sockets
        return None
    return module.TRANSPORT


def shared_memory() -> Transport | None:
    """The shared-memory transport, imported on first use; ``None`` where it is off or its package is missing.

    Example:
        >>> shared_memory() is None or shm_enabled()
        True
    """
    if not shm_enabled():
        return None
    return _plugin()


def uses_shared_memory(nbytes: int, /) -> bool:
    """Whether ``"auto"`` picks the shared-memory transport for a gloo collective of ``nbytes``.

    Example:
        >>> uses_shared_memory(1 << 20) == (shared_memory() is not None)
        True
    """
    return nbytes >= SHM_MIN_BYTES and shared_memory() is not None


def torch_capabilities(backend: str, group_size: int, /) -> Capabilities:
    """What torch.distributed's collectives do for a group (``torch_transport.py``).

    Example:
        >>> torch_capabilities("gloo", 2).gathers_leaf_by_leaf, torch_capabilities("nccl", 2).gathers_leaf_by_leaf
        (True, False)
    """
    # gloo over two ranks: one ring per leaf writes straight into the leaf and saves the
    # unpacking copy into fresh pages (all_gather.leaf_algorithm). Elsewhere it is not
    # measured: gloo's native all-gather and its rings over more ranks step through buffers
    # or waits of their own, and on nccl one collective per leaf costs a launch each where
    # the unpacking copy is cheap.
    return Capabilities(gathers_leaf_by_leaf=(backend, group_size) == ("gloo", 2))


declare_transport(torch_capabilities)  # the cost model's view: see Capabilities


def capabilities(backend: str, group_size: int, /) -> Capabilities:
    """What the transport of a group of ``group_size`` ranks on ``backend`` does.

    Leaf-by-leaf gathers are torch's (the shared-memory transport gathers the
    same parts leaf by leaf, in one collective); inputs sent in place are the
    shared-memory transport's, where it is on.

    Example:
        >>> capabilities("gloo", 2).gathers_leaf_by_leaf, capabilities("nccl", 2).gathers_leaf_by_leaf
        (True, False)
    """
    caps = torch_capabilities(backend, group_size)
    plugin = shared_memory() if backend == "gloo" else None
    if plugin is None:
        return caps
    extra = plugin.capabilities(backend, group_size)
    return Capabilities(
        gathers_leaf_by_leaf=caps.gathers_leaf_by_leaf,
        sends_inputs_in_place=extra.sends_inputs_in_place,
    )


def settle() -> None:
    """Returns once every peer has read what this rank's gathers published in place.

    At once where nothing was, and where the shared-memory transport was never
    imported.

    Raises:
        CollectiveError: a peer exited, or has not read within the collective timeout.
    """
    if _plugin.cache_info().currsize:
        plugin = _plugin()
        if plugin is not None:
            plugin.settle()
