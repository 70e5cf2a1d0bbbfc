"""``fs.call`` under ``torch.compile``: the gather and the reduction as opaque custom ops.

[Note: compiled calls]
Dynamo cannot trace the executor (the run is a ``ContextVar``; units change
state; collectives are asynchronous), and should not: inside a compiled
``loss_fn``, :func:`funcshard.call` traces into two custom ops and the user's
function between them, so a whole ``loss_fn`` is one graph:

- ``funcshard::gather(anchor, unit, slots) -> full leaves``: the real kernel asks
  the current run for the unit (acquire, prefetch the next one, exactly as an
  eager call), copies the full leaves out into fresh tensors and releases the
  unit at once; the fake kernel gives the leaves' shapes and dtypes. Its outputs
  are the graph's to keep or free (no persistent storage is handed to
  AOTAutograd, which could not know that it is resized to zero bytes).
- its autograd formula is ``funcshard::reduce(anchor, unit, slots, grads)``: the
  run reduces the gradients of the call (reduce-scatter, as an eager call's
  gather node does) and the op returns a zero gradient for ``anchor``, so it
  sits in the backward graph on the path to an output and is never removed.
- the gather runs under a selective activation checkpoint that *recomputes* it
  for a unit that frees after forward (``full_shard``, ``hybrid_shard``,
  ``partial_reshard``, ``hybrid_shard_optimizer``: the backward graph re-gathers
  the unit right before its gradients, which is when the partitioner places
  recomputed nodes) and *saves* its outputs for the others (``shard_grad_op``,
  ``shard_optimizer``, ``no_shard`` and the root unit: kept from forward to
  backward).

``anchor`` is one scalar leaf that requires grad, so that the ops have an
input autograd follows (``Run.dummy`` in eager). Limit: two calls of one
unit in one forward (weight sharing) are identical op calls, which the graph's
CSE merges into one gather, so the run sees one call in forward and two
reductions in backward and raises (``funcshard::reduce ... no call awaiting``). ``unit`` and ``slots`` are
constants of the graph: a loop over blocks unrolls into one graph with one
gather per call, and nothing is guarded per unit but the leaves' metadata.
The order of the ops is the graph's, the same on every rank (the same program
compiled the same way); the run's agreements still check it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from funcshard._src import tree
from funcshard._src.execute.call_record import CallPhase
from funcshard._src.execute.run import Run, step_run
from funcshard._src.execute.unit_state import UnitRuntime
from funcshard._src.shard.sharded import ShardedTensor

# the input autograd follows through every compiled gather; its gradient is always zero
ANCHOR = torch.zeros((), requires_grad=True)


# what a compiled graph with one unit called twice does: its two gathers are one op there
_TWICE_UNDER_COMPILE = (
    "has no call awaiting backward: a unit called twice in one compiled loss_fn (shared "
    "weights) is not supported, as the graph merges the two identical gathers into one; "
    "run that loss_fn eagerly, or compile the function inside the call instead: "
    "fs.call(torch.compile(fn), unit, ...)"
)


def compiled_runtime(run: Run, name: str, slots: Sequence[int]) -> UnitRuntime:
    """The unit ``name`` of a compiled call, checking that ``slots`` are exactly its leaves."""
    unit = run.units.get(name)
    if unit is None:
        raise ValueError(
            f"fs.call (compiled): no unit {name!r} in this step (units: {sorted(run.units)})"
        )
    if sorted(slots) != sorted(unit.position) or unit.is_root:
        raise ValueError(
            f"fs.call (compiled) got {len(set(slots))} of the {len(unit.slots)} leaves of unit "
            f"{name!r}; pass the unit's whole subtree"
        )
    return unit


def compiled_gather(run: Run, name: str, slots: Sequence[int]) -> list[torch.Tensor]:
    """The real kernel of ``funcshard::gather``: the unit's full leaves ``slots``, copied out.

    In forward: a new call (acquire, prefetch, as :meth:`enter_call`). After forward: the
    backward re-gather of the last call of the unit that awaits it (as :meth:`pre_backward`).
    Either way the unit is released at once: the copies are the graph's.
    """
    unit = compiled_runtime(run, name, slots)
    if run.output_dtype is not None:
        raise NotImplementedError(
            "MixedPrecision(output_dtype=...) is not applied inside a compiled loss_fn yet; "
            "cast the outputs in the function you pass to fs.call, or leave output_dtype unset"
        )
    if run.active is not None:
        raise RuntimeError(
            f"nested fs.call: unit {name!r} inside the function of {run.active.unit.name!r}"
        )
    if not run.forward_done:
        record, _ = run.enter_call(unit)
        record.compiled = True
    else:
        record = next(
            (r for r in reversed(run.calls) if r.unit is unit and r.phase is CallPhase.WAITING),
            None,
        )
        if record is None:
            raise RuntimeError(f"funcshard::gather: unit {name!r} {_TWICE_UNDER_COMPILE}")
        run.pre_backward(record)
    full = [v for p in unit.parts for v in p.views]
    out = [full[unit.position[s]].detach().clone() for s in slots]
    run.exit_compiled_call(record)
    return out


def compiled_reduce(
    run: Run, name: str, slots: Sequence[int], grads: Sequence[torch.Tensor | None]
) -> None:
    """The real kernel of ``funcshard::reduce``: one compiled call's gradients to the reducer."""
    unit = compiled_runtime(run, name, slots)
    record = next(
        (r for r in reversed(run.calls) if r.unit is unit and r.phase is CallPhase.BACKWARD),
        None,
    ) or next(
        (r for r in reversed(run.calls) if r.unit is unit and r.phase is CallPhase.WAITING),
        None,
    )
    if record is None:
        raise RuntimeError(f"funcshard::reduce: unit {name!r} {_TWICE_UNDER_COMPILE}")
    ordered: list[torch.Tensor | None] = [None] * len(unit.slots)
    for s, g in zip(slots, grads):
        ordered[unit.position[s]] = g
    run.post_backward(record, ordered)


def _run_for(what: str) -> Any:
    run = step_run()
    if run is None:
        raise RuntimeError(
            f"funcshard::{what} ran outside a step: a compiled loss_fn that calls fs.call must run "
            "inside a step of fs.value_and_grad (or step.forward)"
        )
    return run


@torch.library.custom_op("funcshard::gather", mutates_args=())
def gather(anchor: torch.Tensor, unit: str, slots: Sequence[int]) -> list[torch.Tensor]:
    """The full leaves ``slots`` of ``unit``, gathered by the current run (fresh tensors)."""
    return compiled_gather(_run_for("gather"), unit, list(slots))


@gather.register_fake
def _(anchor: torch.Tensor, unit: str, slots: Sequence[int]) -> list[torch.Tensor]:
    runtime = compiled_runtime(_run_for("gather"), unit, list(slots))
    out = []
    for s in slots:
        slot = runtime.slots[runtime.position[s]]
        part = runtime.parts[_part_of(runtime, s)]
        device = runtime.flats[_part_of(runtime, s)].data.device
        out.append(torch.empty(slot.shape, dtype=part.compute_dtype, device=device))
    return out


def _part_of(runtime: Any, index: int) -> int:
    i = runtime.position[index]
    for k, part in enumerate(runtime.parts):
        if i < len(part.layout.slots):
            return k
        i -= len(part.layout.slots)
    raise AssertionError(index)


@torch.library.custom_op("funcshard::reduce", mutates_args=())
def reduce(
    anchor: torch.Tensor, unit: str, slots: Sequence[int], grads: Sequence[torch.Tensor | None]
) -> torch.Tensor:
    """Hands one call's gradients to the current run's reducer; a zero gradient for ``anchor``."""
    compiled_reduce(_run_for("reduce"), unit, list(slots), list(grads))
    return torch.zeros_like(anchor)


@reduce.register_fake
def _(
    anchor: torch.Tensor, unit: str, slots: Sequence[int], grads: Sequence[torch.Tensor | None]
) -> torch.Tensor:
    return torch.empty_like(anchor)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    _, unit, slots = inputs
    ctx.unit, ctx.slots = unit, list(slots)
    runtime = step_run()
    if runtime is not None:
        rt = compiled_runtime(runtime, unit, list(slots))
        frozen = [o for o, s in zip(output, slots) if not rt.trained[rt.position[s]]]
        if frozen:
            ctx.mark_non_differentiable(*frozen)


def _backward(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[Any, None, None]:
    # reduce's first argument only gives its output's metadata: a scalar like ANCHOR
    return reduce(torch.zeros(()), ctx.unit, ctx.slots, list(grads)), None, None


gather.register_autograd(_backward, setup_context=_setup_context)


def _gather_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy | None:
    """Recompute (re-gather) units that free after forward in backward and save the others' full leaves.

    Runs while AOTAutograd traces, where the run is known. ``None`` for other ops.
    """
    if op is torch.ops.funcshard.gather.default:
        run = _run_for("gather")
        if run.units[args[1]].frees_after_forward:
            return CheckpointPolicy.MUST_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE
    return None


def _keep_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return _gather_policy(ctx, op, *args, **kwargs) or CheckpointPolicy.PREFER_SAVE


def _remat_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """With ``remat=True`` every other op of the call is recomputed too, as in eager."""
    return _gather_policy(ctx, op, *args, **kwargs) or CheckpointPolicy.PREFER_RECOMPUTE


# module-level: Dynamo traces checkpoint's context_fn only as a plain function
def _keep_context() -> Any:
    return create_selective_checkpoint_contexts(_keep_policy)


def _remat_context() -> Any:
    return create_selective_checkpoint_contexts(_remat_policy)


def _gather(unit: str, slots: list[int]) -> list[torch.Tensor]:
    return gather(ANCHOR, unit, slots)


def compiled_call(
    fn: Any, unit: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, remat: bool
) -> Any:
    """``fs.call`` as Dynamo traces it: the gather op, then ``fn``; see [Note: compiled calls]."""
    leaves, treedef = tree.flatten(unit)
    names = {leaf.unit for leaf in leaves if isinstance(leaf, ShardedTensor)}
    if len(names) != 1 or not all(isinstance(leaf, ShardedTensor) for leaf in leaves):
        raise ValueError(
            f"fs.call (compiled) got leaves of units {sorted(names)} or leaves that are not a "
            "unit's; pass exactly one unit's subtree of the params loss_fn receives"
        )
    (name,) = names
    slots = [leaf.slot.index for leaf in leaves]
    if remat:

        def body(*inputs: Any) -> Any:
            full = _gather(name, slots)
            return fn(tree.unflatten(treedef, list(full)), *inputs, **kwargs)

        return checkpoint(body, *args, use_reentrant=False, context_fn=_remat_context)
    full = checkpoint(_gather, name, slots, use_reentrant=False, context_fn=_keep_context)
    return fn(tree.unflatten(treedef, list(full)), *args, **kwargs)
