"""Agreements: the small messages that keep every rank in step, and what happens when one is not.

[Note: agreements]
Two collectives pair up by their position in their group's sequence, not by
what they are: if one rank issues an all-gather of unit ``blocks/1`` where
another issues one of ``blocks/2``, gloo hands each the other's bytes (a silent
wrong result) or, when the sizes differ, aborts the process. So every
operation that spans ranks (a step, ``fs.shard``, ``fs.unshard``, clipping,
a checkpoint's save or load) first *agrees*: every rank contributes one
64-byte message, ``(kind, operation number, digest, payload)``, to an
all-gather on a **control group** of its own (gloo, over the world) that
carries nothing else, so a message can only ever meet another message of the
same size. Ranks at different operations, or with different digests of what
they are about to do, raise :class:`DesyncError` before a data collective
pairs wrongly. Variable-sized data (JSON objects) travels on a second group
only after an agreement has fixed its size on every rank.

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
import datetime
import enum
import hashlib
import json
import struct
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist

from funcshard._src.comm import runtime
from funcshard._src.comm.runtime import CollectiveError, DesyncError

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single and
# deprecated the old names; older releases only have the old ones.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

WORDS = 8  # a control message: (WORDS,) int64 = 64 bytes
PAYLOAD_WORDS = 4
_MAGIC = 0x6673_0000  # "fs": a message that lacks it is not funcshard's
ABORT_GRACE_S = 2.0  # how long a failing rank waits to learn whether every rank failed alike
DEFAULT_TIMEOUT_S = 600.0  # for creating the control groups when no timeout is set


class Kind(enum.IntEnum):
    """What an agreement is about; ranks at different kinds are out of step."""

    ABORT = 1
    STEP = 2
    CALL = 3
    FORWARD = 4
    BACKWARD = 5
    END = 6
    SHARD = 7
    UNSHARD = 8
    REDUCE = 9
    CHECKPOINT = 10
    OBJECT = 11
    DEBUG = 12


@dataclass(eq=False)
class Channel:
    """This process's control groups for one default process group, and whether it is still in step."""

    control: weakref.ref[dist.ProcessGroup]
    payload: weakref.ref[dist.ProcessGroup]
    rank: int
    world_size: int
    seq: int = 0  # agreements so far: equal on every rank that is in step
    issued: int = 0  # data collectives issued so far
    trace: Any = field(default_factory=hashlib.sha256)
    out_of_step: str | None = None  # why this process cannot take part in collectives any more
    peer_aborted: bool = False  # a peer's ABORT was already received: no need to post one
    abandoned: list[Any] = field(default_factory=list)  # works never waited for, kept alive

    def group(self, which: str) -> dist.ProcessGroup:
        ref = self.control if which == "control" else self.payload
        group = ref()
        if group is None:
            raise CollectiveError(
                "funcshard's control group was destroyed (torch.distributed.destroy_process_group); "
                "initialize again"
            )
        return group


_CHANNELS: dict[int, tuple[weakref.ref[dist.ProcessGroup], Channel]] = {}


def channel() -> Channel | None:
    """The control channel of the current process group (``None`` alone or on one rank).

    Created on first use, collectively: :func:`funcshard._src.comm.groups.bind`
    asks for it before it makes any other group, so that every rank creates its
    groups in the same order.
    """
    if not runtime.is_distributed() or runtime.world_size() == 1:
        return None
    world = dist.distributed_c10d._get_default_group()
    found = _CHANNELS.get(id(world))
    if found is not None and found[0]() is world:
        return found[1]
    timeout = datetime.timedelta(seconds=runtime.collective_timeout() or DEFAULT_TIMEOUT_S)
    control = cast("dist.ProcessGroup", dist.new_group(backend="gloo", timeout=timeout))
    payload = cast("dist.ProcessGroup", dist.new_group(backend="gloo", timeout=timeout))
    made = Channel(weakref.ref(control), weakref.ref(payload), runtime.rank(), runtime.world_size())
    _CHANNELS[id(world)] = (weakref.ref(world), made)
    return made


def existing_channel() -> Channel | None:
    """The control channel of the current process group if one was made; never creates one."""
    if not runtime.is_distributed():
        return None
    world = dist.distributed_c10d._get_default_group()
    found = _CHANNELS.get(id(world))
    return found[1] if found is not None and found[0]() is world else None


def digest_of(fields: Mapping[str, Any], /) -> bytes:
    """A 16-byte digest of JSON-able ``fields``, equal in every process for equal fields."""
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).digest()[:16]


def ensure_in_step(what: str, /) -> None:
    """Raises if this process is out of step (see [Note: out of step]).

    Raises:
        CollectiveError: an earlier operation left the ranks out of step.
    """
    ch = channel()
    if ch is not None and ch.out_of_step is not None:
        raise CollectiveError(
            f"{what} on rank {ch.rank} refused: an earlier operation left the ranks out of step "
            f"({ch.out_of_step}), so no collective can be trusted to pair with the same one on "
            f"every rank. Restart the job (torchrun --max-restarts) and resume from the latest "
            f"checkpoint"
        )


def mark_out_of_step(reason: str, /) -> None:
    """Records that this process can no longer take part in collectives; mutates the channel."""
    ch = channel()
    if ch is not None and ch.out_of_step is None:
        ch.out_of_step = reason


def record_issued(op: str, tag: str, numel: int, dtype: torch.dtype, /) -> None:
    """Counts one data collective and adds it to the trace the agreements compare; mutates."""
    ch = channel()
    if ch is not None:
        ch.issued += 1
        ch.trace.update(f"{op}|{tag}|{numel}|{dtype};".encode())


def trace_digest() -> bytes:
    """The digest of every data collective this process issued so far (16 bytes)."""
    ch = channel()
    return b"\0" * 16 if ch is None else ch.trace.copy().digest()[:16]


def agree(
    kind: Kind, what: str, /, digest: bytes = b"", payload: Sequence[int] = ()
) -> list[tuple[bytes, tuple[int, ...]]] | None:
    """Every rank's ``(digest, payload)`` once all ranks reach the same agreement; collective.

    ``None`` outside a distributed run. See [Note: agreements].

    Raises:
        DesyncError: ranks are at different operations (the message lists each rank's).
        CollectiveError: a peer gave up (its ABORT arrived), or the agreement failed
            or outlived the collective timeout; this process is out of step.
    """
    ch = channel()
    if ch is None:
        return None
    ensure_in_step(what)
    messages = _exchange(ch, kind, digest, payload, what, timeout=runtime.collective_timeout())
    assert messages is not None
    mine = (int(kind), ch.seq - 1)
    aborted = [(r, m) for r, m in enumerate(messages) if m[0] == int(Kind.ABORT)]
    if aborted:
        ch.peer_aborted = True
        mark_out_of_step(f"rank {aborted[0][0]} gave up during {what}")
        gave_up = "; ".join(f"rank {r}: {_abort_reason(m)}" for r, m in aborted)
        raise CollectiveError(
            f"{what} on rank {ch.rank}: a peer gave up instead ({gave_up}). This rank is now out of "
            f"step; restart the job and resume from the latest checkpoint"
        )
    if any((m[0], m[1]) != mine for m in messages):
        mark_out_of_step(f"ranks were at different operations during {what}")
        listing = "; ".join(
            f"rank {r}: {_kind_name(m[0])} (operation #{m[1]})" for r, m in enumerate(messages)
        )
        raise DesyncError(
            f"ranks are at different operations ({listing}), rank {ch.rank} at {what}. Every rank "
            f"must run the same funcshard operations in the same order (the same steps, shard, "
            f"unshard, clipping and checkpoint calls)"
        )
    return [(m[2], tuple(m[3])) for m in messages]


def agree_on(kind: Kind, what: str, fields: Mapping[str, Any], /, *, hint: str = "") -> None:
    """Agrees that every rank has equal ``fields``; collective.

    Raises:
        DesyncError: some rank's fields differ; the message lists, for each rank
            that differs from rank 0, every field and both values, then ``hint``.
        CollectiveError: see :func:`agree`.
    """
    everyone = agree(kind, what, digest_of(fields))
    if everyone is None or all(d == everyone[0][0] for d, _ in everyone):
        return
    details = all_gather_json(dict(fields), f"the details of {what}")
    reference = details[0]
    differences = [
        f"rank {r}: {name} {value} (rank 0: {reference.get(name)})"
        for r, theirs in enumerate(details)
        for name, value in theirs.items()
        if value != reference.get(name)
    ]
    raise DesyncError(
        f"ranks disagree at {what}: " + "; ".join(differences) + (f". {hint}" if hint else "")
    )


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
    out = torch.empty(size * ch.world_size, dtype=torch.uint8)
    # See [Note: agreements]: the sizes were just agreed, so this cannot meet a message of another size
    work = None
    try:
        work = all_gather_single(out, mine, group=ch.group("payload"), async_op=True)
        _wait(work, runtime.collective_timeout())
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


def peer_reports() -> str:
    """What other ranks wrote to the store when they gave up, as one sentence ("" if nothing)."""
    ch = channel()
    if ch is None:
        return ""
    found: list[str] = []
    try:
        store = dist.distributed_c10d._get_default_store()
        for r in range(ch.world_size):
            key = _report_key(r)
            if r != ch.rank and store.check([key]):
                found.append(f"rank {r} {store.get(key).decode('utf-8', 'replace')}")
    except Exception:  # the store lives on a peer that may be gone: reports are a courtesy
        return ""
    return f" The other ranks reported: {'; '.join(found)}." if found else ""


def abort_exchange(what: str, error: BaseException, /) -> bool:
    """After ``error`` in the middle of ``what``: whether every rank gave up alike; collective-ish.

    Posts this rank's ABORT and waits up to :data:`ABORT_GRACE_S` for the others'
    (see [Note: out of step]). Returns ``True`` when every rank aborted at the
    same operation having issued the same data collectives (equal traces): the
    ranks are still in step. Otherwise marks this process out of step, adds a note to ``error``
    saying what the peers did, and returns ``False``.
    """
    ch = channel()
    if ch is None:
        return True
    _report(ch, f"gave up during {what}: {type(error).__name__}: {_first_sentence(error)}")
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
        messages = _exchange(ch, Kind.ABORT, trace, words, what, timeout=timeout)
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
            f"rank {r} {_abort_reason(m) if m[0] == int(Kind.ABORT) else 'was still running (at ' + _kind_name(m[0]) + ')'}"
            for r, m in enumerate(messages)
            if r != ch.rank
        )
    error.add_note(
        f"funcshard: {what} failed on rank {ch.rank}, and not on every rank alike: {seen}."
        f"{peer_reports()} The ranks are out of step, so every later collective on this rank "
        f"refuses; restart the job and resume from the latest checkpoint"
    )
    return False


# -- helpers -----------------------------------------------------------------------


def _exchange(
    ch: Channel,
    kind: Kind,
    digest: bytes,
    payload: Sequence[int],
    what: str,
    *,
    timeout: float | None,
) -> list[tuple[int, int, bytes, list[int]]] | None:
    """One all-gather of control messages; returns ``(kind, seq, digest, payload)`` per rank."""
    if len(payload) > PAYLOAD_WORDS:
        raise ValueError(
            f"a control message carries {PAYLOAD_WORDS} payload words, got {len(payload)}"
        )
    digest = digest.ljust(16, b"\0")[:16]
    message = torch.zeros(WORDS, dtype=torch.int64)
    message[0] = _MAGIC + int(kind)
    message[1] = ch.seq
    message[2:4] = torch.frombuffer(bytearray(digest), dtype=torch.int64)
    message[4 : 4 + len(payload)] = torch.tensor(list(payload), dtype=torch.int64)
    ch.seq += 1
    out = torch.empty(WORDS * ch.world_size, dtype=torch.int64)
    work = None
    try:
        work = all_gather_single(out, message, group=ch.group("control"), async_op=True)
        _wait(work, timeout)
    except Exception as e:
        if work is not None:
            ch.abandoned.append((work, out, message))  # gloo may still write into them
        mark_out_of_step(f"the agreement at {what} did not complete")
        timed_out = timeout is not None and "timed out" in str(e).lower()
        problem = (
            f"did not reach it within {timeout:g} s" if timed_out else f"could not be reached ({e})"
        )
        raise CollectiveError(
            f"{what} on rank {ch.rank}: the other ranks {problem}. A peer rank died or is stuck "
            f"in another collective; check the other ranks' logs.{peer_reports()}"
        ) from e
    rows = out.view(ch.world_size, WORDS).tolist()
    messages: list[tuple[int, int, bytes, list[int]]] = []
    for row in rows:
        magic_kind = int(row[0])
        raw = b"".join(int(w).to_bytes(8, "little", signed=True) for w in row[2:4])
        kind_value = magic_kind - _MAGIC if magic_kind - _MAGIC in _KINDS else -1
        messages.append((kind_value, int(row[1]), raw, [int(w) for w in row[4:]]))
    return messages


_KINDS = {int(k) for k in Kind}


def _first_sentence(error: BaseException) -> str:
    text = str(error).split(". ")[0].rstrip(".")
    return text if len(text) <= 240 else text[:237] + "..."


def _report_key(rank: int) -> str:
    return f"funcshard/gave_up/{rank}"


def _report(ch: Channel, text: str) -> None:
    """Writes why this rank gave up to the store, for peers' error messages; best effort."""
    try:
        dist.distributed_c10d._get_default_store().set(_report_key(ch.rank), text)
    except Exception:
        return


def _wait(work: Any, timeout: float | None) -> None:
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout=datetime.timedelta(seconds=timeout))


def _kind_name(value: int) -> str:
    return Kind(value).name.lower() if value in _KINDS else "something that is not funcshard's"


def _abort_reason(message: tuple[int, int, bytes, list[int]]) -> str:
    name = b"".join(int(w).to_bytes(8, "little", signed=True) for w in message[3][1:])
    error = name.rstrip(b"\0").decode("ascii", "replace") or "an error"
    return f"gave up with {error} at operation #{message[1]} after {message[3][0]} collectives"
