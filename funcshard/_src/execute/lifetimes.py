"""What a release keeps past a call: a unit's gathered storage, or its partial copy.

A release frees a unit's gathered storage unless the unit keeps it for the step's
next micro-batch (``shard_optimizer``; [Note: shard_optimizer] in
``plan/strategy.py``), and frees its partial copy unless backward still needs it
(the release at the end of a call's forward) or the unit keeps it for the step
(``hybrid_shard_optimizer``; [Note: partial copies] there). The step's last
micro-batch keeps nothing: shards change at the update, so nothing gathered from
them may outlive the step. ``Run`` asks here at every release.
"""

from __future__ import annotations

from funcshard._src.execute.unit_state import UnitRuntime


def keeps_gathered(unit: UnitRuntime, /, *, last: bool) -> bool:
    """Whether a release of ``unit`` leaves it gathered, for the step's next micro-batch."""
    return not last and unit.keeps_for_step


def keeps_partial(
    unit: UnitRuntime, /, *, after_forward: bool, evaluation: bool, last: bool
) -> bool:
    """Whether a release of ``unit`` keeps its partial copy: for its backward, or for the step's next micro-batch."""
    return (after_forward and not evaluation) or (not last and unit.partial.for_step)
