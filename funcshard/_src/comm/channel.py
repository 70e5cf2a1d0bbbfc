"""The control channel: small fixed-size messages between ranks, whether this process is in step, and agreements over it.

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

See [Note: out of step] in ``settle.py`` for what happens after an error.

[Note: the fake process group]
Under torch's ``fake`` process group (``dist.init_process_group("fake",
store=FakeStore(), rank=r, world_size=W)``) one process stands for every rank:
each collective completes at once and moves no bytes. That is how a W-rank step
runs in one process, to count memory and host time at a large world size. The
control groups are then fake too (gloo cannot start without peers), and the
channel is *mirrored*: an all-gather's output is filled with this rank's message
in every row before it is issued, so every agreement finds every rank at the
same operation with the same digest, as it would if all W ranks ran this
process's program. Data collectives move nothing: their results hold whatever
their buffers held, so a loss under the fake group is not a number to check.
The shared-memory transport is gloo's alone and never starts there.

**Agreements** over the channel put every rank at the same operation with the
same intent ([Note: agreements], above).
"""

from __future__ import annotations

import datetime
import enum
import hashlib
import json
import struct
import weakref
from collections.abc import Mapping, Sequence
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
Message = tuple[int, int, bytes, list[int]]  # (kind, operation number, digest, payload)


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
    SETTINGS = 13


@dataclass(eq=False)
class Channel:
    """This process's control groups for one default process group, and whether it is still in step."""

    control: weakref.ref[dist.ProcessGroup]
    payload: weakref.ref[dist.ProcessGroup]
    rank: int
    world_size: int
    seq: int = 0  # agreements so far: equal on every rank that is in step
    issued: int = 0  # data collectives issued so far
    trace: Any = field(default_factory=hashlib.sha256)  # of the collectives before ``recent``
    # collectives issued since the trace was last brought up to date (record_issued)
    recent: list[tuple[str, str, int, torch.dtype]] = field(default_factory=list)
    out_of_step: str | None = None  # why this process cannot take part in collectives any more
    peer_aborted: bool = False  # a peer's ABORT was already received: no need to post one
    abandoned: list[Any] = field(default_factory=list)  # works never waited for, kept alive
    agreed_settings: dict[str, str] | None = None  # every rank's transport settings: collectives.py
    mirrored: bool = False  # torch's fake process group: see [Note: the fake process group]

    def group(self, which: str) -> dist.ProcessGroup:
        ref = self.control if which == "control" else self.payload
        group = ref()
        if group is None:
            raise CollectiveError(
                "funcshard's control group was destroyed (torch.distributed.destroy_process_group); "
                "initialize again"
            )
        return group

    def record_issued(self, op: str, tag: str, numel: int, dtype: torch.dtype, /) -> None:
        """Counts one data collective and adds it to the trace the agreements compare; mutates.

        Hashed when the trace is next read (:meth:`digest`), a step's collectives at
        once: a collective costs a list append, not a hash update.
        """
        self.issued += 1
        self.recent.append((op, tag, numel, dtype))
        if len(self.recent) >= 4096:
            self.digest()

    def digest(self) -> bytes:
        """The digest of every data collective issued so far (16 bytes); mutates the trace."""
        if self.recent:
            self.trace.update("".join(f"{o}|{t}|{n}|{d};" for o, t, n, d in self.recent).encode())
            self.recent.clear()
        return self.trace.copy().digest()[:16]


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
    timeout = datetime.timedelta(seconds=runtime.wait_limit_s())
    fake = runtime.is_fake()  # See [Note: the fake process group]
    backend = "fake" if fake else "gloo"
    control = cast("dist.ProcessGroup", dist.new_group(backend=backend, timeout=timeout))
    payload = cast("dist.ProcessGroup", dist.new_group(backend=backend, timeout=timeout))
    made = Channel(
        weakref.ref(control),
        weakref.ref(payload),
        runtime.rank(),
        runtime.world_size(),
        mirrored=fake,
    )
    _CHANNELS[id(world)] = (weakref.ref(world), made)
    return made


def existing_channel() -> Channel | None:
    """The control channel of the current process group if one was made; never creates one."""
    if not runtime.is_distributed():
        return None
    world = dist.distributed_c10d._get_default_group()
    found = _CHANNELS.get(id(world))
    return found[1] if found is not None and found[0]() is world else None


def ensure_in_step(what: str, /) -> None:
    """Raises if this process is out of step (see [Note: out of step] in ``comm/settle.py``).

    Raises:
        CollectiveError: an earlier operation left the ranks out of step.
    """
    ch = existing_channel()
    if ch is not None and ch.out_of_step is not None:
        raise CollectiveError(
            f"{what} on rank {ch.rank} refused: an earlier operation left the ranks out of step "
            f"({ch.out_of_step}), so no collective can be trusted to pair with the same one on "
            f"every rank. Restart the job (torchrun --max-restarts) and resume from the latest "
            f"checkpoint"
        )


def mark_out_of_step(reason: str, /) -> None:
    """Records that this process can no longer take part in collectives; mutates the channel."""
    ch = existing_channel()
    if ch is not None and ch.out_of_step is None:
        ch.out_of_step = reason


def trace_digest() -> bytes:
    """The digest of every data collective this process issued so far (16 bytes)."""
    ch = existing_channel()
    return b"\0" * 16 if ch is None else ch.digest()


@dataclass(eq=False)
class Posted:
    """A control message in flight: :func:`receive` waits for every rank's."""

    what: str
    work: Any
    out: torch.Tensor  # (WORDS * world_size,) every rank's message, once done
    message: torch.Tensor  # (WORDS,) this rank's


def post(ch: Channel, kind: Kind, digest: bytes, payload: Sequence[int], what: str) -> Posted:
    """Issues one all-gather of control messages on ``ch`` (this rank's is ``(kind, seq, digest, payload)``).

    Raises:
        CollectiveError: it could not be issued; this process is then out of step.
    """
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
    out = mirror(ch, message)
    try:
        work = all_gather_single(out, message, group=ch.group("control"), async_op=True)
    except Exception as e:
        mark_out_of_step(f"the agreement at {what} could not be issued")
        raise CollectiveError(
            f"{what} on rank {ch.rank}: could not reach the other ranks ({e})"
        ) from e
    return Posted(what, work, out, message)


def receive(ch: Channel, posted: Posted, /, *, timeout: float | None) -> list[Message]:
    """Every rank's message of ``posted``: ``(kind, seq, digest, payload)`` per rank.

    Raises:
        CollectiveError: the all-gather failed or outlived ``timeout``; this
            process is then out of step.
    """
    try:
        wait(posted.work, timeout)
    except Exception as e:
        ch.abandoned.append((posted.work, posted.out, posted.message))  # gloo may still write
        mark_out_of_step(f"the agreement at {posted.what} did not complete")
        timed_out = timeout is not None and "timed out" in str(e).lower()
        problem = (
            f"did not reach it within {timeout:g} s" if timed_out else f"could not be reached ({e})"
        )
        raise CollectiveError(
            f"{posted.what} on rank {ch.rank}: the other ranks {problem}. A peer rank died or is "
            f"stuck in another collective; check the other ranks' logs.{peer_reports()}"
        ) from e
    rows = posted.out.view(ch.world_size, WORDS).tolist()
    messages: list[Message] = []
    for row in rows:
        magic_kind = int(row[0])
        raw = b"".join(int(w).to_bytes(8, "little", signed=True) for w in row[2:4])
        kind_value = magic_kind - _MAGIC if magic_kind - _MAGIC in KINDS else -1
        messages.append((kind_value, int(row[1]), raw, [int(w) for w in row[4:]]))
    return messages


def exchange(
    ch: Channel,
    kind: Kind,
    digest: bytes,
    payload: Sequence[int],
    what: str,
    *,
    timeout: float | None,
) -> list[Message]:
    """One all-gather of control messages on ``ch``, waited for: :func:`post` then :func:`receive`."""
    return receive(ch, post(ch, kind, digest, payload, what), timeout=timeout)


def mirror(ch: Channel, mine: torch.Tensor, /) -> torch.Tensor:
    """The output of an all-gather of ``mine`` on ``ch``: every row ``mine`` where ``ch`` is mirrored.

    See [Note: the fake process group].
    """
    if ch.mirrored:
        return mine.repeat(ch.world_size)
    return torch.empty(mine.numel() * ch.world_size, dtype=mine.dtype)


def wait(work: Any, timeout: float | None) -> None:
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout=datetime.timedelta(seconds=timeout))


def kind_name(value: int) -> str:
    return Kind(value).name.lower() if value in KINDS else "something that is not funcshard's"


def describe_abort(message: Message) -> str:
    name = b"".join(int(w).to_bytes(8, "little", signed=True) for w in message[3][1:])
    error = name.rstrip(b"\0").decode("ascii", "replace") or "an error"
    return f"gave up with {error} at operation #{message[1]} after {message[3][0]} collectives"


def peer_reports() -> str:
    """What other ranks wrote to the store when they gave up, as one sentence ("" if nothing)."""
    ch = existing_channel()
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


def first_sentence(error: BaseException) -> str:
    text = str(error).split(". ")[0].rstrip(".")
    return text if len(text) <= 240 else text[:237] + "..."


def _report_key(rank: int) -> str:
    return f"funcshard/gave_up/{rank}"


def report(ch: Channel, text: str) -> None:
    """Writes why this rank gave up to the store, for peers' error messages; best effort."""
    try:
        dist.distributed_c10d._get_default_store().set(_report_key(ch.rank), text)
    except Exception:
        return


KINDS = {int(k) for k in Kind}


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
        # every agreement of a kind sends its fields as a JSON object: sum_over_ranks too
        details = all_gather_json(dict(self.fields), f"the details of {self.what}")
        details = [d if isinstance(d, dict) else {"operation": d} for d in details]
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
        # as Agreement.finish's: the fields, of which a sum has only its operation
        details = all_gather_json({"operation": what}, f"the details of {what}")
        names = [d.get("operation") if isinstance(d, dict) else d for d in details]
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
