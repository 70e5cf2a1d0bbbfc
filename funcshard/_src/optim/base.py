"""The optimizer contract: ``init(sparams) -> state`` and ``update_(grads, state, sparams)``, in place.

Optimizers work on the flat buffers behind sharded trees: one foreach op per
step over every unit's flat shard, never a Python loop over leaves. Where
optax's ``update`` returns updates for ``optax.apply_updates``, ``update_`` is
both in one, in place (the trailing underscore says so, as in ``torch.add_``):
it writes the new parameters and state into the buffers of ``sparams`` and
``state`` and returns those trees; ``grads`` are only read, except by gradient
transforms (``clip_by_global_norm(max_norm)`` in a ``chain``), which scale
them in place for the elements after them.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, TypeAlias

import torch

from funcshard._src.shard.flat_shard import FlatShard
from funcshard._src.shard.sharded import flats_of, map_flats, trainable

Params: TypeAlias = Any  # a sharded pytree (leaves: ShardedTensor)
Updates: TypeAlias = Any  # gradients, sharded like the params
OptState: TypeAlias = Any
Schedule: TypeAlias = Callable[[int], float]
LearningRate: TypeAlias = "float | Schedule"


class InitFn(Protocol):
    """Builds the optimizer state for sharded params."""

    def __call__(self, sparams: Params, /) -> OptState: ...


class UpdateFn(Protocol):
    """Applies one update in place: writes into and returns ``sparams`` and ``state``; reads ``grads``."""

    def __call__(
        self, grads: Updates, state: OptState, sparams: Params, /
    ) -> tuple[Params, OptState]: ...


class Optimizer(NamedTuple):
    """A functional optimizer: ``init`` builds its state, ``update_`` applies one update in place."""

    init: InitFn
    update_: UpdateFn

    @property
    def update(self) -> UpdateFn:
        """Deprecated: ``update_``, whose name says that it updates in place."""
        warnings.warn(
            "Optimizer.update is now Optimizer.update_ (it updates params and state in place); "
            "the old name goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.update_


def learning_rate(lr: LearningRate, count: int, /) -> float:
    """The learning rate for the update after ``count`` earlier updates.

    Raises:
        ValueError: the rate (or what the schedule returns for ``count``) is not a
            finite number >= 0.
    """
    if not callable(lr):
        return check_learning_rate(lr)
    value = lr(count)
    try:
        return check_learning_rate(value)
    except ValueError:
        raise ValueError(
            f"the learning-rate schedule returned {value!r} for update {count}; a learning rate "
            f"must be a finite number >= 0"
        ) from None


def check_learning_rate(lr: object, /) -> float:
    """``lr`` as a float if it is a finite number >= 0, or a schedule (returned as it is).

    Raises:
        ValueError: a negative, NaN or infinite rate, or something that is not a number.

    Example:
        >>> check_learning_rate(3e-4)
        0.0003
    """
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (0 <= lr < math.inf):
        raise ValueError(
            f"learning rate {lr!r}: give a finite number >= 0 or a schedule lr(count) -> float"
        )
    return float(lr)


def check_hyperparameter(name: str, value: float, /, *, low: float, high: float = math.inf) -> None:
    """Raises ``ValueError`` unless ``low <= value < high`` (NaN never passes)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (low <= value < high):
        bound = f"in [{low}, {high})" if high != math.inf else f">= {low}"
        raise ValueError(f"{name} must be a number {bound}, got {value!r}")


def zeros_like_tree(sparams: Params, /) -> Any:
    """A sharded tree like ``sparams`` whose flat buffers are new zeros (state buffers).

    Frozen leaves have no state: ``None`` there, as in the gradients.
    """
    return map_flats(lambda flat: flat.with_data(torch.zeros_like(flat.data)), trainable(sparams))


def floating_flats(
    *trees: Any, names: Sequence[str], split_by: int | None = None
) -> list[list[torch.Tensor]]:
    """For each tree, the data of its trainable floating-point flat buffers, aligned across trees.

    Frozen buffers are left out: they have no gradient and no state. With
    ``split_by``, where that tree's flat shard is held as leaves (gradients of a
    one-rank group, see [Note: gradients held as leaves] in ``shard/flat_shard.py``),
    its leaves come as they are and every other tree's buffer as views of the same
    leaves (made once per buffer): for elementwise updates, which then read no
    concatenated copy.

    Raises:
        ValueError: the trees do not hold flat buffers of the same layouts (e.g. grads
            of another plan); ``names`` name the trees in the message.
    """
    per_tree = [[f for f in flats_of(t) if not f.layout.frozen] for t in trees]
    first = per_tree[0]
    for name, flats in zip(names[1:], per_tree[1:]):
        if len(flats) != len(first) or any(not _same_layout(a, b) for a, b in zip(first, flats)):
            raise ValueError(
                f"{name} is not sharded like {names[0]} (different units, dtypes or plan); pass "
                f"trees from the same plan, e.g. grads from the step of the plan that sharded the params"
            )
    keep = [i for i, flat in enumerate(first) if flat.layout.dtype.is_floating_point]
    out: list[list[torch.Tensor]] = [[] for _ in per_tree]
    for i in keep:
        held = None if split_by is None else per_tree[split_by][i].leaves
        for k, (tensors, flats) in enumerate(zip(out, per_tree)):
            if held is None:
                tensors.append(flats[i].data)
            elif k == split_by:
                tensors.extend(held)
            else:
                tensors.extend(flats[i].whole_leaves())
    return out


def _same_layout(a: FlatShard, b: FlatShard) -> bool:
    return a.layout is b.layout or a.layout == b.layout


def refuse_flat(sparams: Any, who: str, why: str, /) -> None:
    """Raises for a tree with a unit in the flat layout, for optimizers that need boxes of leaves.

    Raises:
        ValueError: naming the unit, ``why`` the optimizer needs rows and columns, and the fix.
    """
    unit = next((f.layout.unit for f in flats_of(sparams) if f.layout.flat), None)
    if unit is not None:
        raise ValueError(
            f"{who}: unit {unit!r} is in the flat layout, where a rank holds a range of each "
            f"leaf's elements; {why}, so plan it with layout='leaf' (the default)"
        )
