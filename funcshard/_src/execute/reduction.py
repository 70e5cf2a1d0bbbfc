"""A reduction in flight: which gradients it carries and what it still holds.

A gather group (``gather_group.py``) starts every reduction and waits for it
(:meth:`GatherGroup.wait`); the ``Reducer`` keeps them in order and turns their
results into gradients. This module is only the record the two pass between them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from funcshard._src.comm.pending import Pending
from funcshard._src.shard.flat import FlatLayout


@dataclass(eq=False)
class Reduction:
    """One part's reduction in flight (or a bucket's round of it).

    ``pieces`` says whose gradient each ``[start, stop)`` of the result is: one
    piece for one unit's part, one per member for a bucket. With ``per_piece``
    (a bucket), the all-reduce across replicas is counted in the ledger per
    piece, as the cost model counts it per unit.
    """

    pieces: tuple[tuple[FlatLayout, int, int], ...]
    stage: Pending
    then_all_reduce: tuple[str, ...]
    tag: str
    staging: torch.Tensor | None  # the packed input, for the pool once the stage is done
    per_piece: bool = False
    packed: bool = True  # holds packed gradients beside its result (not an all-reduce in place)
    # the first hop of a two-hop reduction: its result is summed into a partial gradient,
    # see [Note: two-hop reductions] in partial_gradient.py
    first_hop: bool = False
    # the unit's last first hop of the step: the second starts once it is in
    then_across: bool = False
    partial_bytes: int = 0  # a second hop: the bytes of the partial gradient it reduces
