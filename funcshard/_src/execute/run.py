"""Run: one forward and backward of a step, moving every call through its phases, checked against the other ranks.

Forward: the root unit is gathered first and held until its backward; each
``fs.call`` acquires its unit (waiting for a prefetch when there is one),
prefetches the next unit, runs the function and, for a unit that
``reshards_after_forward`` (``full_shard``, ``hybrid_shard``, ``partial_reshard``,
``hybrid_shard_optimizer``), releases the unit, keeping any partial copy.
Backward: a hook on a call's outputs fires before the call's backward runs and
acquires the unit again (and prefetches the one before it); the unit's
gather node receives all gradients of its full leaves at once and hands them to
the :class:`Reducer`. :meth:`Run.finish` reduces what no gradient reached and
waits for every reduction. A call's phase (:class:`CallPhase`) says which unit
it holds and what it waits for; docs/executor.md draws it.

[Note: collective order]
Every rank must issue the same collectives in the same order. The order here
depends only on the order of ``fs.call`` s and on autograd's backward order,
both the same on every rank running the same code; prefetch decisions use the
call order of the previous step, which the step's first agreement compares.
The agreement at the end of forward runs while backward computes, and is
finished before backward's first wait for a collective (the gathers the end of
forward issues for backward come before it, the same on every rank: [Note: the
first backward gather]). Where a rank could leave that
order, it agrees with the others first (see
[Note: agreements] in ``comm/channel.py``): a call that is not the one the last
step made at its position; a backward that passes over calls whose backward
has not run; a reduction while a later call's backward has begun and not
reduced; and, at the end, the calls no gradient reached. So a rank that takes
another branch stops at an agreement instead of pairing its collectives with
the wrong ones.

Ranks that run different things are caught before their collectives pair
wrongly. A step agrees with every rank (see [Note: agreements] in ``comm/channel.py``)
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

import enum
import hashlib
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any

import torch
from torch.autograd.graph import register_multi_grad_hook

from funcshard._src import tree
from funcshard._src.comm import channel, collectives, settle
from funcshard._src.comm.channel import Agreement, Kind
from funcshard._src.comm.collectives import Pending
from funcshard._src.execute.call_record import (
    CallPhase,
    CallRecord,
    GatherNode,
    Watch,
    check_dense,
    local_leaves,
    watch,
)
from funcshard._src.execute.param_group import ParamGroup, Reducer
from funcshard._src.execute.unit_state import UnitRuntime, UnitState
from funcshard._src.plan.precision import MixedPrecision
from funcshard._src.shard.sharded import FlatShard, ShardedTensor

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
    channel.agree_on(Kind.STEP, "the start of a step", fields, hint=_SAME_PLAN)


def check_call(index: int, unit: str, /) -> None:
    """Agrees that every rank's call ``index`` is of ``unit``, before gathering it; collective."""
    channel.agree_on(
        Kind.CALL, f"call #{index} of the step", {"unit called": unit}, hint=_SAME_CALLS
    )


def check_backward(index: int, unit: str, skipped: Sequence[int], /) -> None:
    """Agrees that every rank's backward reaches call ``index`` passing over the same calls."""
    channel.agree_on(
        Kind.BACKWARD,
        f"the backward of call #{index} (unit {unit!r})",
        {"calls whose backward has not run": list(skipped)},
        hint="Every rank's loss must depend on the same unit calls",
    )


def check_reduction(index: int, unit: str, later: Sequence[int], /) -> None:
    """Agrees before reducing call ``index`` while the backward of ``later`` calls has begun."""
    channel.agree_on(
        Kind.BACKWARD,
        f"the reduction of call #{index} (unit {unit!r})",
        {"calls whose backward began and has not reduced": list(later)},
        hint="Every rank's loss must depend on the same parameters of the same unit calls",
    )


def check_unreached(indices: Sequence[int], /) -> None:
    """Agrees on the calls whose backward never ran (their gradients are zero) before reducing them."""
    channel.agree_on(
        Kind.BACKWARD,
        "the calls no gradient reached",
        {"calls": list(indices)},
        hint="Every rank's loss must depend on the same parameters of the same unit calls",
    )


def start_forward_check(calls: Sequence[str], /) -> channel.Agreement:
    """Starts agreeing on the units called in forward and the collectives issued; collective.

    Backward may compute while it is in flight; :meth:`Agreement.finish` must run
    before backward's first collective (see [Note: collective order] in ``run.py``).
    """
    return channel.start(
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
    channel.agree_on(
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


class RunMode(enum.Enum):
    """What a run is for: it decides what a release keeps and whether gradients are reduced now."""

    EVALUATION = "evaluation"  # forward only: every call frees its unit, none is hooked
    LAST = "last micro-batch"  # a step's last (or only) micro-batch: a release keeps nothing
    SHARDED = "micro-batch"  # an earlier micro-batch whose gradients are reduced as it goes
    DEFERRED = "deferred micro-batch"  # an earlier one whose gradients are kept whole

    @staticmethod
    def of_micro_batch(i: int, count: int, *, keep_whole: bool) -> RunMode:
        """The mode of micro-batch ``i`` of ``count``; ``keep_whole``: accumulate unsharded.

        Example:
            >>> [RunMode.of_micro_batch(i, 2, keep_whole=True).name for i in range(2)]
            ['DEFERRED', 'LAST']
        """
        if i == count - 1:
            return RunMode.LAST
        return RunMode.DEFERRED if keep_whole else RunMode.SHARDED


class Stage(enum.Enum):
    """Where a run is: its forward (``loss_fn``), after it (backward, finishing), or ended."""

    FORWARD = "forward"
    BACKWARD = "backward"
    ENDED = "ended"


# [Note: the current run]
# One context variable holds the run from its begin to its end (finish, close_evaluation or
# abort); its stage says whether its forward is running. Backward on the CPU runs on the
# thread that called it, in the same context, so autograd's hooks and a checkpoint's
# recompute in backward find the run there. On a CUDA device autograd runs backward on its
# own device threads, which do not see the caller's context variables, so the run is also
# kept in one process-wide slot for the same span, which step_run falls back to: a process
# runs one step at a time (Step refuses a step inside another's loss_fn).
_RUN: ContextVar[Run | None] = ContextVar("funcshard_run", default=None)
_STEP: list[Run | None] = [None]  # the same run, for threads outside its context


def current_run() -> Run | None:
    """The run whose forward is executing in this context, if any."""
    run = _RUN.get()
    return run if run is not None and run.stage is Stage.FORWARD else None


def step_run() -> Run | None:
    """The run of the step in progress (forward or backward), if any, from any thread."""
    run = _RUN.get()
    return _STEP[0] if run is None else run


class Run:
    """One forward and backward of a step on this rank."""

    def __init__(
        self,
        groups: Sequence[ParamGroup],
        *,
        mode: RunMode,
        order_hint: Sequence[str],
        prefetch: int,
        reducer: Reducer,
        output_dtype: torch.dtype | None = None,
        param_dtype: torch.dtype | None = None,
    ) -> None:
        self.units = {u.name: u for g in groups for u in g.members}
        self.groups = list(groups)
        # every collective goes through the unit's group: [Note: one owner per collective] in ``execute/param_group.py``
        self.group_of = {u.name: g for g in groups for u in g.members}
        self.mode = mode
        self.stage = Stage.FORWARD
        self.order_hint = list(order_hint)
        self.prefetch = prefetch
        self.reducer = reducer
        self.output_dtype = output_dtype
        self.param_dtype = param_dtype  # what floating leaves compute in (MixedPrecision)
        self.calls: list[CallRecord] = []
        self.root: CallRecord | None = None
        self.active: CallRecord | None = None
        self.replaying: UnitRuntime | None = None  # the unit whose call a recompute replays
        self.on_track = True  # the calls so far follow order_hint
        self.dummy = torch.zeros((), requires_grad=True)
        self.root_leaf_ids: set[int] = set()
        self.flat_owner: dict[FlatShard, UnitRuntime] = {}  # this step's shards, by identity
        self._next_backward = -1  # set by end_forward: the call whose backward should come next
        self._drains_after: int | None = None  # set by end_forward
        self._in_backward: set[int] = set()  # calls whose backward began and has not reduced
        self.forward_check: Agreement | None = None  # finished before backward's first wait
        self._token: Any = None
        self._root_grads: list[torch.Tensor | None] | None = None  # see gathered_grads
        self._root_guard: Watch | None = (
            None  # See [Note: what a call may do to its parameters] in ``execute/call_record.py``
        )

    @property
    def evaluation(self) -> bool:
        """Forward only: every call frees its unit, none is hooked."""
        return self.mode is RunMode.EVALUATION

    @property
    def defer(self) -> bool:
        """Gradients are kept whole, not reduced (an unsharded micro-batch before the last)."""
        return self.mode is RunMode.DEFERRED

    @property
    def last(self) -> bool:
        """No later micro-batch: a release keeps nothing ([Note: what a release keeps])."""
        return self.mode in (RunMode.LAST, RunMode.EVALUATION)

    @property
    def forward_done(self) -> bool:
        """The forward has ended: a call now is a recompute in backward."""
        return self.stage is not Stage.FORWARD

    # -- forward -----------------------------------------------------------------

    def begin(self, sparams: Any, by_unit: dict[str, list[Any]]) -> Any:
        """Binds this step's shards, gathers the root unit, returns the params view for ``loss_fn``."""
        for group in (
            self.groups
        ):  # drained by the last step: [Note: staging lifetimes] in execute/param_group.py
            group.pool.refill()
            group.reduce_pool.refill()
        for name, flats in by_unit.items():
            unit = self.units[name]
            unit.bind(flats)
            for flat in flats:
                self.flat_owner[flat] = unit
        root_unit = next((u for u in self.units.values() if u.is_root), None)
        root_leaves: dict[int, torch.Tensor] = {}
        if root_unit is not None:
            self._acquire(root_unit)  # before any prefetch: one unit's all-gather buffer at a time
            self.root = CallRecord(-1, root_unit, CallPhase.KEPT)
            outs = (
                local_leaves(self.root, evaluation=self.evaluation)
                if root_unit.local_only
                else GatherNode.apply(self.gathered_grads, self.root, self.dummy)
            )
            for slot, leaf in zip(root_unit.slots, outs):
                root_leaves[slot.index] = leaf
                self.root_leaf_ids.add(id(leaf))
            self._root_guard = watch(root_unit.name, root_unit.slots, outs)
        self._prefetch_forward(0)
        self._token = _RUN.set(self)  # see [Note: the current run]
        _STEP[0] = self
        leaves, treedef = tree.flatten(sparams)
        if root_leaves:  # one pass in a comprehension: this runs every step over every leaf
            leaves = [
                root_leaves.get(x.slot.index, x) if isinstance(x, ShardedTensor) else x
                for x in leaves
            ]
        return tree.unflatten(treedef, leaves)

    def enter_call(
        self, unit: UnitRuntime, *, leafwise: bool = False
    ) -> tuple[CallRecord, list[torch.Tensor]]:
        """Acquires ``unit`` for a new call (FORWARD); its record and full leaves in the unit's order.

        With ``leafwise``, a local-only unit's leaves are autograd leaves; see
        [Note: local-only calls] in ``call_record.py``.
        """
        record = CallRecord(len(self.calls), unit)
        self.calls.append(record)
        k = record.index
        was_on_track = self.on_track
        self.on_track = (
            self.on_track and k < len(self.order_hint) and self.order_hint[k] == unit.name
        )
        if not self.on_track:  # see [Note: collective order]
            check_call(k, unit.name)
        if was_on_track and not self.on_track:  # the prefetches guessed wrong: free them now,
            for other in self.units.values():  # not at their call, maybe at the end of forward
                if other is not unit:
                    self.group_of[other.name].drop_unused(other)
        self._acquire(unit)
        if self.on_track:
            self._prefetch_forward(k + 1)
        if leafwise and unit.local_only:
            return record, local_leaves(record, evaluation=self.evaluation)
        return record, list(GatherNode.apply(self.gathered_grads, record, self.dummy))

    def exit_call(self, record: CallRecord, out: Any) -> None:
        """FORWARD -> WAITING (a unit that frees after forward: released) or KEPT; hooks the outputs for backward.

        In an evaluation, FORWARD -> DONE: the unit is released whatever its
        strategy, as no backward will need it.
        """
        if self.evaluation:
            self._release(record.unit)
            record.phase = CallPhase.DONE
            return
        if record.unit.frees_after_forward:
            self._release(record.unit, after_forward=True)
            record.phase = CallPhase.WAITING
        else:
            record.phase = CallPhase.KEPT
        if record.leaves is not None:  # autograd fills its leaves' .grad: no hook
            return
        tensors = [
            t for t in tree.flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if not tensors:  # a reentrant checkpoint's forward runs without grad: recomputed later
            record.no_backward = torch.is_grad_enabled()  # [Note: calls without a backward]
        else:
            record.expects_backward = True
            if len(tensors) == 1:  # the same hook as "any" of one tensor, at a fraction of the cost
                tensors[0].register_hook(lambda _: self.pre_backward(record))
            else:
                register_multi_grad_hook(tensors, lambda _: self.pre_backward(record), mode="any")

    def exit_compiled_call(self, record: CallRecord) -> None:
        """A compiled call's leaves are copied out: releases its unit; in forward, FORWARD -> WAITING.

        The copies are the compiled graph's, so the unit is released at once; in an
        evaluation the call is DONE. After forward (the backward re-gather of a WAITING
        call, BACKWARD since :meth:`pre_backward`) the phase stays.
        See [Note: a call's phase changes only in Run] in ``execute/call_record.py``.
        """
        self._release(record.unit, after_forward=not self.forward_done)
        if self.forward_done:
            return
        if self.evaluation:
            record.phase = CallPhase.DONE
        else:
            record.phase = CallPhase.WAITING
            record.expects_backward = True

    def end_forward(self) -> list[str]:
        """Leaves the forward context; frees units prefetched but never called. Returns the call order.

        Raises:
            ParameterWriteError: forward wrote or hooked a root-unit leaf.
        """
        if self._root_guard is not None:  # then dropped: it holds the root's leaves
            guard, self._root_guard = self._root_guard, None
            guard.check()
        for unit in self.units.values():
            self.group_of[unit.name].drop_unused(unit)
        self._next_backward = len(self.calls) - 1
        # the last call to be reduced: its reduction drains the pools
        # ([Note: staging lifetimes] in execute/param_group.py)
        self._drains_after = next((c.index for c in self.calls if c.expects_backward), None)
        self.stage = Stage.BACKWARD
        if self.on_track and len(self.calls) == len(self.order_hint):
            self._prefetch_backward(len(self.calls))  # [Note: the first backward gather]
        return [c.unit.name for c in self.calls]

    # -- backward ----------------------------------------------------------------

    def pre_backward(self, record: CallRecord) -> None:
        """-> BACKWARD: before a call's backward, its unit is held gathered; prefetches the call before it.

        A call already in BACKWARD (a recompute acquired it first) stays as it is.
        """
        if record.phase is CallPhase.BACKWARD:
            return
        self._finish_forward_check()
        while self._next_backward >= 0 and not self._awaits_backward(
            self.calls[self._next_backward]
        ):
            self._next_backward -= 1
        if record.index != self._next_backward:  # see [Note: collective order]
            skipped = [c.index for c in self.calls[record.index + 1 :] if self._awaits_backward(c)]
            check_backward(record.index, record.unit.name, skipped)
        if record.phase is CallPhase.WAITING:
            self._acquire(record.unit)
        record.phase = CallPhase.BACKWARD
        self._in_backward.add(record.index)
        self._prefetch_backward(record.index)

    def gathered_grads(self, record: CallRecord, grads: Sequence[torch.Tensor | None]) -> None:
        """A gather node's backward: the call's gradients; the root unit's are summed until finish.

        The root unit's gather node can run more than once in a step: a reentrant
        checkpoint differentiates its recompute in a nested backward, which reaches
        the root's leaves too. Its gradients are summed and reduced once, by
        :meth:`finish`; the root stays gathered until then, as it is held for the
        whole step anyway.
        """
        check_dense(record.unit.name, record.unit.slots, grads)
        if record is not self.root:
            self.post_backward(record, grads)
        elif self._root_grads is None:
            self._root_grads = list(grads)
        else:
            self._root_grads = [
                b if a is None else a if b is None else a + b
                for a, b in zip(self._root_grads, grads)
            ]

    def post_backward(
        self, record: CallRecord, grads: Sequence[torch.Tensor | None], *, agreed: bool = False
    ) -> None:
        """-> DONE: all gradients of one call's full leaves are ready: reduce them, release the unit."""
        self._finish_forward_check()
        self._in_backward.discard(record.index)
        later = sorted(i for i in self._in_backward if i > record.index)
        if later and not agreed:  # reductions out of reverse call order; [Note: collective order]
            check_reduction(record.index, record.unit.name, later)
        if (
            record.phase.holds and not record.compiled
        ):  # first: the full parameters are not needed to reduce
            self._release(record.unit)
        unit = record.unit
        defer = self.defer or keeps_gathered(unit, last=self.last)
        # the unit's last reduction of the step: a two-hop one crosses the other axes as soon
        # as it is in ([Note: two-hop reductions] in param_group.py)
        final = (
            unit.two_hop
            and self.last
            and not defer
            and not any(
                c.unit is unit and c is not record and c.phase is not CallPhase.DONE
                for c in self.calls
            )
        )
        self.reducer.reduce(self.group_of[unit.name], unit, grads, defer=defer, final=final)
        record.phase = CallPhase.DONE
        if self.last and record.index == self._drains_after and record is not self.root:
            for group in self.groups:  # see [Note: staging lifetimes] in execute/param_group.py
                group.pool.drain()
                group.reduce_pool.drain()
            collectives.drain()  # the regions too: [Note: draining regions] in comm/shm/regions.py

    def finish(self) -> None:
        """After backward: reduce calls whose backward never ran, wait for every reduction, free all."""
        self._finish_forward_check()
        if self._root_grads is not None and self.root is not None:  # see gathered_grads
            grads, self._root_grads = self._root_grads, None
            self.post_backward(self.root, grads, agreed=True)
        records = [*reversed(self.calls), *([self.root] if self.root else [])]
        for record in records:
            if record.leaves is not None:  # see [Note: local-only calls] in call_record.py
                grads = [t.grad for t in record.leaves]
                record.leaves = None
                if record.phase is not CallPhase.DONE:  # a replay may have reduced it
                    self.post_backward(record, grads, agreed=True)
        unreached = [r for r in records if r.phase is not CallPhase.DONE]
        if unreached:  # which calls no gradient reached may differ between ranks
            check_unreached([r.index for r in unreached])
        for record in unreached:  # their gradients are zero
            self.post_backward(record, [None] * len(record.unit.slots), agreed=True)
        if self.last:
            self.reducer.reduce_deferred()
        self.reducer.finish(last=self.last)
        for group in self.groups:
            group.release_all(keep=not self.last)
        self._end()
        collectives.settle()  # the caller may write the shards next

    def close_evaluation(self) -> None:
        """After an evaluation's forward: frees every unit (the root unit's hold included)."""
        for group in self.groups:
            group.release_all()
        self._end()
        collectives.settle()  # the caller may write the shards next

    def abort(self) -> list[Pending]:
        """After an error: leaves the forward context and drops everything, waiting for nothing.

        A collective in flight may never complete (the error may be a dead peer),
        so none is waited for here; they are returned, for the caller to wait
        for once it knows every rank gave up alike (see [Note: out of step] in ``comm/settle.py``).
        """
        self._end()
        self.reducer.abandon()
        inflight: list[Pending] = []
        for group in self.groups:
            inflight.extend(group.discard())
        return inflight

    # -- helpers -----------------------------------------------------------------

    def _end(self) -> None:
        """Leaves the context: no call finds this run any more; see [Note: the current run]."""
        self.stage = Stage.ENDED
        if self._token is not None:
            _RUN.reset(self._token)
            self._token = None
        if _STEP[0] is self:
            _STEP[0] = None

    def _prefetch_forward(self, start: int) -> None:
        for name in self.order_hint[start : start + self.prefetch]:
            unit = self.units.get(name)
            if unit is not None and unit.state is UnitState.SHARDED:
                self.group_of[name].prefetch(unit)

    def _prefetch_backward(self, before: int) -> None:
        """Prefetches the units of the ``prefetch`` calls before call ``before`` whose backward comes next."""
        for j in range(before - 1, max(-1, before - 1 - self.prefetch), -1):
            earlier = self.calls[j]
            if (
                earlier.phase is CallPhase.WAITING
                and not earlier.no_backward  # [Note: calls without a backward]
                and earlier.unit.frees_after_forward  # a compiled call's others keep copies
                and earlier.unit.state is UnitState.SHARDED
            ):
                self.group_of[earlier.unit.name].prefetch(earlier.unit)

    def _acquire(self, unit: UnitRuntime) -> None:
        self.group_of[unit.name].acquire(unit)

    def _release(self, unit: UnitRuntime, *, after_forward: bool = False) -> None:
        self.group_of[unit.name].release(
            unit,
            keep=keeps_gathered(unit, last=self.last),
            keep_partial=keeps_partial(
                unit, after_forward=after_forward, evaluation=self.evaluation, last=self.last
            ),
        )

    def _finish_forward_check(self) -> None:
        if self.forward_check is not None:
            check, self.forward_check = self.forward_check, None
            check.finish()

    def _awaits_backward(self, record: CallRecord) -> bool:
        return record.expects_backward and record.phase in (CallPhase.KEPT, CallPhase.WAITING)


# [Note: what a release keeps]
# What a release keeps past a call: a unit's gathered storage, or its partial copy.
#
# A release frees a unit's gathered storage unless the unit keeps it for the step's
# next micro-batch (``shard_optimizer``; [Note: shard_optimizer] in
# ``plan/strategy.py``), and frees its partial copy unless backward still needs it
# (the release at the end of a call's forward) or the unit keeps it for the step
# (``hybrid_shard_optimizer``; [Note: partial copies] in ``plan/strategy.py`` there). The step's last
# micro-batch keeps nothing: shards change at the update, so nothing gathered from
# them may outlive the step. ``Run`` asks here at every release.


# [Note: calls without a backward]
# A call whose outputs need no gradient under grad mode is never gathered for backward.
#
# Nothing its outputs reach can send a gradient back into it, so autograd never
# runs its backward and its unit is not needed again in the step: a unit with no
# trained leaf called where nothing before it needs a gradient (frozen embeddings
# of token ids, a frozen prefix of blocks, a frozen encoder). ``Run.exit_call``
# marks it (``CallRecord.no_backward``) and ``Run._prefetch_backward`` passes it
# by, where it would otherwise gather it ahead of a backward that never comes and
# free it unused at the end of the step. Under ``torch.no_grad`` (a reentrant
# checkpoint's forward) the outputs say nothing of backward: the call is
# recomputed there, so it is not marked. The cost model counts such a unit's
# gathers once per micro-batch (``plan/step_counts.py``), taking every unit with no
# trained leaf to be one (``trains`` in ``plan/unit_cost.py``): where backward does
# pass through a frozen unit (a trained one before it), the unit is gathered again
# for it and a step sends one gather more than the estimate.


# [Note: the first backward gather]
# The end of forward prefetches the units of the calls whose backward comes first.
#
# The last call of forward frees its unit, and backward needs it again first; the
# root unit is held through the step and has no hook of its own, so without this
# the first backward gather would start only at that call's hook and nothing would
# hide it (what the root's loss backward computes meanwhile is the time it needs).
# ``Run.end_forward`` issues it when forward called exactly the last step's units
# in its order, which every rank agreed on at the start: then every rank issues the
# same gathers, before the end-of-forward agreement digests the collectives issued,
# and the first wait for them comes after that agreement is finished (as any
# backward collective's). FSDP2 issues the same gather from its root's pre-backward
# hook. It holds one unit's gathered storage during the loss's backward, which a
# backward prefetch holds during a call's backward anyway.


def keeps_gathered(unit: UnitRuntime, /, *, last: bool) -> bool:
    """Whether a release of ``unit`` leaves it gathered, for the step's next micro-batch."""
    return not last and unit.keeps_for_step


def keeps_partial(
    unit: UnitRuntime, /, *, after_forward: bool, evaluation: bool, last: bool
) -> bool:
    """Whether a release of ``unit`` keeps its partial copy: for its backward, or for the step's next micro-batch."""
    return (after_forward and not evaluation) or (not last and unit.partial.for_step)
