"""Run: one forward and backward of a step, driving every unit through gather, free and reduce.

Forward: the root unit is gathered first and kept until its backward; each
``fs.call`` gathers its unit (waiting for a prefetch when there is one), starts
the prefetch of the next unit, runs the function and frees the unit
(``full_shard``). Backward: a hook on a call's outputs fires before the call's
backward runs and re-gathers the unit (and prefetches the one before it); the
unit's gather node receives all gradients of its full leaves at once and starts
their reduce-scatter. :meth:`Run.finish` waits for the reductions and adds them
to the sharded gradients.

[Note: collective order]
Every rank must issue the same collectives in the same order. The order here
depends only on the order of ``fs.call`` s and on autograd's backward order,
both the same on every rank running the same code; prefetch decisions use the
call order of the previous step, which the step's first agreement compares.
Where a rank could leave that order, it agrees with the others first (see
[Note: agreements] in ``comm/channel.py``): a call that is not the one the last
step made at its position; a backward that passes over calls whose backward
has not run; a reduction while a later call's backward has begun and not
reduced; and, at the end, the calls no gradient reached. So a rank that takes
another branch stops at an agreement instead of pairing its collectives with
the wrong ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import register_multi_grad_hook

from funcshard._src import tree
from funcshard._src.comm.collectives import Pending
from funcshard._src.execute.desync import (
    check_backward,
    check_call,
    check_reduction,
    check_unreached,
)
from funcshard._src.execute.unit_state import Reduction, UnitRuntime, UnitState
from funcshard._src.shard.sharded import ShardedTensor

_CURRENT: ContextVar[Run | None] = ContextVar("funcshard_run", default=None)
MAX_PENDING_REDUCTIONS = 4  # full-gradient buffers in flight before the oldest is waited for


def current_run() -> Run | None:
    """The run whose forward is executing in this context, if any."""
    return _CURRENT.get()


@dataclass(eq=False)
class CallRecord:
    """One use of a unit in this forward (the root unit's is index -1)."""

    index: int
    unit: UnitRuntime
    holds: bool = False  # holds a reference that keeps the unit gathered until its backward
    expects_backward: bool = False  # outputs that require grad were hooked
    backward_started: bool = False
    backward_done: bool = False


class _Gather(torch.autograd.Function):
    """Hands a gathered unit's full leaves to autograd; its backward receives all their gradients."""

    @staticmethod
    def forward(
        ctx: Any, run: Run, record: CallRecord, dummy: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.run, ctx.record = run, record
        leaves = record.unit.full_leaves()
        ctx.mark_non_differentiable(*(t for t in leaves if not t.is_floating_point()))
        return tuple(leaves)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, None, None]:
        ctx.run.post_backward(ctx.record, grads)
        return None, None, None


class Run:
    """One forward and backward of a step on this rank."""

    def __init__(
        self,
        units: Sequence[UnitRuntime],
        *,
        order_hint: Sequence[str],
        prefetch: int,
        defer: bool,
        grads: dict[tuple[str, int], torch.Tensor],  # filled by reductions: (unit, part) -> flat
        output_dtype: torch.dtype | None = None,
    ) -> None:
        self.units = {u.name: u for u in units}
        self.order_hint = list(order_hint)
        self.prefetch = prefetch
        self.defer = defer
        self.grads = grads
        self.output_dtype = output_dtype
        self.calls: list[CallRecord] = []
        self.root: CallRecord | None = None
        self.active: CallRecord | None = None
        self.pending: list[tuple[str, Reduction]] = []
        self.on_track = True  # the calls so far follow order_hint
        self.dummy = torch.zeros((), requires_grad=True)
        self.root_leaf_ids: set[int] = set()
        self.flat_owner: dict[int, UnitRuntime] = {}
        self._next_backward = -1  # set by end_forward: the call whose backward should come next
        self._in_backward: set[int] = set()  # calls whose backward began and has not reduced
        self._token: Any = None

    # -- forward -----------------------------------------------------------------

    def begin(self, sparams: Any, by_unit: dict[str, list[Any]]) -> Any:
        """Binds this step's shards, gathers the root unit, returns the params view for ``loss_fn``."""
        for name, flats in by_unit.items():
            unit = self.units[name]
            unit.bind(flats)
            for flat in flats:
                self.flat_owner[id(flat)] = unit
        root_unit = next((u for u in self.units.values() if u.unit.is_root), None)
        root_leaves: dict[int, torch.Tensor] = {}
        if root_unit is not None:
            root_unit.gather()  # before any prefetch: one unit's all-gather buffer at a time
            root_unit.refs += 1
            self.root = CallRecord(-1, root_unit, holds=True)
            outs = _Gather.apply(self, self.root, self.dummy)
            for slot, leaf in zip((s for p in root_unit.parts for s in p.layout.slots), outs):
                root_leaves[slot.index] = leaf
                self.root_leaf_ids.add(id(leaf))
        self._prefetch_forward(0)
        self._token = _CURRENT.set(self)
        return tree.tree_map(
            lambda x: (
                root_leaves[x.slot.index]
                if isinstance(x, ShardedTensor) and x.slot.index in root_leaves
                else x
            ),
            sparams,
        )

    def enter_call(self, unit: UnitRuntime) -> tuple[CallRecord, list[torch.Tensor]]:
        """Gathers ``unit`` for a new call and returns its record and full leaves (part, slot order)."""
        record = CallRecord(len(self.calls), unit)
        self.calls.append(record)
        k = record.index
        self.on_track = (
            self.on_track and k < len(self.order_hint) and self.order_hint[k] == unit.name
        )
        if not self.on_track:  # see [Note: collective order]
            check_call(k, unit.name)
        unit.gather()
        unit.refs += 1
        record.holds = True
        if self.on_track:
            self._prefetch_forward(k + 1)
        return record, list(_Gather.apply(self, record, self.dummy))

    def exit_call(self, record: CallRecord, out: Any) -> None:
        """After a call's forward: frees ``full_shard`` units and hooks the outputs for backward."""
        if record.unit.frees_after_forward:
            self._release(record)
        tensors = [
            t for t in tree.flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if tensors:
            record.expects_backward = True
            register_multi_grad_hook(tensors, lambda _: self.pre_backward(record), mode="any")

    def end_forward(self) -> list[str]:
        """Leaves the forward context; frees units prefetched but never called. Returns the call order."""
        if self._token is not None:
            _CURRENT.reset(self._token)
            self._token = None
        for unit in self.units.values():
            if unit.refs == 0 and unit.state is not UnitState.SHARDED:
                unit.free()
        self._next_backward = len(self.calls) - 1
        return [c.unit.name for c in self.calls]

    # -- backward ----------------------------------------------------------------

    def pre_backward(self, record: CallRecord) -> None:
        """Before a call's backward: make sure its unit is gathered; prefetch the call before it."""
        while self._next_backward >= 0 and not self._awaits_backward(
            self.calls[self._next_backward]
        ):
            self._next_backward -= 1
        if record.index != self._next_backward:  # see [Note: collective order]
            skipped = [c.index for c in self.calls[record.index + 1 :] if self._awaits_backward(c)]
            check_backward(record.index, record.unit.name, skipped)
        record.backward_started = True
        self._in_backward.add(record.index)
        if not record.holds:
            record.unit.gather()
            record.unit.refs += 1
            record.holds = True
        for j in range(record.index - 1, max(-1, record.index - 1 - self.prefetch), -1):
            earlier = self.calls[j]
            if not earlier.backward_started and earlier.unit.state is UnitState.SHARDED:
                earlier.unit.start_gather()

    def post_backward(
        self, record: CallRecord, grads: Sequence[torch.Tensor | None], *, agreed: bool = False
    ) -> None:
        """All gradients of one call's full leaves are ready: reduce them, release the unit."""
        self._in_backward.discard(record.index)
        later = sorted(i for i in self._in_backward if i > record.index)
        if (
            later and not agreed
        ):  # reductions out of reverse call order; see [Note: collective order]
            check_reduction(record.index, record.unit.name, later)
        record.backward_done = True
        for reduction in record.unit.reduce(grads, defer=self.defer):
            self.pending.append((record.unit.name, reduction))
        while len(self.pending) > MAX_PENDING_REDUCTIONS:
            self._finish_oldest()
        if record.holds:
            self._release(record)

    def finish(self) -> None:
        """After backward: reduce calls whose backward never ran, wait for every reduction, free all."""
        unreached = [
            r
            for r in [*reversed(self.calls), *([self.root] if self.root else [])]
            if not r.backward_done
        ]
        if unreached:  # which calls no gradient reached may differ between ranks
            check_unreached([r.index for r in unreached])
        for record in unreached:  # their gradients are zero
            n = sum(len(p.layout.slots) for p in record.unit.parts)
            self.post_backward(record, [None] * n, agreed=True)
        while self.pending:
            self._finish_oldest()
        for unit in self.units.values():
            unit.refs = 0
            unit.free()

    def abort(self) -> list[Pending]:
        """After an error: leaves the forward context and drops everything, waiting for nothing.

        A collective in flight may never complete (the error may be a dead peer),
        so none is waited for here; they are returned, for the caller to wait
        for once it knows every rank gave up alike (see [Note: out of step]).
        """
        if self._token is not None:
            _CURRENT.reset(self._token)
            self._token = None
        inflight = [reduction.stage for _, reduction in self.pending]
        self.pending.clear()
        for unit in self.units.values():
            inflight.extend(unit.discard())
        return inflight

    # -- helpers -----------------------------------------------------------------

    def _prefetch_forward(self, start: int) -> None:
        for name in self.order_hint[start : start + self.prefetch]:
            unit = self.units.get(name)
            if unit is not None and unit.state is UnitState.SHARDED:
                unit.start_gather()

    def _awaits_backward(self, record: CallRecord) -> bool:
        return record.expects_backward and not record.backward_started

    def _release(self, record: CallRecord) -> None:
        record.holds = False
        record.unit.refs -= 1
        if record.unit.refs == 0:
            record.unit.free()

    def _finish_oldest(self) -> None:
        name, reduction = self.pending.pop(0)
        reduction.finish(
            self.grads, (name, reduction.part), self.units[name].parts[reduction.part].layout.dtype
        )
