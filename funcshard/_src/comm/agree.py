"""Agreements over the control channel: every rank at the same operation with the same intent.

See [Note: agreements] in ``channel.py``.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from funcshard._src.comm import runtime
from funcshard._src.comm.channel import (
    Kind,
    Message,
    Posted,
    all_gather_single,
    channel,
    describe_abort,
    ensure_in_step,
    kind_name,
    mark_out_of_step,
    mirror,
    post,
    receive,
    wait,
)
from funcshard._src.comm.runtime import CollectiveError, DesyncError


def digest_of(fields: Mapping[str, Any], /) -> bytes:
    """A 16-byte digest of JSON-able ``fields``, equal in every process for equal fields."""
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).digest()[:16]


def agree(
    kind: Kind, what: str, /, digest: bytes = b"", payload: Sequence[int] = ()
) -> list[tuple[bytes, tuple[int, ...]]] | None:
    """Every rank's ``(digest, payload)`` once all ranks reach the same agreement; collective.

    ``None`` outside a distributed run. See [Note: agreements] in ``comm/channel.py``.

    Raises:
        DesyncError: ranks are at different operations (the message lists each rank's).
        CollectiveError: a peer gave up (its ABORT arrived), or the agreement failed
            or outlived the collective timeout; this process is out of step.
    """
    ch = channel()
    if ch is None:
        return None
    ensure_in_step(what)
    posted = post(ch, kind, digest, payload, what)
    return _check_kinds(
        ch, kind, ch.seq - 1, receive(ch, posted, timeout=runtime.collective_timeout()), what
    )


@dataclass(eq=False)
class Agreement:
    """An agreement on fields in flight (see :func:`start`): :meth:`finish` waits and compares."""

    kind: Kind
    what: str
    fields: Mapping[str, Any]
    hint: str
    seq: int
    posted: Posted | None  # None outside a distributed run
    digest: bytes

    def finish(self) -> None:
        """Waits for every rank's message and checks that their fields equal this rank's.

        Raises:
            DesyncError, CollectiveError: as :func:`agree_on`.
        """
        ch = channel()
        if self.posted is None or ch is None:
            return
        messages = receive(ch, self.posted, timeout=runtime.collective_timeout())
        everyone = _check_kinds(ch, self.kind, self.seq, messages, self.what)
        if all(d == self.digest for d, _ in everyone):
            return
        details = all_gather_json(dict(self.fields), f"the details of {self.what}")
        reference = details[0]
        differences = [
            f"rank {r}: {name} {value} (rank 0: {reference.get(name)})"
            for r, theirs in enumerate(details)
            for name, value in theirs.items()
            if value != reference.get(name)
        ]
        hint = f". {self.hint}" if self.hint else ""
        raise DesyncError(f"ranks disagree at {self.what}: " + "; ".join(differences) + hint)


def start(kind: Kind, what: str, fields: Mapping[str, Any], /, *, hint: str = "") -> Agreement:
    """Posts this rank's part of an agreement on ``fields`` and returns at once; collective.

    Work that issues no collective may run until :meth:`Agreement.finish`; any
    other agreement or data collective must wait for it.

    Raises:
        CollectiveError: this process is out of step.
    """
    digest = digest_of(fields)
    ch = channel()
    if ch is None:
        return Agreement(kind, what, fields, hint, 0, None, digest)
    ensure_in_step(what)
    posted = post(ch, kind, digest, (), what)
    return Agreement(kind, what, fields, hint, ch.seq - 1, posted, digest)


def agree_on(kind: Kind, what: str, fields: Mapping[str, Any], /, *, hint: str = "") -> None:
    """Agrees that every rank has equal ``fields``; collective.

    Raises:
        DesyncError: some rank's fields differ; the message lists, for each rank
            that differs from rank 0, every field and both values, then ``hint``.
        CollectiveError: see :func:`agree`.
    """
    start(kind, what, fields, hint=hint).finish()


def _check_kinds(
    ch: Any, kind: Kind, seq: int, messages: list[Message], what: str
) -> list[tuple[bytes, tuple[int, ...]]]:
    """Every rank's ``(digest, payload)`` if every rank is at this agreement; else raises."""
    aborted = [(r, m) for r, m in enumerate(messages) if m[0] == int(Kind.ABORT)]
    if aborted:
        ch.peer_aborted = True
        mark_out_of_step(f"rank {aborted[0][0]} gave up during {what}")
        gave_up = "; ".join(f"rank {r}: {describe_abort(m)}" for r, m in aborted)
        raise CollectiveError(
            f"{what} on rank {ch.rank}: a peer gave up instead ({gave_up}). This rank is now out of "
            f"step; restart the job and resume from the latest checkpoint"
        )
    if any((m[0], m[1]) != (int(kind), seq) for m in messages):
        mark_out_of_step(f"ranks were at different operations during {what}")
        listing = "; ".join(
            f"rank {r}: {kind_name(m[0])} (operation #{m[1]})" for r, m in enumerate(messages)
        )
        raise DesyncError(
            f"ranks are at different operations ({listing}), rank {ch.rank} at {what}. Every rank "
            f"must run the same funcshard operations in the same order (the same steps, shard, "
            f"unshard, clipping and checkpoint calls)"
        )
    return [(m[2], tuple(m[3])) for m in messages]


def sum_over_ranks(values: Sequence[float], what: str, /) -> list[float]:
    """The sum over every rank of up to four floats, added in rank order; collective.

    One agreement carries the values themselves, so a rank that calls another
    operation here raises :class:`DesyncError` instead of adding the wrong numbers.

    Example:
        >>> sum_over_ranks([1.5, 2.0], "a doctest")  # one process: the values themselves
        [1.5, 2.0]
    """
    ch = channel()
    if ch is None:
        return [float(v) for v in values]
    bits = [struct.unpack("<q", struct.pack("<d", float(v)))[0] for v in values]
    everyone = agree(Kind.REDUCE, what, digest_of({"operation": what}), bits)
    assert everyone is not None
    if any(d != everyone[0][0] for d, _ in everyone):
        names = all_gather_json(what, f"the details of {what}")
        listing = "; ".join(f"rank {r}: {name}" for r, name in enumerate(names))
        raise DesyncError(
            f"ranks run different operations where they sum over every rank ({listing}); every "
            f"rank must call the same funcshard operations in the same order"
        )
    totals = [0.0] * len(values)
    for _, payload in everyone:
        for i in range(len(values)):
            totals[i] += struct.unpack("<d", struct.pack("<q", payload[i]))[0]
    return totals


def all_gather_json(value: Any, what: str, /) -> list[Any]:
    """Every rank's JSON-able ``value``, in rank order; collective (never unpickles anything).

    Raises:
        CollectiveError, DesyncError: see :func:`agree`.
    """
    ch = channel()
    if ch is None:
        return [json.loads(json.dumps(value))]
    data = json.dumps(value, separators=(",", ":")).encode()
    everyone = agree(Kind.OBJECT, what, payload=(len(data),))
    assert everyone is not None
    size = max(p[0] for _, p in everyone)
    mine = torch.zeros(size, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
    out = mirror(ch, mine)
    # See [Note: agreements] in ``comm/channel.py``: the sizes were just agreed, so this cannot meet a message of another size
    work = None
    try:
        work = all_gather_single(out, mine, group=ch.group("payload"), async_op=True)
        wait(work, runtime.collective_timeout())
    except Exception as e:
        if work is not None:
            ch.abandoned.append((work, out, mine))
        mark_out_of_step(f"the data of {what} did not arrive")
        raise CollectiveError(f"{what} on rank {ch.rank} failed: {e}") from e
    rows = out.view(ch.world_size, size).numpy()
    return [json.loads(rows[r, : p[0]].tobytes()) for r, (_, p) in enumerate(everyone)]


def broadcast_json(value: Any, what: str, /, *, src: int = 0) -> Any:
    """Rank ``src``'s JSON-able ``value`` on every rank; collective."""
    return all_gather_json(value if runtime.rank() == src else None, what)[src]
