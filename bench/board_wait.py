"""Round trip of two ranks through the shared-memory board: how a wait polls ([Note: waiting for a peer] in ``comm/shm/regions.py``).

Two processes post a descriptor and collect the other's, ``--rounds`` times, as
every shared-memory collective does, with the board's wait as it is (``yield``)
or as it was (``spin``: 200 us of polling without yielding, then sleeps).
``--busy N`` starts N processes that only spin, so that the host has more
runnable threads than cores, as when two 2-rank jobs share two cores.

    python -m bench.board_wait --rounds 20000 --busy 2
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from funcshard._src.comm.shm import regions
from funcshard._src.comm.shm.regions import PAGE_BYTES, Board


def _spin_then_sleep(
    self: Board,
    ready: Callable[[], bool],
    late: Callable[[], list[int]],
    timeout_s: float,
    what: str,
) -> None:
    """The wait before [Note: waiting for a peer] in ``comm/shm/regions.py``: 200 us of polls without yielding, then 20 us sleeps."""
    start = time.monotonic()
    while not ready():
        waited = time.monotonic() - start
        if waited < 200e-6:
            continue
        if waited > timeout_s:
            raise RuntimeError(f"timed out {what}")
        time.sleep(20e-6)


def _rank(me: int, pages: list[mmap.mmap], rounds: int, policy: str, out: mp.Queue) -> None:
    if policy == "spin":
        Board.wait_until = _spin_then_sleep  # type: ignore[method-assign]
    b = Board(pages, me, [os.getppid(), os.getppid()])
    mine = [0] * regions.WORDS
    times = []
    for seq in range(rounds):
        t0 = time.perf_counter()
        b.post(seq, mine, 60.0)
        b.collect(seq, mine, 60.0)
        b.set_mark(seq + 1)
        times.append(time.perf_counter() - t0)
    out.put((me, statistics.median(times), sum(times)))


def _busy(stop: Any) -> None:  # a multiprocessing Event
    while not stop.is_set():
        pass


def run(rounds: int, policy: str, busy: int) -> tuple[float, float]:
    """The median round trip and the total time over ``rounds``, in seconds."""
    pages = []
    for _ in range(2):
        fd = os.memfd_create("board-bench")
        os.ftruncate(fd, PAGE_BYTES)
        pages.append(mmap.mmap(fd, PAGE_BYTES))
        os.close(fd)
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    spinners = [ctx.Process(target=_busy, args=(stop,)) for _ in range(busy)]
    for p in spinners:
        p.start()
    out: mp.Queue = ctx.Queue()
    ranks = [ctx.Process(target=_rank, args=(r, pages, rounds, policy, out)) for r in range(2)]
    for p in ranks:
        p.start()
    got = [out.get() for _ in ranks]
    for p in ranks:
        p.join()
    stop.set()
    for p in spinners:
        p.join()
    return max(g[1] for g in got), max(g[2] for g in got)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20000)
    parser.add_argument("--busy", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for policy in ("spin", "yield") * args.repeats:
        median, total = run(args.rounds, policy, args.busy)
        print(
            f"{policy:5s} busy={args.busy} rounds={args.rounds}: median round trip "
            f"{median * 1e6:7.1f} us, total {total:6.2f} s"
        )


if __name__ == "__main__":
    main()
