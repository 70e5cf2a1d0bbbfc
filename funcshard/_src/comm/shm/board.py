"""Each rank's probe page, shared by its group: its read mark, and its collectives' descriptors.

[Note: descriptors on the board]
A shared-memory collective (``shm/__init__.py``) starts by telling its peers where its
data is: a 64-byte descriptor. Sent as a gloo all-gather, each cost a loopback
round trip and a wake-up of gloo's threads, about 0.25 ms a collective on the
benchmark machine: a few percent of a step of small units, where DDP meets its
peers once per bucket. Where the ranks' probe pages are shared live (x86, whose
loads and stores keep program order: "Memory ordering" in [Note: shared-memory
collectives], ``shm/__init__.py``), each
rank instead writes its descriptor into a slot of its own page and its peers
read it there:

- the page holds a header (word 1: the rank's read mark) and a ring of slots,
  one per collective, ``seq % SLOTS``; the writer fills the slot and writes its
  flag word (``seq + 1``) last, so a reader that sees the flag sees the rest;
- a writer reuses a slot only once every peer's read mark has passed the
  collective that last used it (its descriptor was read then), which a rank
  ``SLOTS`` collectives ahead of a peer waits for;
- a reader waits for its peers' flags as it would for a gloo collective: past
  the collective timeout it fails with the same "timed out" error, and a peer
  whose process has exited fails it at once.

The descriptor's words are the same as on gloo, and checked the same way: a
peer at another collective of the same sequence number is an error before any
data is read; a peer at another sequence number never writes the slot waited
for, and the wait times out.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable, Sequence

from funcshard._src.comm.runtime import CollectiveError

PAGE_BYTES = 16384  # a probe page: header and slots
WORDS = 8  # a descriptor: (WORDS,) int64
HEADER = 8  # words before the first slot; word 0 the probe's nonce, word 1 the read mark
SLOTS = (PAGE_BYTES // 8 - HEADER) // WORDS
# [Note: waiting for a peer]
# A wait polls its peers' words. It first yields the CPU between polls (sched_yield) for
# _YIELD_S, then sleeps _POLL_S between polls. It never spins without yielding: on a host
# with more runnable threads than cores (two ranks of each of two jobs on two cores), the
# peer a rank waits for may be waiting for this rank's core, and a spin takes the time
# from it; a yield hands the core over at once, and costs about a microsecond where
# nothing else wants it. bench/board_wait.py measures the round trip both ways: two ranks
# on a host whose cores were all busy (load about 20) took 0.20-0.49 s for 5,000 round
# trips yielding against 1.99-2.12 s spinning first; with two more processes that only
# spin (never wait), yielding took 4.4-5.3 s for 3,000 against 1.5-2.1 s, as the yield
# hands them the core for a whole time slice. Which one a real neighbour job resembles is
# for the step benchmark to say (python -m bench, with another job beside it).
_YIELD_S = 50e-6
_POLL_S = 20e-6


class Board:
    """Every group rank's page as int64 words; this rank writes its own, reads its peers'."""

    def __init__(self, pages: Sequence[mmap.mmap], me: int, pids: Sequence[int]) -> None:
        self.words = [memoryview(p).cast("q") for p in pages]
        self.me, self.pids = me, list(pids)

    def mark(self, rank: int, /) -> int:
        """``rank``'s read mark as it stands."""
        return self.words[rank][1]

    def set_mark(self, value: int, /) -> None:
        """Publishes this rank's read mark; mutates its page."""
        self.words[self.me][1] = value

    def post(self, seq: int, descriptor: Sequence[int], timeout_s: float, /) -> None:
        """Writes this rank's descriptor of collective ``seq`` into its slot; mutates its page.

        Raises:
            RuntimeError: a peer has not read the slot's last descriptor within ``timeout_s``.
            CollectiveError: that peer's process exited.
        """
        if seq >= SLOTS:
            reused = seq - SLOTS
            self.wait_until(
                lambda: all(self.mark(r) > reused for r in self._peers()),
                lambda: [r for r in self._peers() if self.mark(r) <= reused],
                timeout_s,
                f"reading descriptor {reused}",
            )
        page, at = self.words[self.me], HEADER + (seq % SLOTS) * WORDS
        for i, word in enumerate(descriptor):
            if i != 1:
                page[at + i] = word
        page[at + 1] = seq + 1  # the flag, last

    def collect(self, seq: int, mine: Sequence[int], timeout_s: float, /) -> list[list[int]]:
        """Every group rank's descriptor of collective ``seq`` (``mine`` at this rank), once all are posted.

        Raises:
            RuntimeError: a peer has not posted it within ``timeout_s`` ("timed out").
            CollectiveError: that peer's process exited.
        """
        at = HEADER + (seq % SLOTS) * WORDS
        self.wait_until(
            lambda: all(self.words[r][at + 1] == seq + 1 for r in self._peers()),
            lambda: [r for r in self._peers() if self.words[r][at + 1] != seq + 1],
            timeout_s,
            f"posting its descriptor of collective {seq}",
        )
        rows = []
        for r in range(len(self.words)):
            row = list(mine) if r == self.me else list(self.words[r][at : at + WORDS])
            row[1] = seq  # the flag held seq + 1
            rows.append(row)
        return rows

    def _peers(self) -> list[int]:
        return [r for r in range(len(self.words)) if r != self.me]

    def wait_until(
        self,
        ready: Callable[[], bool],
        late: Callable[[], list[int]],
        timeout_s: float,
        what: str,
    ) -> None:
        """Polls ``ready`` until it holds, yielding the CPU, then sleeping between polls.

        See [Note: waiting for a peer].

        ``late`` names the group ranks still awaited; ``what`` ends the messages.

        Raises:
            CollectiveError: a late rank's process exited ("... exited before ``what``").
            RuntimeError: ``timeout_s`` passed ("timed out ... ``what``").
        """
        start = time.monotonic()
        while not ready():
            waited = time.monotonic() - start
            if waited < _YIELD_S:
                os.sched_yield()
                continue
            for r in late():
                if not alive(self.pids[r]):
                    raise CollectiveError(
                        f"group rank {r} (pid {self.pids[r]}) exited before {what}"
                    )
            if waited > timeout_s:
                raise RuntimeError(
                    f"timed out after {timeout_s:g} s waiting for group rank(s) {late()} {what}"
                )
            time.sleep(_POLL_S)


def alive(pid: int, /) -> bool:
    """Whether process ``pid`` exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True
