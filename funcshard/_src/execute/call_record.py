"""One use of a unit in a step: its phase and what it holds.

``Run`` moves each :class:`CallRecord` through its :class:`CallPhase` s;
docs/executor.md draws them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from funcshard._src.execute.unit_state import UnitRuntime

__all__ = ["CallPhase", "CallRecord"]


class CallPhase(enum.Enum):
    """Where one use of a unit is in its step; it holds its unit gathered in FORWARD, KEPT and BACKWARD.

    [Note: a call's phase changes only in Run]
    Every transition of a call (``docs/executor.md`` draws them) is a method of ``Run``
    (``run.py``), the compiled path's included (``Run.exit_compiled_call``): no other
    module assigns ``CallRecord.phase``, which ``tests/test_layering.py`` checks.
    """

    FORWARD = "forward"  # running its function, unit held
    KEPT = "kept"  # forward done, unit held until backward (shard_grad_op, shard_optimizer, no_shard, the root)
    # forward done, unit released (full_shard, hybrid_shard, partial_reshard,
    # hybrid_shard_optimizer: those two keep a partial copy): re-gathered for backward
    WAITING = "waiting"
    BACKWARD = "backward"  # its backward began, unit held
    DONE = "done"  # its gradients went to the reducer, unit released

    @property
    def holds(self) -> bool:
        """Whether a call in this phase holds its unit gathered."""
        return self in (CallPhase.FORWARD, CallPhase.KEPT, CallPhase.BACKWARD)


@dataclass(eq=False)
class CallRecord:
    """One use of a unit in this forward (the root unit's is index -1)."""

    index: int
    unit: UnitRuntime
    phase: CallPhase = CallPhase.FORWARD
    expects_backward: bool = False  # outputs that require grad were hooked
    compiled: bool = False  # a compiled call: its gather op copied the leaves out and released
    # a local-only unit's call: the autograd leaves its function got, whose .grad
    # autograd fills; reduced by Run.finish. See [Note: local-only calls] in ``execute/local_calls.py``
    leaves: list[torch.Tensor] | None = None
