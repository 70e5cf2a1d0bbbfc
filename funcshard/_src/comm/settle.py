"""Settling after an error: did every rank give up alike, or is this process out of step?

[Note: out of step]
After an error in the middle of an operation, ranks may have issued different
data collectives; a later collective would pair with a stale one. The failing
rank therefore writes what happened to the process group's store and posts an
``ABORT`` message, waiting briefly for the others: if every rank gave up at the
same point having issued the same collectives (the same error everywhere),
the ranks are still in step and go on. Otherwise this process is *out of
step*: every later funcshard collective refuses at once with
:class:`CollectiveError`. A peer that meets the ABORT at an agreement raises at
once; one blocked in a data collective raises when its timeout expires, and
its message quotes what the failing rank wrote to the store. Only a new
process group (a restart) clears it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from funcshard._src.comm import runtime
from funcshard._src.comm.channel import (
    PAYLOAD_WORDS,
    Kind,
    describe_abort,
    exchange,
    existing_channel,
    first_sentence,
    kind_name,
    mark_out_of_step,
    peer_reports,
    report,
    trace_digest,
)
from funcshard._src.comm.runtime import CollectiveError

ABORT_GRACE_S = 2.0  # how long a failing rank waits to learn whether every rank failed alike


@contextlib.contextmanager
def operation(what: str, /) -> Iterator[None]:
    """Runs one multi-rank operation; on an error, settles with the other ranks first.

    See [Note: out of step]: the error is reported to the store and exchanged
    with the other ranks (:func:`abort_exchange`) before it propagates.
    """
    try:
        yield
    except BaseException as error:
        abort_exchange(what, error)
        raise


def abort_exchange(what: str, error: BaseException, /) -> bool:
    """After ``error`` in the middle of ``what``: whether every rank gave up alike; collective-ish.

    Posts this rank's ABORT and waits up to :data:`ABORT_GRACE_S` for the others'
    (see [Note: out of step]). Returns ``True`` when every rank aborted at the
    same operation having issued the same data collectives (equal traces): the
    ranks are still in step. Otherwise marks this process out of step, adds a
    note to ``error`` saying what the peers did, and returns ``False``.
    """
    ch = existing_channel()
    if ch is None:
        return True
    report(
        ch,
        f"gave up during {what} (operation #{ch.seq}): {type(error).__name__}: "
        f"{first_sentence(error)}",
    )
    if ch.peer_aborted:  # a peer's ABORT already met one of our messages: it knows we went on
        mark_out_of_step(f"{what} failed: {type(error).__name__}")
        return False
    name = type(error).__name__.encode()[: 8 * (PAYLOAD_WORDS - 1)]
    words = [ch.issued] + [
        int.from_bytes(name[i : i + 8].ljust(8, b"\0"), "little", signed=True)
        for i in range(0, 8 * (PAYLOAD_WORDS - 1), 8)
    ]
    timeout = min(ABORT_GRACE_S, runtime.collective_timeout() or ABORT_GRACE_S)
    trace = trace_digest()
    try:
        messages = exchange(ch, Kind.ABORT, trace, words, what, timeout=timeout)
    except CollectiveError:
        messages = None
    alike = messages is not None and all(
        m[0] == int(Kind.ABORT) and m[1] == ch.seq - 1 and m[2] == trace for m in messages
    )
    if alike:
        return True
    mark_out_of_step(f"{what} failed on rank {ch.rank}: {type(error).__name__}")
    if messages is None:
        seen = f"the other ranks did not give up within {timeout:g} s (they are still running or stuck)"
    else:
        seen = "; ".join(
            f"rank {r} {describe_abort(m) if m[0] == int(Kind.ABORT) else 'was still running (at ' + kind_name(m[0]) + ')'}"
            for r, m in enumerate(messages)
            if r != ch.rank
        )
    error.add_note(
        f"funcshard: {what} failed on rank {ch.rank}, and not on every rank alike: {seen}."
        f"{peer_reports()} The ranks are out of step, so every later collective on this rank "
        f"refuses; restart the job and resume from the latest checkpoint"
    )
    return False
