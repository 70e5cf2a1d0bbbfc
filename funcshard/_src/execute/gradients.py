"""A step's gradients without communication: accumulation across micro-batches, the gradient tree, donation.

[Note: gradients without communication]
What happens to gradients on this rank alone, before and after their
collectives, lives here; the reductions themselves are the parameter group's
(``param_group.py``) and the order they run in the ``Reducer``'s
(``param_group.py``). This module imports nothing from ``comm/``.

- **Accumulation.** A reduced gradient of a :class:`FlatLayout` becomes its
  buffer as it is (cast to the stored dtype if need be); a later one for the same
  layout (a unit called twice, or another micro-batch) is added into it
  (:meth:`Gradients.add`). Gradients kept whole across micro-batches
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
  the reduction of its layout, which writes into it instead of fresh memory
  ([Note: donation] in ``shard/sharded.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from funcshard._src import tree
from funcshard._src.shard.flat import FlatLayout
from funcshard._src.shard.sharded import FlatShard, ShardedTensor, concatenate_leaves, held_leaves


class Gradients:
    """One call's gradients on this rank, by :class:`FlatLayout`; per-call state, never kept across calls."""

    def __init__(
        self, *, spares: dict[FlatLayout, torch.Tensor], hold_leaves: bool = False
    ) -> None:
        # one micro-batch: a part that needs no communication keeps its gradients as
        # autograd made them, see [Note: gradients held as leaves] in shard/sharded.py
        self.hold_leaves = hold_leaves
        self.held: dict[FlatLayout, tuple[torch.Tensor, ...]] = {}  # the result of those parts
        self.spares = spares  # donated buffers of the last call, by layout
        self.sums: dict[FlatLayout, torch.Tensor] = {}  # the result, in the stored dtype
        self.kept: dict[FlatLayout, torch.Tensor] = {}  # packed, (group_size, numel)

    def keep_as_leaves(
        self, layout: FlatLayout, grads: Sequence[torch.Tensor | None], device: torch.device, /
    ) -> bool:
        """Keeps ``grads`` as they are for ``layout``; whether they were (else they are to be reduced); mutates.

        A second call of the unit turns what the first held into a buffer, to which
        this call's gradients are then added: ``False``.
        """
        if layout in self.sums:
            return False
        earlier = self.held.pop(layout, None)
        if earlier is None:
            self.held[layout] = held_leaves(layout, grads, device)
            return True
        self.sums[layout] = concatenate_leaves(layout, earlier)  # a unit called twice
        return False

    def spare(self, layout: FlatLayout, dtype: torch.dtype, /) -> torch.Tensor | None:
        """The buffer the last call donated for ``layout``, if it holds ``dtype``; mutates (taken)."""
        spare = self.spares.pop(layout, None)
        return spare if spare is not None and spare.dtype == dtype else None

    def drop_spare(self, layout: FlatLayout, /) -> None:
        """Forgets the donated buffer of ``layout`` (a bucket reduces into one buffer of its own); mutates."""
        self.spares.pop(layout, None)

    def keep(self, layout: FlatLayout, rows: torch.Tensor, /) -> None:
        """Keeps packed rows of ``layout`` for a later call to add to its own; mutates."""
        self.kept[layout] = rows

    def take_kept(self, layout: FlatLayout, /) -> torch.Tensor | None:
        """The packed rows earlier calls kept for ``layout``, taken; ``None`` if none; mutates."""
        return self.kept.pop(layout, None)

    def keeps(self, layout: FlatLayout, /) -> bool:
        """Whether packed rows of ``layout`` are kept."""
        return layout in self.kept

    def add(self, layout: FlatLayout, reduced: torch.Tensor, /) -> None:
        """Adds a reduced gradient of ``layout``; the first becomes its buffer as it is; mutates.

        No zero-filled buffer and no extra pass: cast to the stored dtype if need be.
        """
        out = reduced if reduced.dtype == layout.dtype else reduced.to(layout.dtype)
        if layout in self.sums:
            self.sums[layout].add_(out)
        else:
            self.sums[layout] = out

    def tree(
        self, sparams: Any, by_unit: dict[str, list[FlatShard]], /, *, micro_batches: int
    ) -> Any:
        """The sharded gradients of ``sparams``, the mean over ``micro_batches`` (``None`` at frozen leaves)."""
        grads, held = self.sums, self.held
        if micro_batches > 1:
            floating = [g for g in grads.values() if g.is_floating_point()]
            torch._foreach_mul_(floating, 1.0 / micro_batches)
        new: dict[FlatShard, FlatShard] = {}
        for flats in by_unit.values():
            for flat in flats:
                layout = flat.layout
                if layout.frozen:
                    continue
                if layout in held:
                    new[flat] = FlatShard.of_leaves(layout, held[layout], flat.rank)
                    continue
                if layout not in grads:  # a part no reduction reached: integer leaves
                    grads[layout] = torch.zeros_like(flat.data)
                new[flat] = flat.with_data(grads[layout])
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


def take_donated(last: Sequence[FlatShard], /) -> dict[FlatLayout, torch.Tensor]:
    """The buffers of the gradients a call returned last, for this call's; see [Note: donation] in ``shard/sharded.py``.

    Mutates ``last``'s shards: the tree is donated, and reading it raises.
    """
    donated = {flat.layout: flat.donate() for flat in last if not flat.donated}
    return {layout: data for layout, data in donated.items() if data is not None}
