"""One use of a unit in a step: its record and phase, how its leaves reach autograd, what it may do to them.

``Run`` moves each :class:`CallRecord` through its :class:`CallPhase` s;
docs/executor.md draws them.

**The gather node.** A call's autograd node takes a gathered unit's full leaves
in and gives all their gradients out at once. ``Run`` (a call's forward) and ``replay.py`` (a recompute in backward) hand a
unit's full leaves to autograd through :class:`GatherNode`. Its backward receives
the gradients of every full leaf of that use of the unit together, and passes
them to the function it was given: ``Run.gathered_grads`` for a call,
``Run.post_backward`` for a replay.

**Local-only calls** get autograd leaves over their unit's shards instead of a
gather node.

[Note: local-only calls]
A unit with nothing to gather, cast or agree on (one rank, no mixed precision:
``UnitRuntime.local_only``) needs no autograd node of its own: its function gets
new autograd leaves viewing its shards (the trained ones requiring grad),
autograd accumulates their gradients into ``.grad`` as it does for
``nn.Parameter`` s, and ``Run.finish`` hands them to the reducer. No Python runs
in its backward. An evaluation gets the plain views.

**The guard.** The gathered leaves a call was given stay as they were, and its
outputs own their memory.

[Note: what a call may do to its parameters]
A unit's gathered leaves exist only for its call: the executor made them from the
shards and frees or reuses their memory once the call (or its backward) is done.
So three things a function may do to a tensor it owns would be wrong here, silently
or worse:

1. **Write it** in place (``w.clamp_()`` under ``no_grad``, ``nn.Embedding(max_norm=...)``
   renormalising its rows, ``w.data = ...``): the write lands on the gathered copy and
   is lost when the unit is freed, where unsharded training keeps it. Refused after
   the call (:class:`ParameterWriteError`): ``_version`` and ``data_ptr`` of each leaf
   are compared with their values at the call's start. A unit's leaves are views of
   one gathered buffer and share its version counter, so a write is known to the
   unit, not to the leaf: the error lists the leaves that share the counter.
2. **Hook it** (``w.register_hook(fn)``): the hook would hold on to one step's
   gathered copy, where unsharded training keeps it on the parameter for every
   later step. Refused the same way.
3. **Return it**, or a view of it (``self.pos[:T]``): once the unit is freed the
   output would read freed memory. Such an output is copied (:func:`owned`),
   which autograd differentiates as the view itself. ``functionalize``'s units copy
   a view kept on a module attribute the same way (``self.cache = self.w.T``).

And its gradient must be dense: a sparse one (``nn.Embedding(sparse=True)``) cannot
be packed and reduce-scattered with the unit's others (:func:`check_dense`).

The root unit's leaves are checked the same way at the end of forward. The checks
read a few attributes per leaf, about a microsecond a leaf per call.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from funcshard._src import tree
from funcshard._src.execute.unit_state import UnitRuntime


class Named(Protocol):
    """A leaf's place in its unit (a ``Slot``): only its path is read, to name it in an error."""

    @property
    def path(self) -> str: ...


class ParameterWriteError(RuntimeError):
    """Code changed a gathered parameter during its call: an in-place write, ``.data =`` or a hook.

    Example:
        >>> import torch, funcshard as fs
        >>> from types import SimpleNamespace
        >>> w = watch("blocks/0", [SimpleNamespace(path="blocks/0/w")], [torch.zeros(2)])
        >>> with torch.no_grad():
        ...     w.tensors[0].data = torch.ones(2)
        >>> try:
        ...     w.check()
        ... except fs.ParameterWriteError as e:
        ...     print(str(e).splitlines()[0])
        blocks/0/w (unit 'blocks/0') was written in place during its call.
    """


@dataclass(frozen=True, slots=True)
class Watch:
    """The gathered leaves of one call as they were when it started."""

    unit: str
    slots: Sequence[Named]  # each tensor's place, read only to name it
    tensors: Sequence[torch.Tensor]
    versions: tuple[int, ...]
    pointers: tuple[int, ...]

    def check(self) -> None:
        """Raises :class:`ParameterWriteError` where a leaf was written, re-pointed or hooked."""
        for slot, t, version, pointer in zip(
            self.slots, self.tensors, self.versions, self.pointers
        ):
            if t.data_ptr() != pointer:
                raise ParameterWriteError(_written(self.unit, [slot.path]))
            if t._version != version:  # views of one buffer count each other's writes too
                shared = [
                    s.path
                    for s, u, v in zip(self.slots, self.tensors, self.versions)
                    if u._version != v
                ]
                raise ParameterWriteError(_written(self.unit, shared))
            if t._backward_hooks or getattr(t, "_post_accumulate_grad_hooks", None):
                raise ParameterWriteError(_hooked(slot.path, self.unit))


def watch(unit: str, slots: Sequence[Named], tensors: Sequence[torch.Tensor], /) -> Watch:
    """What :meth:`Watch.check` compares with: each leaf's version and data pointer now."""
    return Watch(
        unit,
        slots,
        tensors,
        tuple(t._version for t in tensors),
        tuple(t.data_ptr() for t in tensors),
    )


def owned(out: Any, tensors: Sequence[torch.Tensor], /) -> Any:
    """``out`` with each tensor that lies in the memory of ``tensors`` replaced by a copy of it.

    Example:
        >>> w = torch.arange(4.0)
        >>> out = owned((w[1:], torch.ones(1)), [w])
        >>> out[0].data_ptr() != w[1:].data_ptr(), torch.equal(out[0], w[1:])
        (True, True)
    """
    lies_in = in_memory_of(tensors)
    leaves, treedef = tree.flatten(out)
    inside = [lies_in(x) for x in leaves]
    if not any(inside):
        return out
    return tree.unflatten(treedef, [x.clone() if a else x for x, a in zip(leaves, inside)])


def in_memory_of(tensors: Sequence[torch.Tensor], /) -> Callable[[object], bool]:
    """Whether a value is a non-empty tensor whose first element lies in the memory of ``tensors``.

    Example:
        >>> w = torch.arange(4.0)
        >>> lies_in = in_memory_of([w])
        >>> lies_in(w[2:]), lies_in(w.clone()), lies_in("w")
        (True, False, False)
    """
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]

    def lies_in(x: object) -> bool:
        if not isinstance(x, torch.Tensor) or x.numel() == 0:
            return False
        ptr = x.data_ptr()
        return any(lo <= ptr < hi for lo, hi in spans)

    return lies_in


def check_dense(unit: str, slots: Sequence[Named], grads: Sequence[torch.Tensor | None], /) -> None:
    """Refuses a sparse (or otherwise not strided) gradient of a unit's leaf, naming it.

    Example:
        >>> from types import SimpleNamespace
        >>> check_dense("<root>", [SimpleNamespace(path="emb")], [torch.eye(2).to_sparse()])
        Traceback (most recent call last):
        ...
        ValueError: emb (unit '<root>') has a sparse gradient (torch.sparse_coo); ...
    """
    for slot, g in zip(slots, grads):
        if g is not None and g.layout != torch.strided:
            raise ValueError(
                f"{slot.path} (unit {unit!r}) has a sparse gradient ({g.layout}); funcshard "
                f"packs and reduce-scatters dense gradients only. Fix: compute it densely "
                f"(nn.Embedding(..., sparse=False), F.embedding(..., sparse=False))"
            )


def _written(unit: str, paths: Sequence[str]) -> str:
    what = (
        f"{paths[0]} (unit {unit!r}) was"
        if len(paths) == 1
        else f"a parameter of unit {unit!r} (one of {', '.join(paths)}: they share one gathered "
        f"buffer) was"
    )
    when = "the step's forward" if unit == "<root>" else "its call"
    return (
        f"{what} written in place during {when}.\n"
        f"An in-place op on the parameter (w.clamp_() under no_grad, "
        f"nn.Embedding(max_norm=...) renormalising its rows) or an assignment to its .data "
        f"changes the unit's gathered copy, which funcshard frees after the call: unsharded "
        f"training would keep the change, this step would lose it.\n"
        f"Fix: compute the changed value out of place (w = w.clamp(...)); change parameters "
        f"between steps on the sharded params (fs.tree.map over sparams, after the update); "
        f"for nn.Embedding leave max_norm=None"
    )


def _hooked(path: str, unit: str) -> str:
    return (
        f"{path} (unit {unit!r}) had a hook registered on it during its call.\n"
        f"A hook on a parameter (register_hook, register_post_accumulate_grad_hook) stays on "
        f"the parameter in unsharded training; here it would stay on one call's gathered "
        f"copy only.\n"
        f"Fix: transform the gradients the step returns (fs.tree.map over grads), or register "
        f"a full backward hook on the module"
    )


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
    # under grad mode, no output requires grad: no backward reaches the call
    # ([Note: calls without a backward] in ``execute/run.py``)
    no_backward: bool = False
    compiled: bool = False  # a compiled call: its gather op copied the leaves out and released
    # a local-only unit's call: the autograd leaves its function got, whose .grad
    # autograd fills; reduced by Run.finish. See [Note: local-only calls] in ``execute/call_record.py``
    leaves: list[torch.Tensor] | None = None


GradsSink = Callable[[CallRecord, Sequence[torch.Tensor | None]], None]


class GatherNode(torch.autograd.Function):
    """``apply(sink, record, dummy)``: ``record``'s unit's full leaves; backward calls ``sink(record, grads)``.

    ``dummy`` is a scalar that requires grad, so that the node is part of the
    graph whatever the leaves are; non-trained leaves are not differentiable.
    """

    @staticmethod
    def forward(
        ctx: Any, sink: GradsSink, record: CallRecord, dummy: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.sink, ctx.record = sink, record
        leaves = record.unit.full_leaves()
        ctx.mark_non_differentiable(
            *(t for t, trained in zip(leaves, record.unit.trained) if not trained)
        )
        return tuple(leaves)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, None, None]:
        ctx.sink(ctx.record, grads)
        return None, None, None


def local_leaves(record: CallRecord, /, *, evaluation: bool) -> list[torch.Tensor]:
    """A local-only unit's full leaves for one call, as autograd leaves; sets ``record.leaves`` (mutates).

    In an evaluation, the plain views, and ``record`` is left as it is.
    """
    views = record.unit.full_leaves()
    if evaluation:
        return views
    leaves = [v.requires_grad_() if t else v for v, t in zip(views, record.unit.trained)]
    record.leaves = leaves
    return leaves
