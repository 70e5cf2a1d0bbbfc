"""Catching ranks that run different things before their collectives pair wrongly.

A step agrees with every rank (see [Note: agreements] in ``comm/channel.py``)
at its start, on everything that decides its sequence of collectives: the
plan, the params' tree structure, mixed precision, prefetch, how many
micro-batches it accumulates and the order in which the last step called its
units (which decides the prefetches). It agrees again after forward, on the
units called and the collectives issued, and after backward, on the
collectives issued; and before each call that does not follow the last
step's order. Ranks that differ raise :class:`DesyncError` naming the ranks
and the fields that differ, instead of deadlocking or trading the wrong bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from funcshard._src.comm import agree, channel, settle
from funcshard._src.comm.channel import Kind
from funcshard._src.comm.collectives import Pending
from funcshard._src.plan.precision import MixedPrecision

_SAME_PLAN = (
    "Every rank must build the same plan from the same params tree (same rules, units, "
    "strategy and mesh) and call the step with the same options"
)
_SAME_CALLS = (
    "Every rank must call the same units in the same order in every step: a branch that "
    "depends on a rank's data (skipping a unit, stopping early) has to take the same way on "
    "every rank"
)


def signature(
    fingerprint: str,
    /,
    *,
    mixed_precision: MixedPrecision,
    prefetch: int,
    accumulation: str,
    order: Sequence[str],
) -> dict[str, str]:
    """What must be equal on every rank at the start of a step.

    The params' tree structure is the plan's (the step checked it), which the
    plan's ``fingerprint`` covers.
    """
    return {
        "plan fingerprint": fingerprint,
        "mixed precision": repr(mixed_precision),
        "prefetch": str(prefetch),
        "accumulation": accumulation,
        "units called in the last step": _short("|".join(order)),
    }


def check_start(fields: dict[str, str], /) -> None:
    """Agrees on :func:`signature` with every rank; collective.

    Raises:
        DesyncError: a rank differs; the message lists each such rank and field.
    """
    agree.agree_on(Kind.STEP, "the start of a step", fields, hint=_SAME_PLAN)


def check_call(index: int, unit: str, /) -> None:
    """Agrees that every rank's call ``index`` is of ``unit``, before gathering it; collective."""
    agree.agree_on(Kind.CALL, f"call #{index} of the step", {"unit called": unit}, hint=_SAME_CALLS)


def check_backward(index: int, unit: str, skipped: Sequence[int], /) -> None:
    """Agrees that every rank's backward reaches call ``index`` passing over the same calls."""
    agree.agree_on(
        Kind.BACKWARD,
        f"the backward of call #{index} (unit {unit!r})",
        {"calls whose backward has not run": list(skipped)},
        hint="Every rank's loss must depend on the same unit calls",
    )


def check_reduction(index: int, unit: str, later: Sequence[int], /) -> None:
    """Agrees before reducing call ``index`` while the backward of ``later`` calls has begun."""
    agree.agree_on(
        Kind.BACKWARD,
        f"the reduction of call #{index} (unit {unit!r})",
        {"calls whose backward began and has not reduced": list(later)},
        hint="Every rank's loss must depend on the same parameters of the same unit calls",
    )


def check_unreached(indices: Sequence[int], /) -> None:
    """Agrees on the calls whose backward never ran (their gradients are zero) before reducing them."""
    agree.agree_on(
        Kind.BACKWARD,
        "the calls no gradient reached",
        {"calls": list(indices)},
        hint="Every rank's loss must depend on the same parameters of the same unit calls",
    )


def start_forward_check(calls: Sequence[str], /) -> agree.Agreement:
    """Starts agreeing on the units called in forward and the collectives issued; collective.

    Backward may compute while it is in flight; :meth:`Agreement.finish` must run
    before backward's first collective (see [Note: collective order] in ``run.py``).
    """
    return agree.start(
        Kind.FORWARD,
        "the end of forward",
        {
            "units called": f"{len(calls)} calls, digest {_short('|'.join(calls))}",
            "collectives issued": channel.trace_digest().hex(),
        },
        hint=_SAME_CALLS,
    )


def check_end() -> None:
    """Agrees on the collectives issued by the end of backward; collective."""
    agree.agree_on(
        Kind.END,
        "the end of backward",
        {"collectives issued": channel.trace_digest().hex()},
        hint="Every rank's loss must depend on the same unit calls and the same parameters",
    )


def _short(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def settle_after_error(inflight: list[Pending], error: BaseException) -> None:
    """After ``error`` in a step: drains the collectives in flight if every rank gave up alike.

    See [Note: out of step] in ``comm/settle.py``: otherwise this process is out
    of step and the collectives in flight are left to the process group.
    """
    if not settle.abort_exchange("a step", error):
        return
    for pending in inflight:
        try:
            pending.wait()
        except Exception as e:  # pending.wait marked this process out of step
            error.add_note(f"funcshard: after the error, a collective in flight failed too: {e}")
            return
