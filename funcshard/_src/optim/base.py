"""The optimizer contract: ``init(sparams) -> state`` and ``update_(grads, state, sparams)``, in place.

Optimizers work on the flat buffers behind sharded trees: one foreach op per
step over every unit's flat shard, never a Python loop over leaves. Where
optax's ``update`` returns updates for ``optax.apply_updates``, ``update_`` is
both in one, in place (the trailing underscore says so, as in ``torch.add_``):
it writes the new parameters and state into the buffers of ``sparams`` and
``state`` and returns those trees; ``grads`` are only read. A gradient
:class:`Transform` (``clip_by_global_norm(max_norm)``) writes the gradients it
is given, and a ``chain`` gives it a copy, so the caller's gradients are never
written; only a part whose name ends in ``_`` (``clip_by_global_norm_``) writes them.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol, TypeAlias

import torch

from funcshard._src.shard.sharded import FlatShard, flats_of, map_flats, trainable

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


class Transform(Optimizer):
    """A gradient transform: an :class:`Optimizer` whose ``update_`` writes into the gradients it is given.

    It leaves the params alone and scales (or otherwise rewrites) the gradients
    for the elements after it in a :func:`funcshard.optim.chain`. The chain hands
    it a copy of the caller's gradients, made once per update before the first
    transform, so the tree the caller passed is never written (see
    [Note: donation] in ``shard/sharded.py``). A transform whose name ends in
    ``_`` (``clip_by_global_norm_(1.0)``) is a plain :class:`Optimizer` instead:
    the chain gives it the caller's gradients, which it writes, as its name says.
    """

    __slots__ = ()


_SKIP: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar(
    "funcshard_optim_skip", default=None
)


def skip_flag() -> torch.Tensor | None:
    """The device flag an update in progress is skipped by (1.0: skip), or ``None`` outside one.

    [Note: skipping on the device]
    ``skip_nonfinite`` decides on the host (one read of a flag per update) unless
    every part it guards can skip on the device (:func:`can_skip_on_device`):
    then it sets the flag (a 0-d float32, 1.0 where some gradient on some rank is
    NaN or Inf) for the duration of their updates, and each leaves its params,
    state and the caller's gradients as they were where the flag is 1 (the fused
    AdamW kernel's ``found_inf``; ``torch.where`` on small state), with no host read.
    """
    return _SKIP.get()


@contextlib.contextmanager
def skipping_when(flag: torch.Tensor, /) -> Iterator[None]:
    """Runs the updates inside with ``flag`` as :func:`skip_flag`."""
    token = _SKIP.set(flag)
    try:
        yield
    finally:
        _SKIP.reset(token)


def can_skip_on_device(update: Any, /) -> Any:
    """Marks an ``update_`` as honouring :func:`skip_flag` (see [Note: skipping on the device]); returns it."""
    update.skips_on_device = True
    return update


def skips_on_device(part: Any, /) -> bool:
    """Whether ``part``'s ``update_`` honours :func:`skip_flag`."""
    return bool(getattr(getattr(part, "update_", None), "skips_on_device", False))


class HostCount:
    """What a 0-d update count on the device holds, known on the host without reading the device.

    [Note: update counts on the device]
    An optimizer's ``state.count`` lives on the params' device, and the update
    reads nothing back from it: the fused kernels take their step from the
    tensor itself, and what the host needs (a schedule's learning rate, the
    bias corrections of the foreach path) comes from this mirror, which knows
    the value because it made the tensor at ``init`` or advanced it in the last
    update. It reads the tensor (one host sync) only for a count it does not
    know: one it did not make or advance, or one written since (its version
    counter moved), as after a checkpoint is loaded into the state.
    """

    def __init__(self) -> None:
        self._tensor: weakref.ref[torch.Tensor] | None = None
        self._version = -1
        self._value = 0

    def made(self, count: torch.Tensor, /) -> torch.Tensor:
        """Records ``count`` (a new 0-d integer tensor, zero) as known; returns it."""
        self._remember(count, 0)
        return count

    def read(self, count: torch.Tensor, /) -> int:
        """The value of ``count``: from the mirror when it is the count last seen here, unwritten since."""
        known = self._tensor() if self._tensor is not None else None
        if known is count and _version(count) == self._version:
            return self._value
        return int(count)  # a count this mirror did not make or advance: one host read

    def forget(self) -> None:
        """Forgets the count: an update advanced it by a value the host does not know (a skip flag)."""
        self._tensor = None

    def advance_(self, count: torch.Tensor, value: int, /) -> None:
        """Adds one to ``count`` in place (on its device) and remembers it holds ``value + 1``."""
        count.add_(1)
        self._remember(count, value + 1)

    def _remember(self, count: torch.Tensor, value: int) -> None:
        self._tensor, self._version, self._value = weakref.ref(count), _version(count), value


def _version(t: torch.Tensor) -> int:
    """``t``'s version counter (bumped by every in-place write); -2 where it has none."""
    try:
        return t._version
    except RuntimeError:  # an inference tensor tracks no version: never trusted
        return -2


def resolve_learning_rate(
    who: str, lr: LearningRate | None, learning_rate: LearningRate | None, /
) -> LearningRate:
    """The learning rate given as ``lr=`` (torch's name) or ``learning_rate=`` (optax's), checked.

    Raises:
        TypeError: both spellings, or neither, were given.
        ValueError: not a finite number >= 0 nor a schedule.
    """
    if lr is not None and learning_rate is not None:
        raise TypeError(
            f"{who}: the learning rate was given twice, as lr= (torch's name) and learning_rate= "
            f"(optax's); give one of them"
        )
    rate = lr if lr is not None else learning_rate
    if rate is None:
        raise TypeError(f"{who}: missing the learning rate: give lr= (or optax's learning_rate=)")
    if not callable(rate):
        check_learning_rate(rate)
    return rate


def resolve_betas(
    who: str,
    betas: tuple[float, float] | None,
    b1: float | None,
    b2: float | None,
    default: tuple[float, float],
    /,
) -> tuple[float, float]:
    """The moment decay rates given as ``betas=(b1, b2)`` (torch's name) or ``b1=``/``b2=`` (optax's).

    Raises:
        TypeError: both spellings were given.
    """
    if betas is not None and (b1 is not None or b2 is not None):
        raise TypeError(
            f"{who}: the decay rates were given twice, as betas= (torch's name) and b1=/b2= "
            f"(optax's); give one spelling"
        )
    if betas is not None:
        return betas
    return (default[0] if b1 is None else b1, default[1] if b2 is None else b2)


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


def device_of(sparams: Params, /) -> torch.device:
    """The device of ``sparams``'s flat buffers (the first one's), where a state's counters live; CPU if none."""
    flats = flats_of(sparams)
    return flats[0].held()[0].device if flats else torch.device("cpu")


def floating_flats(
    *trees: Any, names: Sequence[str], split_by: int | None = None
) -> list[list[torch.Tensor]]:
    """For each tree, the data of its trainable floating-point flat buffers, aligned across trees.

    Frozen buffers are left out: they have no gradient and no state. With
    ``split_by``, where that tree's flat shard is held as leaves (gradients of a
    one-rank group, see [Note: gradients held as leaves] in ``shard/sharded.py``),
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
