"""The control channel: small fixed-size messages between ranks, and whether this process is in step.

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
"""

from __future__ import annotations

import datetime
import enum
import hashlib
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist

from funcshard._src.comm import runtime
from funcshard._src.comm.runtime import CollectiveError

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
