"""Learning-rate schedules: functions of the number of earlier updates, with optax's names and numerics.

Each returns a ``schedule(count) -> float`` to pass as ``lr=`` to an optimizer;
``count`` is the number of updates applied before this one (0 for the first), as
optax's ``state.count``. The values are optax's in float64 (optax computes in the
dtype of its arguments, float32 under JAX's default).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from funcshard._src.optim.base import Schedule, check_hyperparameter


def constant_schedule(value: float, /) -> Schedule:
    """``value`` for every update.

    Example:
        >>> constant_schedule(3e-4)(10)
        0.0003
    """
    check_hyperparameter("constant_schedule: value", value, low=0)
    return lambda count: float(value)


def linear_schedule(
    init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0
) -> Schedule:
    """From ``init_value`` to ``end_value`` linearly over ``transition_steps`` updates after
    ``transition_begin``; ``end_value`` after, ``init_value`` before (``optax.linear_schedule``).

    Example:
        >>> s = linear_schedule(0.0, 1.0, transition_steps=4)
        >>> [s(n) for n in range(6)]
        [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    """
    _check_steps("linear_schedule", transition_steps=transition_steps, low=0)
    _check_steps("linear_schedule", transition_begin=transition_begin, low=0)
    if transition_steps == 0:  # as optax: the initial value throughout
        return lambda count: float(init_value)

    def schedule(count: int) -> float:
        done = min(max(count - transition_begin, 0), transition_steps)
        frac = 1 - done / transition_steps
        return (init_value - end_value) * frac + end_value

    return schedule


def cosine_decay_schedule(
    init_value: float, decay_steps: int, alpha: float = 0.0, exponent: float = 1.0
) -> Schedule:
    """``init_value`` decayed along half a cosine to ``alpha * init_value`` over ``decay_steps``
    updates, then held (``optax.cosine_decay_schedule``).

    Example:
        >>> s = cosine_decay_schedule(1.0, decay_steps=4)
        >>> [round(s(n), 4) for n in range(6)]
        [1.0, 0.8536, 0.5, 0.1464, 0.0, 0.0]
    """
    _check_steps("cosine_decay_schedule", decay_steps=decay_steps, low=1)

    def schedule(count: int) -> float:
        done = min(count, decay_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * done / decay_steps))
        return init_value * ((1 - alpha) * cosine**exponent + alpha)

    return schedule


def warmup_cosine_decay_schedule(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
    exponent: float = 1.0,
) -> Schedule:
    """Linear warm-up from ``init_value`` to ``peak_value`` over ``warmup_steps``, then a cosine
    decay to ``end_value`` at ``decay_steps`` (counted from the start, warm-up included), as
    ``optax.warmup_cosine_decay_schedule``.

    Example:
        >>> s = warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=2, decay_steps=6)
        >>> [round(s(n), 4) for n in range(8)]
        [0.0, 0.5, 1.0, 0.8536, 0.5, 0.1464, 0.0, 0.0]
    """
    _check_steps("warmup_cosine_decay_schedule", warmup_steps=warmup_steps, low=0)
    if decay_steps <= warmup_steps:
        raise ValueError(
            f"warmup_cosine_decay_schedule: decay_steps ({decay_steps}) counts the warm-up too and "
            f"must exceed warmup_steps ({warmup_steps})"
        )
    alpha = 0.0 if peak_value == 0 else end_value / peak_value
    return join_schedules(
        [
            linear_schedule(init_value, peak_value, warmup_steps),
            cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha, exponent),
        ],
        [warmup_steps],
    )


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int], /) -> Schedule:
    """``schedules[i]`` from ``boundaries[i - 1]`` on, each counting from its own start
    (``optax.join_schedules``).

    Example:
        >>> s = join_schedules([constant_schedule(1.0), linear_schedule(1.0, 0.0, 2)], [3])
        >>> [s(n) for n in range(6)]
        [1.0, 1.0, 1.0, 1.0, 0.5, 0.0]
    """
    if len(schedules) != len(boundaries) + 1:
        raise ValueError(
            f"join_schedules: {len(schedules)} schedules need {len(schedules) - 1} boundaries, "
            f"got {len(boundaries)}"
        )
    if any(not callable(s) for s in schedules):
        raise TypeError("join_schedules: every schedule must be a function of the update count")
    bounds = list(boundaries)
    bad = [b for b in bounds if isinstance(b, bool) or not isinstance(b, int)]
    if bad:  # int() would truncate 2.5 to 2: a schedule switched one update early
        raise ValueError(
            f"join_schedules: boundaries are update counts, integers; got {bad[:3]!r} in "
            f"{bounds!r}: round them yourself (say int(0.1 * total_steps))"
        )
    if any(b < 0 for b in bounds) or bounds != sorted(bounds):
        raise ValueError(f"join_schedules: boundaries must be >= 0 and ascending, got {bounds}")

    def schedule(count: int) -> float:
        value = float(schedules[0](count))
        for boundary, later in zip(bounds, schedules[1:]):
            if count >= boundary:
                value = float(later(count - boundary))
        return value

    return schedule


def _check_steps(where: str, /, *, low: int, **steps: int) -> None:
    for name, value in steps.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{where}: {name} must be an int >= {low}, got {value!r}")
