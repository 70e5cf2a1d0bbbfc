"""Several units side by side in one buffer: their columns, a shared all-gather, a reduction round.

A bucket (``bucket.py``) is a gather group of several units that share their
collectives. Per part (one dtype), its members' flat shards lie side by side in
one buffer: member ``i`` owns columns ``[offset, offset + numel)`` of every row
(:class:`Columns`). One all-gather fills ``(group_size, columns)`` rows from which
each member unpacks its own columns (:class:`Share`); in backward, each member's
gradients are packed into its columns of a round (:class:`Round`) that one
reduce-scatter reduces. The gather group (``gather_group.py``) issues and waits for
those collectives; this module holds only the bookkeeping.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from funcshard._src.comm.pending import Pending
from funcshard._src.execute.unit_state import UnitRuntime


class Columns:
    """Per part: each member's column offset in the packed buffer, and the columns in all."""

    def __init__(self, members: Sequence[UnitRuntime]) -> None:
        self.offsets: list[list[int]] = []
        self.numels: list[int] = []
        for j in range(len(members[0].parts)):
            offsets, n = [], 0
            for member in members:
                offsets.append(n)
                n += member.parts[j].layout.numel
            self.offsets.append(offsets)
            self.numels.append(n)
        self.members = list(members)

    def span(self, member: int, part: int) -> tuple[int, int]:
        """Member ``member``'s columns ``[start, stop)`` of part ``part``."""
        a = self.offsets[part][member]
        return a, a + self.members[member].parts[part].layout.numel


@dataclass(eq=False)
class SharedGathering:
    """One part's shared all-gather, and the members whose share is not yet unpacked."""

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
    """One member's part of a shared all-gather: :meth:`wait` gives its ``(group_size, numel)`` columns."""

    gathering: SharedGathering
    member: int
    result: torch.Tensor  # the member's columns of the gathered buffer (a view)

    def wait(self) -> torch.Tensor:
        """Blocks until the shared all-gather is done; the member's columns."""
        self.gathering.wait()
        return self.result


@dataclass(eq=False)
class Round:
    """One part's packed gradients of the members that reported so far."""

    rows: torch.Tensor  # (group_size, numel)
    reported: set[int] = field(default_factory=set)
