"""All-gather algorithms: which one runs on a backend, and the point-to-point ones for gloo.

gloo's own ``all_gather_into_tensor`` stages the input and the output through
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
- ``"shm"``: ranks on one host read each other's shards from shared memory
  (the plug-in of ``transport.py``, [Note: transports]); where the group's ranks
  cannot share memory it runs :func:`fallback`'s choice.

Both rings send exactly ``(W - 1) / W`` of the gathered bytes per rank, the
count the ledger records (see ``ledger.py``) and the cost model assumes.

[Note: all-gather steps]
A ring's steps depend on each other (step ``s + 1`` forwards the row that
step ``s`` received), so only the first step, which sends ``flat``, is issued
when the gather starts; ``wait()`` drives the rest: it waits for each receive
and issues the next step's send and receive. At ``W = 2`` there is one step,
so the whole transfer runs in the background. A step's send and receive are
issued together, never a receive ahead of its send: point-to-point messages
between two ranks pair up by order, so with other point-to-point operations in
flight on the group (another gather, a ring reduce-scatter) a receive issued
early would take the next rank's message for another operation. Every rank
issues the same operations in the same order, so they pair up as collectives
do; a failed or timed-out wait leaves the process out of step
(``pending.Pending``).
"""

from __future__ import annotations

from typing import Any, Literal, cast

import torch
import torch.distributed as dist

from funcshard._src.comm import algorithm as _algorithm
from funcshard._src.comm import transport
from funcshard._src.comm.algorithm import Timeout, from_env, wait_work
from funcshard._src.comm.channel import all_gather_single

Algorithm = Literal["auto", "native", "ring", "ring_overlapped", "shm"]
ALGORITHMS: tuple[Algorithm, ...] = ("auto", "native", "ring", "ring_overlapped", "shm")
ALGORITHM_ENV = "FUNCSHARD_ALL_GATHER"
# "auto" on gloo (bench/all_gather.py on a loaded 2-core machine, 6-9 runs of the median of 9-11
# rounds): at W = 2 ring_overlapped took 0.68-0.82x gloo's native time from 8 MiB per rank (a
# 16 MiB output) in every run (0.25-0.29x at 48 MiB), but 0.68-1.16x at 4 MiB, up to 1.25x at
# 2 MiB and 1.4-1.9x at 256 KiB (latency); the plain ring took 0.70-1.01x at 8 MiB. At W = 4
# (4 ranks on 2 cores, three runs of 5 rounds) both rings took 0.64-0.79x at 4 MiB and
# 0.29-0.48x at 12 MiB, too few runs on an oversubscribed machine to rely on: auto keeps native.
RING_MIN_BYTES = 16 << 20  # of the whole output
CHOICES = _algorithm.Choices(
    "all-gather",
    ALGORITHMS,
    ring="ring_overlapped",
    socket="native",
    ring_min_bytes=RING_MIN_BYTES,
    shm_fallback="ring_overlapped",  # writes its output in place, as "shm" does
)


def resolve(algorithm: Algorithm, backend: str, world_size: int, nbytes: int, /) -> Algorithm:
    """The algorithm that runs for ``algorithm`` on ``backend`` over ``world_size`` ranks.

    ``"auto"`` keeps the backend's own collective, except on gloo: there it runs
    ``"shm"`` where the transport is there (``transport.shared_memory()``; the ranks'
    sharing memory is found out when it starts), else ``"ring_overlapped"`` (the
    pairwise exchange) for two ranks and outputs of at least
    :data:`RING_MIN_BYTES`, where it measured faster, and ``"native"`` otherwise.
    Anything but gloo always runs ``"native"`` (the others are for gloo on CPU).

    Args:
        algorithm: one of :data:`ALGORITHMS`.
        backend: the process group's backend, ``"gloo"`` or ``"nccl"``.
        world_size: ranks in the group.
        nbytes: bytes of the whole gathered output ``rows``.

    Returns:
        The algorithm to run (never ``"auto"``).

    Raises:
        ValueError: ``algorithm`` is not one of :data:`ALGORITHMS`.

    Example:
        >>> resolve("auto", "nccl", 8, 1 << 30)
        'native'
        >>> shared = transport.shared_memory() is not None
        >>> resolve("auto", "gloo", 2, 64 << 20) == ("shm" if shared else "ring_overlapped")
        True
    """
    shared = transport.uses_shared_memory(nbytes)
    chosen = _algorithm.resolve(CHOICES, algorithm, backend, world_size, nbytes, shared)
    return cast("Algorithm", chosen)


def fallback(algorithm: Algorithm, world_size: int, nbytes: int, /) -> Algorithm:
    """The socket algorithm that runs on gloo for ``algorithm`` where the ranks cannot share memory.

    ``"auto"`` runs ``"ring_overlapped"`` for two ranks and outputs of at least
    :data:`RING_MIN_BYTES`, ``"native"`` otherwise; ``"shm"`` runs
    ``"ring_overlapped"``, which writes its output in place as ``"shm"`` does;
    any other algorithm runs as itself.

    Example:
        >>> fallback("auto", 2, 64 << 20), fallback("auto", 2, 1024), fallback("shm", 2, 1024)
        ('ring_overlapped', 'native', 'ring_overlapped')
    """
    return cast("Algorithm", _algorithm.fallback(CHOICES, algorithm, world_size, nbytes))


def default_algorithm() -> Algorithm:
    """The all-gather algorithm when none is given: ``FUNCSHARD_ALL_GATHER``, else ``"auto"``.

    Raises:
        ValueError: the environment variable names no algorithm.

    Example:
        >>> default_algorithm()
        'auto'
    """
    return cast("Algorithm", from_env(ALGORITHM_ENV, ALGORITHMS, "all-gather"))


# gathering one leaf straight into its own storage (execute/unit_state.py, [Note: persistent
# gathered storage]): gloo's native all-gather would stage the leaf through buffers of its own
# and copy it out, which is the copy gathering in place saves; the ring writes into the leaf.
# bench/all_gather.py-style timing on this 2-core machine (the 9 leaves of a width-512 block,
# W = 2, fresh storage): 20.7 ms per block one ring per leaf, 25.0 ms native per leaf, 26.6 ms
# one native all-gather of the whole unit plus its unpacking copy.


def leaf_algorithm() -> Algorithm:
    """The algorithm for one leaf gathered into its own storage: ``FUNCSHARD_ALL_GATHER``, else shared memory or the overlapped ring.

    Both write the leaf in place. A group whose ranks cannot share memory runs
    the overlapped ring for ``"shm"`` too (:func:`start`).

    Example:
        >>> leaf_algorithm() == ("shm" if transport.shared_memory() else "ring_overlapped")
        True
    """
    chosen = default_algorithm()
    if chosen != "auto":
        return chosen
    return "shm" if transport.shared_memory() is not None else "ring_overlapped"


def start(
    algorithm: Algorithm,
    flat: torch.Tensor,
    rows: torch.Tensor,
    group: dist.ProcessGroup,
    /,
    *,
    fallback_to: Algorithm = "ring_overlapped",
    stable: bool = False,
) -> Any:
    """Starts gathering every group rank's ``flat`` ``(n,)`` into ``rows`` ``(W, n)``; writes ``rows``.

    Returns a handle whose ``wait(timeout=...)`` finishes it (``rows[j]`` then
    holds group rank ``j``'s ``flat``), as a ``torch.distributed`` ``Work`` does.

    ``"shm"`` is collective the first time it runs on ``group`` (the probe);
    where the group's ranks cannot share memory it runs ``fallback_to``
    (:func:`fallback`), the same on every rank. ``stable``: see
    ``collectives.all_gather``.

    Raises:
        ValueError: ``algorithm`` is not resolved, or a ring's ``rows`` overlaps
            ``flat`` other than as exactly this rank's row (a receive would
            overwrite ``flat`` before it is sent).
    """
    if algorithm == "shm":
        plugin = transport.shared_memory()
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
        return _Ring(flat.view(-1), rows, group, me, overlap=algorithm == "ring_overlapped")
    raise ValueError(f"all-gather algorithm {algorithm!r} cannot start; resolve() it first")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range ``t`` covers (contiguous ``t``)."""
    lo = t.data_ptr()
    return lo, lo + t.numel() * t.element_size()


class _Ring:
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
        in_place = flat.data_ptr() == own.data_ptr() and flat.numel() == own.numel()
        (f_lo, f_hi), (r_lo, r_hi) = _span(flat), _span(rows)
        if not in_place and f_lo < r_hi and r_lo < f_hi:
            raise ValueError(
                "a ring all-gather's output overlaps its input other than as this rank's row; "
                "pass an out= buffer of its own"
            )
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
