"""Replays: a unit's call run again in backward, by an activation checkpoint's recompute.

[Note: recomputes in backward]
An activation checkpoint around ``fs.call`` runs the call's function again in
backward, after the forward is done. That call is a replay, not a new call: it
takes the latest call of the unit whose gradients are not reduced yet, holds the
unit gathered for it (:func:`hold`: a released unit is re-gathered as that call's
backward would, so the ledger and the peak are those of the step without the
checkpoint), and hands the function the gathered leaves again through a
``GatherNode`` of its own (``call_record.py``). A non-reentrant checkpoint only
reads the tensors the recompute saves, so that node's backward never runs and the
call's own gather node reduces; a reentrant one differentiates the recomputed
graph, whose node then reduces the call's gradients (``Run.post_backward``). Every call of one unit in a step holds the
same values, so which call a replay stands for does not change what it computes.
"""

from __future__ import annotations

import torch

from funcshard._src.execute.call_record import CallPhase, CallRecord, GatherNode
from funcshard._src.execute.run import Run
from funcshard._src.execute.unit_state import UnitRuntime

__all__ = ["hold", "replay"]


def replay(run: Run, unit: UnitRuntime, /) -> list[torch.Tensor]:
    """``unit``'s full leaves for a recompute of its latest call in backward; re-gathers it if released.

    See [Note: recomputes in backward].

    Raises:
        RuntimeError: every call of ``unit`` has reduced its gradients already.
    """
    record = hold(run, unit)
    return list(GatherNode.apply(run.post_backward, record, run.dummy))


def hold(run: Run, unit: UnitRuntime, /) -> CallRecord:
    """Holds ``unit`` gathered in backward for code that reruns one of its calls; that call's record.

    The root unit is held until its own backward; another unit's latest call not
    yet reduced is acquired if its unit was released (-> BACKWARD, see
    ``Run.pre_backward``). See [Note: recomputes in backward].

    Raises:
        RuntimeError: the forward is not done, or the unit's gradients are all
            reduced (its gathered leaves are gone).
    """
    if not run.forward_done:
        raise RuntimeError(
            f"unit {unit.name!r}: a checkpointed region was recomputed during forward, by a "
            f"backward that forward itself ran (torch.autograd.grad inside a unit's forward, "
            f"through remat or a torch checkpoint). funcshard recomputes in the step's backward "
            f"only. Fix: keep that forward out of remat (functionalize(..., remat=False), no "
            f"checkpoint around it), or take the inner gradient outside the checkpointed region"
        )
    root = run.root if run.root is not None and run.root.unit is unit else None
    record = root or next(
        (c for c in reversed(run.calls) if c.unit is unit and c.phase is not CallPhase.DONE),
        None,
    )
    if record is None or record.phase is CallPhase.DONE:
        raise RuntimeError(
            f"unit {unit.name!r} ran again in backward (an activation checkpoint's recompute, "
            f"or a backward hook) after its gradients were reduced, when its gathered "
            f"parameters are gone. Checkpoint each unit's call by itself (or use remat=True), "
            f"so that its recompute comes before its backward"
        )
    if not record.phase.holds:
        run.pre_backward(record)
    return record
