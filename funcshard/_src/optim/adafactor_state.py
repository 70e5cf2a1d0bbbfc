"""Adafactor's state on sharded leaves: the factored moments and the partial sums that move them.

See [Note: adafactor sums] in ``adafactor.py``: each rank writes its partial sums of
a leaf at its shard's index (:func:`moment_sums`), the optimizer sums them over the
mesh, and every rank moves the full row and column factors alike
(:func:`update_moments`). Leaves of fewer than two dims keep a sharded variance of
their own (:func:`vector_zeros`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import torch

from funcshard._src import tree
from funcshard._src.shard.flat import FlatLayout, Slot
from funcshard._src.shard.sharded import FlatShard, ShardedTensor, flats_of, trainable
from funcshard._src.spec.named_sharding import Index, NamedSharding


class Leaf(NamedTuple):
    """One trainable floating leaf and its state, as one rank sees them."""

    param: ShardedTensor
    grad: ShardedTensor
    row: torch.Tensor | None  # (..., R, 1), full
    col: torch.Tensor | None  # (..., 1, C), full
    variance: ShardedTensor | None
    index: Index  # this rank's slices of the leaf
    counted: bool  # replica 0: its partial sums count

    @property
    def factored(self) -> bool:
        return self.row is not None


def moment_sums(leaf: Leaf, out: torch.Tensor, /) -> None:
    """Writes this rank's partial sums of ``leaf`` into ``out``: ``|p|^2``, then the row and
    column sums of ``g * g`` at this shard's index (factored leaves); zeros unless ``counted``."""
    if not leaf.counted:
        return
    out[0] = leaf.param.local.norm(2).double().square()
    if leaf.factored:
        shape = leaf.param.shape
        batch, rows_n, cols_n = math.prod(shape[:-2]), shape[-2], shape[-1]
        rows = out[1 : 1 + batch * rows_n].view(*shape[:-2], rows_n, 1)
        cols = out[1 + batch * rows_n :].view(*shape[:-2], 1, cols_n)
        grad, index = leaf.grad.local, leaf.index
        # torch.norm(...).square(), as torch computes the means, squared exactly in float64
        rows[index[:-1]] = torch.norm(grad, dim=-1, keepdim=True).double().square()
        cols[(*index[:-2], slice(None), index[-1])] = (
            torch.norm(grad, dim=-2, keepdim=True).double().square()
        )


def update_moments(leaf: Leaf, sums: torch.Tensor, one_minus_beta2: float, /) -> None:
    """Moves the second moments of ``leaf`` towards this step's, from the summed ``sums``; mutates."""
    if leaf.row is not None and leaf.col is not None:
        shape = leaf.param.shape
        split = math.prod(shape[:-2]) * shape[-2]
        row_mean = sums[:split].view(leaf.row.shape).to(leaf.row.dtype).div_(shape[-1])
        leaf.row.lerp_(row_mean, one_minus_beta2)
        col_mean = sums[split:].view(leaf.col.shape).to(leaf.col.dtype).div_(shape[-2])
        leaf.col.lerp_(col_mean, one_minus_beta2)
    else:
        assert leaf.variance is not None
        grad = leaf.grad.local
        leaf.variance.local.lerp_(grad * grad, one_minus_beta2)


def leaves_of(grads: Any, state: Any, sparams: Any) -> list[Leaf]:
    """The trainable floating leaves of ``sparams`` with something to update, with their state.

    ``state`` is an ``AdafactorState`` (``adafactor.py``, where checkpoints name its type).
    """
    found: list[Leaf] = []

    def visit(param: Any, grad: Any, row: Any, col: Any, variance: Any) -> None:
        if not isinstance(param, ShardedTensor) or not param.dtype.is_floating_point:
            return
        factored = param.ndim >= 2
        expected = (
            factor_shape(param.shape, -1) if factored else None,
            factor_shape(param.shape, -2) if factored else None,
        )
        got = tuple(None if x is None else tuple(x.shape) for x in (row, col))
        if got != expected or (not factored) != isinstance(variance, ShardedTensor):
            raise ValueError(
                f"{param.path}: the Adafactor state does not fit this leaf of shape {param.shape}; "
                f"build it with this optimizer's init(sparams) for these params"
            )
        if math.prod(param.shape) == 0:
            return  # nothing to update (torch.optim.Adafactor divides by its size)
        index, counted = placement(param.slot, param.flat.rank)
        found.append(Leaf(param, grad, row, col, variance, index, counted))

    try:
        tree.tree_map(visit, trainable(sparams), grads, state.row, state.col, state.variance)
    except ValueError as e:
        if "Adafactor state" in str(e):
            raise
        raise ValueError(
            f"adafactor: grads or state are not structured like the trainable params ({e}); pass "
            f"grads from a step of the plan that sharded the params and the state of init(sparams)"
        ) from None
    return found


@functools.lru_cache(maxsize=4096)
def placement(slot: Slot, rank: int) -> tuple[Index, bool]:
    """``rank``'s slices of ``slot``'s leaf, and whether it holds replica 0 (whose sums count)."""
    sharding = slot.sharding
    assert isinstance(sharding, NamedSharding), "init refuses the flat layout"
    return sharding.local_index(slot.shape, rank), sharding.replica_id(rank) == 0


def factor_shape(shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
    out = list(shape)
    out[dim] = 1
    return tuple(out)


def factor_numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape[:-2]) * (shape[-2] + shape[-1])


def factor(param: Any, /, *, dim: int) -> torch.Tensor | None:
    """Zeros for the row (``dim=-1``) or column (``dim=-2``) factor of a leaf of two or more dims."""
    if not isinstance(param, ShardedTensor) or not param.dtype.is_floating_point or param.ndim < 2:
        return None
    return torch.zeros(factor_shape(param.shape, dim), dtype=param.dtype, device=param.device)


def vector_zeros(live: Any, /) -> Any:
    """Zero variances, sharded like the params, for the floating leaves of fewer than two dims.

    They get flat buffers of their own (per unit and dtype), holding only those leaves.
    """
    variance: dict[tuple[int, int], ShardedTensor] = {}
    for flat in flats_of(live):
        layout = flat.layout
        if layout.frozen or not layout.dtype.is_floating_point:
            continue
        slots: list[Slot] = []
        offset = 0
        for slot in layout.slots:
            if len(slot.shape) < 2:
                slots.append(
                    Slot(slot.index, slot.path, slot.shape, slot.sharding, slot.shard_shape, offset)
                )
                offset += slot.numel
        if not slots:
            continue
        own = FlatLayout(layout.unit, layout.dtype, layout.mesh, tuple(slots), offset)
        data = torch.zeros(offset, dtype=layout.dtype, device=flat.data.device)  # (numel,)
        shard = FlatShard(own, data, flat.rank)
        for slot in slots:
            variance[(id(flat), slot.index)] = ShardedTensor(shard, slot)
    return tree.tree_map(
        lambda p: (
            variance.get((id(p.flat), p.slot.index)) if isinstance(p, ShardedTensor) else None
        ),
        live,
    )
