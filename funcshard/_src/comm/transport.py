"""The transport: how a collective's bytes cross between ranks, behind one interface.

[Note: transports]
Every data collective of funcshard is issued by ``collectives.py``, which
reaches the ranks through a transport: an all-gather, a reduce-scatter, an
all-reduce, input buffers a collective may send as they are, and the
:class:`Capabilities` the planner and the executor ask about (the
:class:`Transport` protocol). Two implement it:

- torch.distributed's collectives (:data:`TORCH`, below): the backend's own on NCCL,
  and on gloo the backend's own or its point-to-point rings. Always there.
- the shared-memory transport for gloo ranks on one host (the package
  ``funcshard._src.comm.shm``, [Note: shared-memory collectives] in ``comm/shm/__init__.py`` there): a
  plug-in. Nothing outside that package names its modules or types; it is
  imported only when chosen, by :func:`shared_memory`, and never where
  ``FUNCSHARD_SHM=0`` or the host has no ``memfd``. Where its package is
  missing (deleted, or its import fails) gloo and NCCL run as with
  ``FUNCSHARD_SHM=0``.

How ``collectives.py`` reaches them: on gloo, an all-gather or a
reduce-scatter runs the algorithm chosen by name (:data:`ALL_GATHER`,
:data:`REDUCE_SCATTER`, below), of which ``"shm"`` is the plug-in's method and
the others gloo's own collective or point-to-point rings; on any other backend
torch's own collective, called directly (what :data:`TORCH`'s ``all_gather`` and
``reduce_scatter`` do too, for a caller that holds a :class:`Transport`). An
all-reduce goes to the plug-in where it serves the group, else to :data:`TORCH`.
The gather of a whole tree to rank 0 (``fs.unshard(..., rank0_only=True)``) is
torch's own ``gather``, on no transport.

A plug-in's methods return ``None`` where they cannot serve a group (its ranks
cannot share memory); the caller then runs torch's collective, the same on
every rank. The choice is made the same way on every rank: the settings that
decide it are agreed on before the first collective ([Note: transport
settings] in ``collectives.py``).

**torch.distributed's collectives** as a :class:`Transport`, and the algorithms
gloo runs them with.

The default transport, always there ([Note: transports], above):
the backend's own collectives on NCCL; on gloo the backend's own or the
point-to-point algorithms below, chosen by name (:data:`ALL_GATHER`,
:data:`REDUCE_SCATTER`: ``FUNCSHARD_ALL_GATHER`` and ``FUNCSHARD_REDUCE_SCATTER``,
which every rank agrees on before its first collective, ``collectives.py``).
:class:`Algorithms` is the one rule by which ``"auto"`` and ``"shm"`` become the
algorithm that runs.

All-gather. gloo's own ``all_gather_into_tensor`` stages the input and the output through
buffers of its own and copies the result out, on top of the transfer. The
algorithms here, over a group of ``W`` ranks, gather ``flat`` ``(n,)`` into
``rows`` ``(W, n)``, row ``j`` from group rank ``j``:

- ``"native"``: the backend's ``all_gather_into_tensor``; always on nccl.
- ``"ring"``: copy ``flat`` into this rank's row, then ``W - 1`` steps; in
  each, send the row received in the step before (``flat`` in the first) to
  the next rank and receive the previous rank's into its own row of ``rows``:
  no buffer of its own, no copy but this rank's row. At ``W = 2`` this is the
  pairwise exchange: send ``flat``, receive the other rank's row.
- ``"ring_overlapped"``: the ring, with the copy of this rank's row made after
  the first step is issued, while it runs.
- ``"direct"``: send ``flat`` to every other rank and receive each one's row
  straight into it, all issued at once (rank ``r`` sends to ``r + k`` and
  receives from ``r - k``, ``k = 1 .. W - 1``), then copy this rank's row: no
  buffer of its own, and no step waits for another, so at any ``W`` the whole
  transfer runs in gloo's background threads. At ``W = 2`` it is the ring.
- ``"shm"``: ranks on one host read each other's shards from shared memory
  (the plug-in of ``transport.py``, [Note: transports]); where the group's ranks
  cannot share memory it runs :meth:`Algorithms.fallback`'s choice.

Both rings and ``direct`` send exactly ``(W - 1) / W`` of the gathered bytes per
rank, the count the ledger records (see ``collectives.py``) and the cost model
assumes.

Reduce-scatter. gloo's own reduce-scatter all-reduces the whole input and keeps one chunk,
sending about ``2 (W - 1) / W`` of the input per rank where a bandwidth-optimal
one sends ``(W - 1) / W``, and its ``Work.wait`` ignores the timeout. The
algorithms here, over a group of ``W`` ranks and ``rows`` of shape
``(W, n)``:

- ``"native"``: the backend's ``reduce_scatter_tensor``; always on nccl.
- ``"all_reduce"``: all-reduce ``rows`` in place, then copy this rank's row
  (what gloo's reduce-scatter does, with a timeout that works).
- ``"all_to_all"``: ``all_to_all_single`` sends row ``j`` to group rank ``j``;
  ``wait`` sums the ``W`` rows received.
- ``"ring"``: ``W - 1`` steps; in each, send one row to the next rank, receive
  one from the previous and add it in. At ``W = 2`` this is the pairwise
  exchange: send the other rank's row, receive this rank's row from it, add.
- ``"ring_pipelined"``: the ring with each row in pieces, so that adding
  piece ``i`` overlaps the transfer of the pieces after it.
- ``"shm"``: ranks on one host add from each other's rows in shared memory
  (the plug-in of ``transport.py``, [Note: transports]); where the group's ranks
  cannot share memory it runs :meth:`Algorithms.fallback`'s choice.

``all_to_all`` and both rings send exactly ``(W - 1) / W`` of the input per
rank, the count the ledger records (see ``collectives.py``) and the cost model
assumes. ``all_reduce`` and gloo's ``native`` move twice that while the ledger
counts the bandwidth-optimal bytes, as for any backend's internals.

[Note: all-gather steps]
A ring's steps depend on each other (step ``s + 1`` forwards the row that
step ``s`` received), so only the first step, which sends ``flat``, is issued
when the gather starts; ``wait()`` drives the rest: it waits for each receive
and issues the next step's send and receive. At ``W = 2`` there is one step,
so the whole transfer runs in the background, as ``"direct"``'s does at any
``W``: it issues every send and receive when it starts, since none forwards what
another received. A step's send and receive are
issued together, never a receive ahead of its send: point-to-point messages
between two ranks pair up by order, so with other point-to-point operations in
flight on the group (another gather, a ring reduce-scatter) a receive issued
early would take the next rank's message for another operation. Every rank
issues the same operations in the same order, so they pair up as collectives
do; a failed or timed-out wait leaves the process out of step
(``collectives.Pending``).

[Note: reduce-scatter steps]
A ring's steps depend on each other (step ``s + 1`` sends the row that step
``s`` received and added to), so only the first step is issued when the
reduce-scatter starts; ``wait()`` drives the rest: it waits for each receive,
adds, and issues the next step's send and receive. At ``W = 2`` there is one
step, so the whole transfer runs in the background and ``wait()`` only adds.
Every rank issues the same point-to-point operations in the same order, so
they pair up by order as collectives do; a failed or timed-out wait leaves
the process out of step (``collectives.Pending``).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from funcshard._src.comm import runtime
from funcshard._src.comm.channel import all_gather_single, reduce_scatter_single
from funcshard._src.comm.runtime import Timeout, wait_work
from funcshard._src.plan.strategy import Capabilities, declare_transport

SHM_ENV = "FUNCSHARD_SHM"
SHM_PACKAGE = "funcshard._src.comm.shm"
# a reduce-scatter input at least this large is reduced a range of columns at a time
# (execute/param_group.py, [Note: reductions in chunks]); the shared-memory transport gives a
# region this large its pages back while it is free
LARGE_BYTES = 32 << 20
# collectives of fewer bytes keep gloo's own. 0: every collective of a group that shares
# memory goes through it; with descriptors on the board (shm/regions.py) a tiny one takes
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

    def drain(self) -> None:
        """Gives back memory held for collectives this rank has finished, once its peers have."""
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
    """What torch.distributed's collectives do for a group (``transport.py``).

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


def drain() -> None:
    """Gives back the shared-memory transport's memory for collectives this rank has finished.

    At once where the transport was never imported ([Note: draining regions] in
    ``shm/regions.py``).

    Raises:
        CollectiveError: a peer exited, or has not read within the collective timeout.
    """
    if _plugin.cache_info().currsize:
        plugin = _plugin()
        if plugin is not None:
            plugin.drain()


def check_known(algorithm: str, known: Sequence[str], what: str, /) -> None:
    """Refuses an ``algorithm`` that is not in ``known`` (``what``: "all-gather", ...).

    Example:
        >>> check_known("tree", ("auto", "ring"), "all-gather")
        Traceback (most recent call last):
        ...
        ValueError: all-gather algorithm 'tree' is unknown; use one of ['auto', 'ring']
    """
    if algorithm not in known:
        raise ValueError(f"{what} algorithm {algorithm!r} is unknown; use one of {list(known)}")


@dataclass(frozen=True)
class Algorithms:
    """One collective's algorithms on gloo: their names, the default's variable, and how one is chosen.

    Attributes:
        what: the collective, for messages (``"all-gather"``).
        ALGORITHMS: every algorithm name, ``"auto"``, ``"native"`` and ``"shm"`` among them.
        ALGORITHM_ENV: the environment variable that names the default.
        ring: the pairwise exchange, chosen for two ranks and at least ``RING_MIN_BYTES``.
        socket: the socket algorithm chosen otherwise.
        RING_MIN_BYTES: bytes of the whole collective from which ``ring`` (``spread``) is chosen.
        shm_fallback: what ``"shm"`` runs where the ranks cannot share memory (``None``:
            what ``"auto"`` would).
    """

    what: str
    ALGORITHMS: tuple[str, ...]
    ALGORITHM_ENV: str
    ring: str
    socket: str
    RING_MIN_BYTES: int
    shm_fallback: str | None = None
    # chosen for more than two ranks and at least RING_MIN_BYTES (None: socket)
    spread: str | None = None

    def resolve(self, algorithm: str, backend: str, world_size: int, nbytes: int, /) -> str:
        """The algorithm that runs for ``algorithm`` on ``backend`` over ``world_size`` ranks (never ``"auto"``).

        Anything but gloo runs ``"native"`` (the others are for gloo on CPU). On gloo,
        ``"auto"`` runs ``"shm"`` where the shared-memory transport is there
        (``shared_memory()``; whether the ranks share memory is found out when
        it starts), else :meth:`fallback`'s choice; a named algorithm runs as itself.

        Args:
            algorithm: one of :attr:`ALGORITHMS`.
            backend: the process group's backend, ``"gloo"`` or ``"nccl"``.
            world_size: ranks in the group.
            nbytes: bytes of the whole collective (the gathered output, the reduced input).

        Raises:
            ValueError: ``algorithm`` is not one of :attr:`ALGORITHMS`.

        Example:
            >>> ALL_GATHER.resolve("auto", "nccl", 8, 1 << 30)
            'native'
            >>> shared = shared_memory() is not None
            >>> ALL_GATHER.resolve("auto", "gloo", 2, 64 << 20) == ("shm" if shared else "ring_overlapped")
            True
            >>> REDUCE_SCATTER.resolve("auto", "gloo", 2, 64 << 20) == ("shm" if shared else "ring")
            True
        """
        check_known(algorithm, self.ALGORITHMS, self.what)
        if backend != "gloo":
            return "native"
        if algorithm != "auto":
            return algorithm
        if uses_shared_memory(nbytes):
            return "shm"
        return self.fallback("auto", world_size, nbytes)

    def fallback(self, algorithm: str, world_size: int, nbytes: int, /) -> str:
        """The socket algorithm that runs on gloo for ``algorithm`` where the ranks cannot share memory.

        ``"auto"`` (and ``"shm"`` without a ``shm_fallback`` of its own) runs ``ring``
        for two ranks and at least ``RING_MIN_BYTES`` (``spread``, where there is one,
        for more ranks), ``socket`` otherwise; any other algorithm runs as itself.

        Example:
            >>> ALL_GATHER.fallback("auto", 2, 64 << 20), ALL_GATHER.fallback("auto", 2, 1024)
            ('ring_overlapped', 'native')
            >>> ALL_GATHER.fallback("auto", 8, 64 << 20), REDUCE_SCATTER.fallback("auto", 8, 64 << 20)
            ('direct', 'all_reduce')
            >>> ALL_GATHER.fallback("shm", 2, 1024), REDUCE_SCATTER.fallback("shm", 2, 64 << 20)
            ('ring_overlapped', 'ring')
            >>> REDUCE_SCATTER.fallback("auto", 2, 1024), REDUCE_SCATTER.fallback("all_to_all", 4, 8)
            ('all_reduce', 'all_to_all')
        """
        if algorithm == "shm" and self.shm_fallback is not None:
            return self.shm_fallback
        if algorithm not in ("auto", "shm"):
            return algorithm
        if nbytes < self.RING_MIN_BYTES:
            return self.socket
        if world_size == 2:
            return self.ring
        return self.socket if self.spread is None else self.spread

    def default_algorithm(self) -> str:
        """The algorithm when none is given: :attr:`ALGORITHM_ENV`, else ``"auto"``.

        Read as the running step holds it ([Note: settings held through a step] in
        ``comm/runtime.py``).

        Raises:
            ValueError: the environment variable names no algorithm.

        Example:
            >>> ALL_GATHER.default_algorithm(), REDUCE_SCATTER.default_algorithm()
            ('auto', 'auto')
        """
        value = runtime.setting(self.ALGORITHM_ENV, "auto")
        if value not in self.ALGORITHMS:
            article = "an" if self.what[0] in "aeiou" else "a"
            raise ValueError(
                f"{self.ALGORITHM_ENV}={value!r} is not {article} {self.what} algorithm; "
                f"use one of {list(self.ALGORITHMS)}"
            )
        return value


class _AllGatherAlgorithms(Algorithms):
    """The all-gather's algorithms (:data:`ALL_GATHER`): see the module's docstring."""

    def leaf_algorithm(self) -> str:
        """The algorithm for one leaf gathered into its own storage: ``FUNCSHARD_ALL_GATHER``, else shared memory or the overlapped ring.

        Both write the leaf in place. A group whose ranks cannot share memory runs
        the overlapped ring for ``"shm"`` too (:meth:`start`).

        Example:
            >>> ALL_GATHER.leaf_algorithm() == ("shm" if shared_memory() else "ring_overlapped")
            True
        """
        chosen = self.default_algorithm()
        if chosen != "auto":
            return chosen
        return "shm" if shared_memory() is not None else "ring_overlapped"

    def start(
        self,
        algorithm: str,
        flat: torch.Tensor,
        rows: torch.Tensor,
        group: dist.ProcessGroup,
        /,
        *,
        fallback_to: str = "ring_overlapped",
        stable: bool = False,
    ) -> Any:
        """Starts gathering every group rank's ``flat`` ``(n,)`` into ``rows`` ``(W, n)``; writes ``rows``.

        Returns a handle whose ``wait(timeout=...)`` finishes it (``rows[j]`` then
        holds group rank ``j``'s ``flat``), as a ``torch.distributed`` ``Work`` does.

        ``"shm"`` is collective the first time it runs on ``group`` (the probe);
        where the group's ranks cannot share memory it runs ``fallback_to``
        (:meth:`fallback`), the same on every rank. ``stable``: see
        ``collectives.all_gather``.

        Raises:
            ValueError: ``algorithm`` is not resolved, or a ring's (or ``"direct"``'s)
                ``rows`` overlaps ``flat`` other than as exactly this rank's row (a
                receive would overwrite ``flat`` before it is sent).
        """
        if algorithm == "shm":
            plugin = shared_memory()
            work = (
                None
                if plugin is None
                else plugin.all_gather(group, flat.view(-1), [(0, rows)], stable=stable)
            )
            if work is not None:
                return work
            algorithm = fallback_to
        if algorithm == "native":
            return all_gather_single(rows.view(-1), flat, group=group, async_op=True)
        if algorithm in ("ring", "ring_overlapped"):
            me = dist.get_group_rank(group, dist.get_rank())
            return _GatherRing(
                flat.view(-1), rows, group, me, overlap=algorithm == "ring_overlapped"
            )
        if algorithm == "direct":
            me = dist.get_group_rank(group, dist.get_rank())
            return _GatherDirect(flat.view(-1), rows, group, me)
        raise ValueError(f"all-gather algorithm {algorithm!r} cannot start; resolve() it first")


class _ReduceScatterAlgorithms(Algorithms):
    """The reduce-scatter's algorithms (:data:`REDUCE_SCATTER`): see the module's docstring."""

    def start(
        self,
        algorithm: str,
        rows: torch.Tensor,
        out: torch.Tensor,
        group: dist.ProcessGroup,
        /,
        *,
        pieces: int | None = None,
        fallback_to: str = "all_reduce",
        own: OwnTerm | None = None,
    ) -> Any:
        """Starts a reduce-scatter of ``rows`` ``(W, n)`` into ``out`` ``(n,)``; may overwrite ``rows``.

        ``out`` must not overlap ``rows``.
        Returns a handle whose ``wait(timeout=...)`` finishes it (``out`` then holds
        the sum of every rank's row at this rank's group rank), as a
        ``torch.distributed`` ``Work`` does. ``pieces`` overrides how many pieces
        ``"ring_pipelined"`` cuts a row into. ``"shm"`` is collective the first time
        it runs on ``group`` (the probe); where the group's ranks cannot share
        memory it runs ``fallback_to`` (:meth:`fallback`), the same on every rank.
        ``own`` makes this rank's own row when summed: shared memory only, with
        ``rows`` from ``collectives.input_rows``.

        Raises:
            ValueError: ``own`` is given and the collective does not go through shared memory.
        """
        me = dist.get_group_rank(group, dist.get_rank())
        if algorithm == "shm":
            plugin = shared_memory()
            work = None if plugin is None else plugin.reduce_scatter(group, rows, out, own=own)
            if work is not None:
                return work
            algorithm = fallback_to
        if own is not None:
            raise ValueError(
                f"a reduce-scatter with its own row apart runs through shared memory, not {algorithm!r}"
            )
        if algorithm == "native":
            return _Native(reduce_scatter_single(out, rows.view(-1), group=group, async_op=True))
        if algorithm == "all_reduce":
            work = dist.all_reduce(rows.view(-1), group=group, async_op=True)
            return _Then(work, lambda: out.copy_(rows[me]))
        if algorithm == "all_to_all":
            received = torch.empty_like(rows)  # (W, n): row j from group rank j
            work = dist.all_to_all_single(received, rows, group=group, async_op=True)
            return _Then(work, lambda: torch.sum(received, dim=0, out=out))
        if algorithm == "ring":
            return _ReduceRing(rows, out, group, me, pieces=1)
        if algorithm == "ring_pipelined":
            n = rows.shape[1]
            k = pieces or max(1, min(n, n * rows.element_size() // PIECE_BYTES))
            return _ReduceRing(rows, out, group, me, pieces=k)
        raise ValueError(f"reduce-scatter algorithm {algorithm!r} cannot start; resolve() it first")


# "auto" on gloo (python -m bench.all_gather on a loaded 2-core machine, 6-9 runs of the median of 9-11
# rounds): at W = 2 ring_overlapped took 0.68-0.82x gloo's native time from 8 MiB per rank (a
# 16 MiB output) in every run (0.25-0.29x at 48 MiB), but 0.68-1.16x at 4 MiB, up to 1.25x at
# 2 MiB and 1.4-1.9x at 256 KiB (latency); the plain ring took 0.70-1.01x at 8 MiB. At W = 4
# (4 ranks on 2 cores, three runs of 5 rounds) both rings took 0.64-0.79x at 4 MiB and
# 0.29-0.48x at 12 MiB, too few runs on an oversubscribed machine to rely on. Over more than two
# ranks auto runs direct from RING_MIN_BYTES (stop 53, W = 4, 7 rounds: 1.26-2.37x less time than
# native from 1 to 12 MiB a rank, and none of native's staging of the whole output, which
# was the held-out GPT's extra peak over sockets at W = 8: bench/results/memory_shapes/).
ALL_GATHER = _AllGatherAlgorithms(
    "all-gather",
    ("auto", "native", "ring", "ring_overlapped", "direct", "shm"),
    "FUNCSHARD_ALL_GATHER",
    ring="ring_overlapped",
    socket="native",
    RING_MIN_BYTES=16 << 20,  # of the whole output
    shm_fallback="ring_overlapped",  # writes its output in place, as "shm" does
    spread="direct",
)
# "auto" on gloo (python -m bench.reduce_scatter on a loaded 2-core machine, median of 9 rounds): at
# W = 2 the ring took 0.4-0.7x the time of all_reduce from 4 MiB to 64 MiB in every run, 1.0x
# at 1 MiB and 2-5x as long at 64 KiB and below (one more round trip). At W = 4 (4 ranks on 2
# cores) runs disagreed (0.6-1.1x), so auto keeps all_reduce there.
REDUCE_SCATTER = _ReduceScatterAlgorithms(
    "reduce-scatter",
    ("auto", "native", "all_reduce", "all_to_all", "ring", "ring_pipelined", "shm"),
    "FUNCSHARD_REDUCE_SCATTER",
    ring="ring",
    socket="all_reduce",
    RING_MIN_BYTES=4 << 20,
)
PIECE_BYTES = 1 << 20  # ring_pipelined: the size of one piece of a row

# gathering one leaf straight into its own storage (execute/unit_state.py, [Note: persistent
# gathered storage]): gloo's native all-gather would stage the leaf through buffers of its own
# and copy it out, which is the copy gathering in place saves; the ring writes into the leaf.
# bench/all_gather.py-style timing on this 2-core machine (the 9 leaves of a width-512 block,
# W = 2, fresh storage): 20.7 ms per block one ring per leaf, 25.0 ms native per leaf, 26.6 ms
# one native all-gather of the whole unit plus its unpacking copy.


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range ``t`` covers (contiguous ``t``)."""
    lo = t.data_ptr()
    return lo, lo + t.numel() * t.element_size()


def _own_row(flat: torch.Tensor, rows: torch.Tensor, me: int, /) -> bool:
    """Whether ``flat`` is this rank's row of ``rows`` (else it must not overlap them)."""
    own = rows[me]
    if flat.data_ptr() == own.data_ptr() and flat.numel() == own.numel():
        return True
    (f_lo, f_hi), (r_lo, r_hi) = _span(flat), _span(rows)
    if f_lo < r_hi and r_lo < f_hi:
        raise ValueError(
            "a point-to-point all-gather's output overlaps its input other than as this "
            "rank's row; pass an out= buffer of its own"
        )
    return False


class _GatherDirect:
    """A direct all-gather: every send and receive issued at once; see [Note: all-gather steps].

    Group rank ``r`` sends ``flat`` to rank ``r + k`` and receives rank ``r - k``'s
    row into that row of ``rows``, for ``k = 1 .. W - 1``; the copy of its own row
    is made while they run.
    """

    def __init__(
        self, flat: torch.Tensor, rows: torch.Tensor, group: dist.ProcessGroup, me: int
    ) -> None:
        w = rows.shape[0]
        in_place = _own_row(flat, rows, me)
        self.works: list[Any] = []
        for k in range(1, w):
            src = (me - k) % w
            self.works.append(dist.isend(flat, group=group, group_dst=(me + k) % w))
            self.works.append(dist.irecv(rows[src], group=group, group_src=src))
        if not in_place:
            rows[me].copy_(flat)

    def wait(self, timeout: Timeout = None) -> bool:
        for work in self.works:
            wait_work(work, timeout)
        self.works = []
        return True


class _GatherRing:
    """A ring all-gather; see [Note: all-gather steps].

    At step ``s`` group rank ``r`` sends row ``(r - s) % W`` (its own, ``flat``,
    at ``s = 0``) to rank ``r + 1`` and receives row ``(r - s - 1) % W`` from
    rank ``r - 1`` into that row of ``rows``.
    """

    def __init__(
        self,
        flat: torch.Tensor,
        rows: torch.Tensor,
        group: dist.ProcessGroup,
        me: int,
        *,
        overlap: bool,
    ) -> None:
        w = rows.shape[0]
        self.rows, self.group, self.me, self.w = rows, group, me, w
        self.next, self.prev = (me + 1) % w, (me - 1) % w
        own = rows[me]
        in_place = _own_row(flat, rows, me)
        if not (overlap or in_place):
            own.copy_(flat)
        self.sends: list[Any] = []
        self.recv = self._step(0, flat)
        if overlap and not in_place:
            own.copy_(flat)  # while the first step runs

    def _step(self, s: int, send: torch.Tensor) -> Any:
        """Issues step ``s``: sends ``send``, receives row ``(me - s - 1) % W``; returns the receive."""
        self.sends.append(dist.isend(send, group=self.group, group_dst=self.next))
        into = self.rows[(self.me - s - 1) % self.w]
        return dist.irecv(into, group=self.group, group_src=self.prev)

    def wait(self, timeout: Timeout = None) -> bool:
        for s in range(self.w - 1):
            wait_work(self.recv, timeout)
            if s < self.w - 2:  # forward what just arrived
                self.recv = self._step(s + 1, self.rows[(self.me - s - 1) % self.w])
        for work in self.sends:
            wait_work(work, timeout)
        self.sends = []
        return True


class _Native:
    """The backend's own reduce-scatter; a separate class only to hold the work."""

    def __init__(self, work: Any) -> None:
        self.work = work

    def wait(self, timeout: Timeout = None) -> bool:
        wait_work(self.work, timeout)
        return True


class _Then:
    """One collective, then a local step once it is done (copy a row out, sum the rows)."""

    def __init__(self, work: Any, then: Any) -> None:
        self.work, self.then = work, then

    def wait(self, timeout: Timeout = None) -> bool:
        wait_work(self.work, timeout)
        self.then()
        return True


class _ReduceRing:
    """A ring reduce-scatter in ``pieces`` pieces per row; see [Note: reduce-scatter steps].

    At step ``s`` group rank ``r`` sends row ``(r - s - 1) % W`` to rank ``r + 1``
    and adds the same piece of row ``(r - s - 2) % W`` received from rank
    ``r - 1``; after ``W - 1`` steps row ``r`` holds every rank's sum. Every
    step receives into ``out`` (no other buffer); the last adds this rank's own row there.
    """

    def __init__(
        self,
        rows: torch.Tensor,
        out: torch.Tensor,
        group: dist.ProcessGroup,
        me: int,
        *,
        pieces: int,
    ) -> None:
        w = rows.shape[0]
        self.rows, self.out, self.group, self.me, self.w = rows, out, group, me, w
        self.next, self.prev = (me + 1) % w, (me - 1) % w
        n = rows.shape[1]
        pieces = max(1, min(pieces, n))
        self.bounds = [(i * n // pieces, (i + 1) * n // pieces) for i in range(pieces)]
        self.sends: list[Any] = []
        self.recvs: list[Any] = [self._step(0, i) for i in range(pieces)]

    def _step(self, s: int, i: int) -> Any:
        """Issues piece ``i`` of step ``s``: its send and its receive; returns the receive."""
        lo, hi = self.bounds[i]
        send_row = (self.me - s - 1) % self.w
        # every step receives into out: no buffer of its own (the last step's sum stays there)
        into = self.out[lo:hi]
        self.sends.append(
            dist.isend(self.rows[send_row, lo:hi], group=self.group, group_dst=self.next)
        )
        return dist.irecv(into, group=self.group, group_src=self.prev)

    def wait(self, timeout: Timeout = None) -> bool:
        for s in range(self.w - 1):
            add_row = (self.me - s - 2) % self.w
            last = s == self.w - 2
            for i, (lo, hi) in enumerate(self.bounds):
                wait_work(self.recvs[i], timeout)
                if last:  # add_row is this rank's row: the sum goes to out
                    self.out[lo:hi].add_(self.rows[add_row, lo:hi])
                else:
                    self.rows[add_row, lo:hi].add_(self.out[lo:hi])
                    self.recvs[i] = self._step(s + 1, i)
        for work in self.sends:
            wait_work(work, timeout)
        self.sends = []
        return True


class Each:
    """Several collectives waited for as one, in the order they started."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self, timeout: Timeout = None) -> bool:
        for work in self.works:
            wait_work(work, timeout)
        return True


class _Torch:
    """torch.distributed's collectives: gloo (its own or the rings) and NCCL; see [Note: transports] in ``comm/transport.py``.

    The algorithm for gloo is chosen by :data:`ALL_GATHER` and :data:`REDUCE_SCATTER`;
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
            chosen = (
                ALL_GATHER.fallback(ALL_GATHER.default_algorithm(), size, nbytes)
                if gloo
                else "native"
            )
            each.append(ALL_GATHER.start(chosen, flat[lo : lo + rows.shape[1]], rows, group))
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
        chosen = (
            REDUCE_SCATTER.fallback(REDUCE_SCATTER.default_algorithm(), size, nbytes)
            if gloo
            else "native"
        )
        return REDUCE_SCATTER.start(chosen, rows, out, group)

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

    def drain(self) -> None:
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
