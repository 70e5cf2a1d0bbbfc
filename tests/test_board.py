"""Descriptors on the board: what a rank posts is what its peers collect, and every wait ends.

[Note: descriptors on the board] in ``comm/shm/regions.py``. Two boards over the same
two anonymous pages stand for two ranks of a group in one process: a descriptor
posted by one is collected by the other with its words intact, slot after slot
around the ring; a slot is reused only once the peer's read mark has passed it;
a peer that never posts fails the wait with "timed out" (what a collective's
timeout says), and one whose process has exited fails it at once.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from funcshard._src.comm.runtime import CollectiveError
from funcshard._src.comm.shm.regions import PAGE_BYTES, SLOTS, Board


def _boards(pids: list[int] | None = None) -> tuple[Board, Board]:
    pages = [mmap.mmap(-1, PAGE_BYTES), mmap.mmap(-1, PAGE_BYTES)]
    pids = pids or [os.getpid(), os.getpid()]
    return Board(pages, 0, pids), Board(pages, 1, pids)


def _descriptor(seq: int, salt: int) -> list[int]:
    return [0x1234, seq, 7 + salt, 8, 9 * seq + salt, 0, salt % 3, 64 + seq]


@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=3 * SLOTS))
def test_what_a_rank_posts_its_peer_collects_around_the_ring(salts):
    first, second = _boards()
    for seq, salt in enumerate(salts):
        mine, theirs = _descriptor(seq, salt), _descriptor(seq, salt + 1)
        first.post(seq, mine, 1.0)
        second.post(seq, theirs, 1.0)
        assert first.collect(seq, mine, 1.0) == [mine, theirs]
        assert second.collect(seq, theirs, 1.0) == [mine, theirs]
        first.set_mark(seq + 1)  # both have read collective seq
        second.set_mark(seq + 1)


def test_a_peer_that_never_posts_times_out_like_a_collective():
    first, _ = _boards()
    first.post(0, _descriptor(0, 0), 1.0)
    with pytest.raises(
        RuntimeError, match=r"timed out after 0.05 s waiting for group rank\(s\) \[1\]"
    ):
        first.collect(0, _descriptor(0, 0), 0.05)


def test_a_slot_is_reused_only_once_the_peer_has_read_it():
    first, second = _boards()
    for seq in range(SLOTS):
        first.post(seq, _descriptor(seq, 0), 1.0)
    with pytest.raises(RuntimeError, match=r"timed out .* reading descriptor 0"):
        first.post(SLOTS, _descriptor(SLOTS, 0), 0.05)
    second.set_mark(1)  # the peer read collective 0: its slot is free
    first.post(SLOTS, _descriptor(SLOTS, 0), 1.0)
    for seq in range(SLOTS):
        second.post(seq, _descriptor(seq, 1), 1.0)
    first.set_mark(1)
    second.post(SLOTS, _descriptor(SLOTS, 1), 1.0)
    assert second.collect(SLOTS, _descriptor(SLOTS, 1), 1.0)[0] == _descriptor(SLOTS, 0)


def test_a_peer_whose_process_exited_fails_the_wait_at_once():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    first, _ = _boards([os.getpid(), gone.pid])
    with pytest.raises(CollectiveError, match=rf"group rank 1 \(pid {gone.pid}\) exited"):
        first.collect(0, _descriptor(0, 0), 60.0)
