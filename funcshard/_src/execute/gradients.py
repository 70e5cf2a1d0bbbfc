"""A step's gradients without communication: accumulation across micro-batches, the gradient tree, donation.

[Note: gradients without communication]
What happens to gradients on this rank alone, before and after their
collectives, lives here; the reductions themselves, and the order they run in,
are the parameter group's and its ``Reducer``'s (``param_group.py``). This
module imports nothing from ``comm/``.

- **Accumulation.** A reduced gradient of a part (one unit's buffer of one
  dtype, :class:`PartKey`, kept by identity) becomes its buffer as it is (cast to
  the stored dtype if need be); a later one for the same part (a unit called
  twice, or another micro-batch) is added into it (:meth:`Gradients.add`). Gradients kept whole across micro-batches
  (``mode="unsharded"``, a ``shard_optimizer`` unit) are packed rows held here
  (:meth:`Gradients.keep`) until a later call adds them to its own and reduces
  them once (:meth:`Gradients.take_kept`).
- **Held leaves.** A part that needs no communication, in a call of one
  micro-batch, keeps autograd's own gradient tensors (:meth:`Gradients.keep_as_leaves`;
  [Note: gradients held as leaves] in ``shard/sharded.py``).
- **The tree.** :meth:`Gradients.tree` wraps the buffers as the sharded
  gradients of ``sparams``, the mean over the micro-batches, ``None`` at frozen
  leaves.
- **Donation.** :func:`take_donated` takes the buffers of the tree a call
  returned last (the tree is then dead), and :meth:`Gradients.spare` hands one to
  the reduction of its part, which writes into it instead of fresh memory
  ([Note: donation] in ``shard/sharded.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from funcshard._src import tree
from funcshard._src.shard.flat import FlatLayout
from funcshard._src.shard.sharded import FlatShard, ShardedTensor, concatenate_leaves, held_leaves


class PartKey(Protocol):
    """What gradients are kept by: one unit's buffer of one dtype (the executor's ``unit_state.Part``), by identity."""

    @property
    def layout(self) -> FlatLayout: ...


class Gradients:
    """One call's gradients on this rank, by part (:class:`PartKey`); per-call state, never kept across calls."""

    def __init__(self, *, spares: dict[PartKey, torch.Tensor], hold_leaves: bool = False) -> None:
        # one micro-batch: a part that needs no communication keeps its gradients as
        # autograd made them, see [Note: gradients held as leaves] in shard/sharded.py
        self.hold_leaves = hold_leaves
        self.held: dict[PartKey, tuple[torch.Tensor, ...]] = {}  # the result of those parts
        self.spares = spares  # donated buffers of the last call
        self.sums: dict[PartKey, torch.Tensor] = {}  # the result, in the stored dtype
        self.kept: dict[PartKey, torch.Tensor] = {}  # packed, (group_size, numel)
        # the gradient shards :meth:`tree` returned, by part: what the next call may take donated
        self.returned: list[tuple[PartKey, FlatShard]] = []

    def keep_as_leaves(
        self, part: PartKey, grads: Sequence[torch.Tensor | None], device: torch.device, /
    ) -> bool:
        """Keeps ``grads`` as they are for ``part``; whether they were (else they are to be reduced); mutates.

        A second call of the unit turns what the first held into a buffer, to which
        this call's gradients are then added: ``False``.
        """
        if part in self.sums:
            return False
        earlier = self.held.pop(part, None)
        if earlier is None:
            self.held[part] = held_leaves(part.layout, grads, device)
            return True
        self.sums[part] = concatenate_leaves(part.layout, earlier)  # a unit called twice
        return False

    def spare(self, part: PartKey, dtype: torch.dtype, /) -> torch.Tensor | None:
        """The buffer the last call donated for ``part``, if it holds ``dtype``; mutates (taken)."""
        spare = self.spares.pop(part, None)
        return spare if spare is not None and spare.dtype == dtype else None

    def drop_spare(self, part: PartKey, /) -> None:
        """Forgets the donated buffer of ``part`` (a bucket reduces into one buffer of its own); mutates."""
        self.spares.pop(part, None)

    def keep(self, part: PartKey, rows: torch.Tensor, /) -> None:
        """Keeps packed rows of ``part`` for a later call to add to its own; mutates."""
        self.kept[part] = rows

    def take_kept(self, part: PartKey, /) -> torch.Tensor | None:
        """The packed rows earlier calls kept for ``part``, taken; ``None`` if none; mutates."""
        return self.kept.pop(part, None)

    def keeps(self, part: PartKey, /) -> bool:
        """Whether packed rows of ``part`` are kept."""
        return part in self.kept

    def add(self, part: PartKey, reduced: torch.Tensor, /) -> None:
        """Adds a reduced gradient of ``part``; the first becomes its buffer as it is; mutates.

        No zero-filled buffer and no extra pass: cast to the stored dtype if need be.
        """
        dtype = part.layout.dtype
        out = reduced if reduced.dtype == dtype else reduced.to(dtype)
        if part in self.sums:
            self.sums[part].add_(out)
        else:
            self.sums[part] = out

    def tree(
        self, sparams: Any, shards: Sequence[tuple[PartKey, FlatShard]], /, *, micro_batches: int
    ) -> Any:
        """The sharded gradients of ``sparams`` (whose flat shards are ``shards``, by part), the mean over ``micro_batches`` (``None`` at frozen leaves); mutates (:attr:`returned`)."""
        grads, held = self.sums, self.held
        if micro_batches > 1:
            floating = [g for g in grads.values() if g.is_floating_point()]
            torch._foreach_mul_(floating, 1.0 / micro_batches)
        new: dict[FlatShard, FlatShard] = {}
        for part, flat in shards:
            layout = flat.layout
            if layout.frozen:
                continue
            if part in held:
                new[flat] = FlatShard.of_leaves(layout, held[part], flat.rank)
            else:
                if part not in grads:  # a part no reduction reached: integer leaves
                    grads[part] = torch.zeros_like(flat.data)
                new[flat] = flat.with_data(grads[part])
            self.returned.append((part, new[flat]))
        # map_flats(..., trainable(sparams)) in one pass: None at frozen leaves
        leaves, treedef = tree.flatten(sparams)
        return tree.unflatten(
            treedef,
            [
                (None if x.flat.layout.frozen else ShardedTensor(new[x.flat], x.slot))
                if isinstance(x, ShardedTensor)
                else x
                for x in leaves
            ],
        )

    def clear(self) -> None:
        """After an error: forgets everything; mutates."""
        self.kept.clear()
        self.held.clear()


def take_donated(last: Sequence[tuple[PartKey, FlatShard]], /) -> dict[PartKey, torch.Tensor]:
    """The buffers of the gradients a call returned last (:attr:`Gradients.returned`), for this call's, by part; see [Note: donation] in ``shard/sharded.py``.

    Mutates ``last``'s shards: the tree is donated, and reading it raises.
    """
    donated = {part: flat.donate() for part, flat in last if not flat.donated}
    return {part: data for part, data in donated.items() if data is not None}
