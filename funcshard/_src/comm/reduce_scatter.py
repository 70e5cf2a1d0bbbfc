"""Reduce-scatter algorithms: which one runs on a backend, and the point-to-point ones for gloo.

gloo's own reduce-scatter all-reduces the whole input and keeps one chunk,
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
  cannot share memory it runs :func:`fallback`'s choice.

``all_to_all`` and both rings send exactly ``(W - 1) / W`` of the input per
rank, the count the ledger records (see ``ledger.py``) and the cost model
assumes. ``all_reduce`` and gloo's ``native`` move twice that while the ledger
counts the bandwidth-optimal bytes, as for any backend's internals.

[Note: reduce-scatter steps]
A ring's steps depend on each other (step ``s + 1`` sends the row that step
``s`` received and added to), so only the first step is issued when the
reduce-scatter starts; ``wait()`` drives the rest: it waits for each receive,
adds, and issues the next step's send and receive. At ``W = 2`` there is one
step, so the whole transfer runs in the background and ``wait()`` only adds.
Every rank issues the same point-to-point operations in the same order, so
they pair up by order as collectives do; a failed or timed-out wait leaves
the process out of step (``pending.Pending``).
"""

from __future__ import annotations

from typing import Any, Literal, cast

import torch
import torch.distributed as dist

from funcshard._src.comm import algorithm as _algorithm
from funcshard._src.comm import transport
from funcshard._src.comm.algorithm import Timeout, from_env, wait_work
from funcshard._src.comm.channel import reduce_scatter_single

Algorithm = Literal["auto", "native", "all_reduce", "all_to_all", "ring", "ring_pipelined", "shm"]
ALGORITHMS: tuple[Algorithm, ...] = (
    "auto",
    "native",
    "all_reduce",
    "all_to_all",
    "ring",
    "ring_pipelined",
    "shm",
)
ALGORITHM_ENV = "FUNCSHARD_REDUCE_SCATTER"
# "auto" on gloo (bench/reduce_scatter.py on a loaded 2-core machine, median of 9 rounds): at
# W = 2 the ring took 0.4-0.7x the time of all_reduce from 4 MiB to 64 MiB in every run, 1.0x
# at 1 MiB and 2-5x as long at 64 KiB and below (one more round trip). At W = 4 (4 ranks on 2
# cores) runs disagreed (0.6-1.1x), so auto keeps all_reduce there.
RING_MIN_BYTES = 4 << 20
CHOICES = _algorithm.Choices(
    "reduce-scatter", ALGORITHMS, ring="ring", socket="all_reduce", ring_min_bytes=RING_MIN_BYTES
)
PIECE_BYTES = 1 << 20  # ring_pipelined: the size of one piece of a row


def resolve(algorithm: Algorithm, backend: str, world_size: int, nbytes: int, /) -> Algorithm:
    """The algorithm that runs for ``algorithm`` on ``backend`` over ``world_size`` ranks.

    ``"auto"`` keeps the backend's own collective, except on gloo: there it runs
    ``"shm"`` where the transport is there (``transport.shared_memory()``; the ranks'
    sharing memory is found out when it starts), else the ring (the pairwise
    exchange) for two ranks and inputs of at least :data:`RING_MIN_BYTES`, where
    it measured faster, and ``"all_reduce"`` otherwise. Anything but gloo always
    runs ``"native"`` (the others are for gloo on CPU).

    Args:
        algorithm: one of :data:`ALGORITHMS`.
        backend: the process group's backend, ``"gloo"`` or ``"nccl"``.
        world_size: ranks in the group.
        nbytes: bytes of the whole input ``rows``.

    Returns:
        The algorithm to run (never ``"auto"``).

    Raises:
        ValueError: ``algorithm`` is not one of :data:`ALGORITHMS`.

    Example:
        >>> resolve("auto", "nccl", 8, 1 << 30)
        'native'
        >>> resolve("auto", "gloo", 2, 64 << 20) == ("shm" if transport.shared_memory() else "ring")
        True
    """
    shared = transport.uses_shared_memory(nbytes)
    chosen = _algorithm.resolve(CHOICES, algorithm, backend, world_size, nbytes, shared)
    return cast("Algorithm", chosen)


def fallback(algorithm: Algorithm, world_size: int, nbytes: int, /) -> Algorithm:
    """The socket algorithm that runs on gloo for ``algorithm`` where the ranks cannot share memory.

    ``"auto"`` and ``"shm"`` run the ring for two ranks and inputs of at least
    :data:`RING_MIN_BYTES`, ``"all_reduce"`` otherwise; any other algorithm runs
    as itself.

    Example:
        >>> fallback("shm", 2, 64 << 20), fallback("auto", 2, 1024), fallback("all_to_all", 4, 8)
        ('ring', 'all_reduce', 'all_to_all')
    """
    return cast("Algorithm", _algorithm.fallback(CHOICES, algorithm, world_size, nbytes))


def default_algorithm() -> Algorithm:
    """The reduce-scatter algorithm when none is given: ``FUNCSHARD_REDUCE_SCATTER``, else ``"auto"``.

    Raises:
        ValueError: the environment variable names no algorithm.

    Example:
        >>> default_algorithm()
        'auto'
    """
    return cast("Algorithm", from_env(ALGORITHM_ENV, ALGORITHMS, "reduce-scatter"))


def start(
    algorithm: Algorithm,
    rows: torch.Tensor,
    out: torch.Tensor,
    group: dist.ProcessGroup,
    /,
    *,
    pieces: int | None = None,
    fallback_to: Algorithm = "all_reduce",
    own: transport.OwnTerm | None = None,
) -> Any:
    """Starts a reduce-scatter of ``rows`` ``(W, n)`` into ``out`` ``(n,)``; may overwrite ``rows``.

    ``out`` must not overlap ``rows``.
    Returns a handle whose ``wait(timeout=...)`` finishes it (``out`` then holds
    the sum of every rank's row at this rank's group rank), as a
    ``torch.distributed`` ``Work`` does. ``pieces`` overrides how many pieces
    ``"ring_pipelined"`` cuts a row into. ``"shm"`` is collective the first time
    it runs on ``group`` (the probe); where the group's ranks cannot share
    memory it runs ``fallback_to`` (:func:`fallback`), the same on every rank.
    ``own`` makes this rank's own row when summed: shared memory only, with
    ``rows`` from ``collectives.input_rows``.

    Raises:
        ValueError: ``own`` is given and the collective does not go through shared memory.
    """
    me = dist.get_group_rank(group, dist.get_rank())
    if algorithm == "shm":
        plugin = transport.shared_memory()
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
        return _Ring(rows, out, group, me, pieces=1)
    if algorithm == "ring_pipelined":
        n = rows.shape[1]
        k = pieces or max(1, min(n, n * rows.element_size() // PIECE_BYTES))
        return _Ring(rows, out, group, me, pieces=k)
    raise ValueError(f"reduce-scatter algorithm {algorithm!r} cannot start; resolve() it first")


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


class _Ring:
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
