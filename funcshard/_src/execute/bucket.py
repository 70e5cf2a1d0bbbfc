"""Buckets: consecutive small units whose all-gathers and reductions run as one collective.

A collective over a few hundred kilobytes costs its latency, not its bytes: on
gloo at W=2 a round trip is about as long as moving a megabyte. A
:class:`Bucket` joins consecutive units of the plan (same strategy, same
collective axes, same parts by dtype) up to ``bucket_bytes`` of gathered
parameters, as DDP buckets its all-reduces. Each unit keeps its own state,
holders and full storage (``unit_state.py``); only the collectives are shared:

- Gathering: the first member that needs its parameters starts one all-gather
  per part for every member still SHARDED, from their flat shards copied side
  by side. Each of those members is GATHERING on a share of that collective and
  unpacks its own columns when acquired; the buffers go back to the pool once
  every share was unpacked or dropped.
- Reducing: each member's gradients are packed into its columns of the bucket's
  rows; once every member has reported, one reduce-scatter (or all-reduce, for
  ``no_shard``) runs, and each member's gradient is its slice of the result. A
  member that reports a second time (a unit called twice) first flushes the
  bucket with the columns not yet reported left at zero; the second report goes
  into the next round, and the results add up as separate reductions do.

[Note: bucket order]
Which members join a collective depends only on unit states and the order of
reports, the same on every rank for the same calls (see [Note: collective
order] in ``run.py``), so every rank issues the same bucketed collectives.

The ledger counts every member's bytes as if it had its own collective, so it
equals the cost model (which counts per unit) for every bucket size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from funcshard._src.comm import collectives
from funcshard._src.comm.pending import Pending
from funcshard._src.execute.buffers import BufferPool
from funcshard._src.execute.part import Part
from funcshard._src.execute.unit_state import UnitRuntime, UnitState


@dataclass(eq=False)
class _Gathering:
    """One part's bucketed all-gather, and the members whose share is not yet unpacked."""

    pending: Pending
    staging: tuple[torch.Tensor, torch.Tensor]  # input, output: for the pool
    open: set[int]
    waited: bool = False

    def wait(self) -> None:
        """Waits for the all-gather (once)."""
        if not self.waited:
            self.pending.wait()
            self.waited = True


@dataclass(eq=False)
class Share:
    """One member's part of a bucketed all-gather: :meth:`wait` gives its ``(group_size, numel)`` columns."""

    gathering: _Gathering
    member: int
    result: torch.Tensor  # the member's columns of the gathered buffer (a view)

    def wait(self) -> torch.Tensor:
        """Blocks until the bucket's all-gather is done; the member's columns."""
        self.gathering.wait()
        return self.result


@dataclass(eq=False)
class _Round:
    """One part's packed gradients of the members that reported so far."""

    rows: torch.Tensor  # (group_size, numel)
    reported: set[int] = field(default_factory=set)


class Bucket:
    """Consecutive units whose collectives are shared; see the module docstring."""

    def __init__(
        self, members: Sequence[UnitRuntime], gather_pool: BufferPool, reduce_pool: BufferPool
    ) -> None:
        self.members = list(members)
        self.pool = gather_pool  # the all-gathers' input and output
        self.reduce_pool = reduce_pool  # the rounds' rows
        first = self.members[0]
        self.group_size = first.group_size
        # per part index: each member's column offset, and the columns in all
        self.offsets: list[list[int]] = []
        self.numels: list[int] = []
        for j in range(len(first.parts)):
            offsets, n = [], 0
            for member in self.members:
                offsets.append(n)
                n += member.parts[j].layout.numel
            self.offsets.append(offsets)
            self.numels.append(n)
        # all-gathers with shares not yet unpacked: a later one may start for members that
        # were freed while others still wait on an earlier one (a unit called again)
        self._gathering: list[_Gathering] = []
        self.rounds: dict[int, _Round] = {}
        for i, member in enumerate(self.members):
            member.bucket, member.bucket_index = self, i

    @property
    def name(self) -> str:
        """``first..last`` member unit names, for errors and traces."""
        return f"{self.members[0].name}..{self.members[-1].name}"

    # -- gathering -----------------------------------------------------------------

    def start_gather(self) -> None:
        """SHARDED -> GATHERING for every member still SHARDED: one all-gather per part."""
        joining = [i for i, m in enumerate(self.members) if m.state is UnitState.SHARDED]
        first = self.members[joining[0]]
        for j, part in enumerate(first.parts):
            if part.aliased:
                continue
            numel = self.numels[j]
            device = first.flats[j].data.device
            local = self.pool.take(numel, part.compute_dtype, device)
            for i, member in enumerate(self.members):
                a = self.offsets[j][i]
                data = member.flats[j].data
                local[a : a + data.numel()].copy_(data)  # casts to the compute dtype
            out = self.pool.take(self.group_size * numel, part.compute_dtype, device)
            pending = collectives.all_gather(local, first.bound, first.axes, out=out, tag=self.name)
            gathered = pending.result  # (group_size, numel)
            gathering = _Gathering(pending, (local, out), set(joining))
            self._gathering.append(gathering)
            for i in joining:
                member = self.members[i]
                a, n = self.offsets[j][i], member.parts[j].layout.numel
                member.parts[j].inflight = Share(gathering, i, gathered[:, a : a + n])
                member.memory.add(self.group_size * n * part.compute_dtype.itemsize)
                if member.ledger is not None:
                    member.ledger.record(
                        "all_gather",
                        member.axes,
                        group_size=self.group_size,
                        full_bytes=self.group_size * n * part.compute_dtype.itemsize,
                    )
        for i in joining:
            self.members[i].mark_gathering()

    def unpacked(self, share: Any, /) -> None:
        """A member is done with ``share`` (a :class:`Share`): the last one frees the buffers."""
        gathering = share.gathering
        gathering.open.discard(share.member)
        if not gathering.open and gathering in self._gathering:
            self._gathering.remove(gathering)
            if gathering.waited:
                for t in gathering.staging:
                    self.pool.give(t)

    def abandon(self) -> list[Pending]:
        """After an error: forgets every collective in flight (returned, not waited for) and every round."""
        inflight = [g.pending for g in self._gathering if not g.waited]
        self._gathering.clear()
        self.rounds.clear()
        return inflight

    # -- reducing ------------------------------------------------------------------

    def columns(self, member: int, part: int, grad_dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
        """Member ``member``'s columns of this round's rows of part ``part``, and whether the round was flushed first.

        A member that already reported in this round needs a new one: the caller
        flushes (``flush_round``) when the second value says so.
        """
        round_ = self.rounds.get(part)
        if round_ is not None and member in round_.reported:
            return round_.rows, True
        if round_ is None:
            unit = self.members[0]
            device = unit.flats[part].data.device
            rows = self.reduce_pool.take(self.group_size * self.numels[part], grad_dtype, device)
            round_ = self.rounds[part] = _Round(rows.view(self.group_size, self.numels[part]))
        round_.reported.add(member)
        a = self.offsets[part][member]
        n = self.members[member].parts[part].layout.numel
        return round_.rows[:, a : a + n], False

    def complete(self, part: int, /) -> bool:
        """Whether every member reported in this round of part ``part``."""
        round_ = self.rounds.get(part)
        return round_ is not None and len(round_.reported) == len(self.members)

    def take_round(self, part: int, /) -> _Round:
        """Ends this round of part ``part``: zeroes the columns of members that did not report."""
        round_ = self.rounds.pop(part)
        for i, member in enumerate(self.members):
            if i not in round_.reported:
                a = self.offsets[part][i]
                round_.rows[:, a : a + member.parts[part].layout.numel].zero_()
        return round_

    def pieces(self, part: int, reported: set[int]) -> list[tuple[Part, int, int, UnitRuntime]]:
        """Per reported member: its part, its columns ``[start, stop)`` and the member."""
        out = []
        for i, member in enumerate(self.members):
            if i in reported:
                a = self.offsets[part][i]
                out.append((member.parts[part], a, a + member.parts[part].layout.numel, member))
        return out


# Gathered bytes below which a collective is latency-bound, per backend: on gloo at W=2
# here a reduce-scatter of 256 KiB took 2.7 ms and one of 16 MiB 19 ms
# (bench/reduce_scatter.py), so latency x bandwidth is about 2 MB; a bucket of twice that
# keeps the latency to about a third of its time. NCCL is not bucketed by default: the
# CUDA path is untested here; pass bucket_bytes to bucket there.
DEFAULT_BUCKET_BYTES = {"gloo": 4 << 20}


def default_bucket_bytes(backend: str | None, /) -> int:
    """The default ``bucket_bytes`` on ``backend`` (``None``: not distributed, no buckets).

    Example:
        >>> default_bucket_bytes("gloo"), default_bucket_bytes("nccl"), default_bucket_bytes(None)
        (4194304, 0, 0)
    """
    return 0 if backend is None else DEFAULT_BUCKET_BYTES.get(backend, 0)


def make_buckets(
    units: Sequence[UnitRuntime],
    bucket_bytes: int,
    gather_pool: BufferPool,
    reduce_pool: BufferPool,
    /,
) -> list[Bucket]:
    """Joins consecutive units (in ``units``' order) whose collectives can be shared, up to ``bucket_bytes``.

    Units join when they have the same strategy, collective axes and parts
    (dtype, compute and gradient dtype, frozen, aliased), no part of one leaf
    gathered in place and not the root unit, and their full leaves together stay within
    ``bucket_bytes``. A bucket of one unit is no bucket. Mutates the members: a
    bucket gathers their leaves packed (:meth:`UnitRuntime.pack_gathers`).
    """
    buckets: list[Bucket] = []
    run: list[UnitRuntime] = []
    size = 0

    def close() -> None:
        if len(run) > 1:
            for member in run:  # a bucket gathers its members' leaves in one packed buffer
                member.pack_gathers()
            buckets.append(Bucket(run, gather_pool, reduce_pool))
        run.clear()

    for unit in units:
        nbytes = unit.full_numel_bytes
        if not _eligible(unit) or nbytes > bucket_bytes:
            close()
            size = 0
            continue
        if run and (_signature(run[0]) != _signature(unit) or size + nbytes > bucket_bytes):
            close()
            size = 0
        run.append(unit)
        size += nbytes
    close()
    return buckets


def _eligible(unit: UnitRuntime) -> bool:
    if unit.unit.is_root or any(p.in_place and not p.by_leaf for p in unit.parts) or not unit.parts:
        return False
    if unit.group_size > 1:
        return True
    return unit.replica_size > 1 and all(p.aliased for p in unit.parts)  # no_shard: reductions


def _signature(unit: UnitRuntime) -> tuple[object, ...]:
    return (
        unit.unit.strategy,
        unit.axes,
        unit.replica_axes,
        tuple(
            (p.layout.dtype, p.compute_dtype, p.grad_dtype, p.layout.frozen, p.aliased)
            for p in unit.parts
        ),
    )
