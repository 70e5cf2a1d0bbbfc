"""One dtype of a unit on this rank (:class:`Part`) and the handles of the collectives that gather it.

``param_group.py`` issues those collectives and ``unit_state.py`` holds a unit's
states; this module holds what each part keeps across them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

from funcshard._src.comm.pending import Pending
from funcshard._src.shard.flat import FlatLayout
from funcshard._src.spec.flat_sharding import FlatSharding


class InFlight(Protocol):
    """An all-gather in flight for one part: a :class:`Pending`, or a share of a bucket's."""

    result: torch.Tensor

    def wait(self) -> torch.Tensor:
        """Blocks until the part's gathered ``(group_size, numel)`` buffer is ready."""
        ...


@dataclass
class LeafGathers:
    """The all-gathers of a part gathered in place: each writes full leaves straight into ``result``.

    One for a part of one leaf, and one for a part gathered leaf by leaf
    (:attr:`Part.by_leaf`): ``collectives.all_gather_pieces`` writes every leaf,
    through shared memory in one collective, else by one ring per leaf.
    """

    pendings: list[Pending]
    result: torch.Tensor  # the part's full storage

    def wait(self) -> torch.Tensor:
        """Waits for every leaf's collective, in the order they were issued."""
        for pending in self.pendings:
            pending.wait()
        return self.result


@dataclass(eq=False)
class Part:
    """One dtype of a unit: its layout, persistent full storage and full leaf views."""

    layout: FlatLayout
    compute_dtype: torch.dtype
    grad_dtype: torch.dtype
    aliased: bool
    in_place: bool  # gathered straight into ``full``; see [Note: persistent gathered storage]
    full: torch.Tensor | None = None  # persistent, see [Note: persistent gathered storage]
    views: list[torch.Tensor] = field(default_factory=list)
    inflight: InFlight | None = None  # this part's all-gather, while the unit is GATHERING
    version: torch.autograd._unsafe_preserve_version_counter | None = None  # in_place, GATHERING
    # the partial copy, (copy rows * numel,) in the compute dtype: [Note: a partial copy on the executor] in
    # partial_copy.py; kept across frees like ``full``, its storage resized to zero
    partial: torch.Tensor | None = None

    @property
    def by_leaf(self) -> bool:
        """Whether the part is gathered in place with one collective per leaf (``Capabilities.gathers_leaf_by_leaf``)."""
        return self.in_place and len(self.layout.slots) > 1 and not self.layout.flat

    @property
    def full_numel(self) -> int:
        """Elements of all full leaves of this part (a flat part's: its gathered concatenation)."""
        sharding = self.layout.slots[0].sharding if self.layout.slots else None
        if isinstance(sharding, FlatSharding):
            return self.layout.numel * sharding.group_size  # the end padding included
        return sum(math.prod(s.shape) for s in self.layout.slots)

    def free(self, unit: str, /) -> None:
        """Gives the gathered storage's bytes back (resized to zero, kept for the next gather); mutates.

        Raises:
            RuntimeError: code outside torch holds the memory (numpy), naming the unit and the fix.
        """
        assert self.full is not None
        try:
            self.full.untyped_storage().resize_(0)
        except RuntimeError as e:
            if "not resizable" not in str(e):
                raise
            raise RuntimeError(
                f"unit {unit!r}: its gathered parameters cannot be freed, because code outside "
                f"torch holds their memory: w.detach().numpy() or np.asarray(w) of a parameter "
                f"in forward shares it with numpy. Fix: copy it out (w.detach().numpy().copy(), "
                f"w.tolist()) before numpy uses it"
            ) from None

    @property
    def full_bytes(self) -> int:
        """Bytes of this part's gathered storage (none of its own when aliased)."""
        return 0 if self.aliased else self.full_numel * self.compute_dtype.itemsize
