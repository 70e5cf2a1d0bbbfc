"""Sharding strategies per unit, and the mesh axes each one shards over.

``full_shard`` is ZeRO-3 (free after forward, re-gather for backward),
``shard_grad_op`` ZeRO-2 (keep gathered from forward to backward), ``shard_optimizer``
ZeRO-1 (gathered once per step and kept for all its micro-batches, gradients kept
whole until the step's last micro-batch, then reduce-scattered), ``no_shard`` DDP
(replicate, all-reduce gradients) and ``hybrid_shard`` shards over the last mesh
axis and replicates over the others, freed after forward as ``full_shard``
(PyTorch FSDP's ``HYBRID_SHARD``: reduce-scatter inside the shard group,
all-reduce across replicas). ``partial_reshard`` (FSDP2's
``reshard_after_forward=<int>``, ZeRO++'s hpZ) and ``hybrid_shard_optimizer``
(Megatron-FSDP's HFSDP) are stored as ``full_shard`` and keep a partial copy
between gathers (see [Note: partial copies]).

[Note: shard_optimizer]
A ``shard_optimizer`` unit is stored like a ``full_shard`` one (its shards, its
gradients and its optimizer state are 1/N a rank), so checkpoints reshard between
it and every other strategy. What differs is the step: its parameters are
all-gathered at the first micro-batch's forward and stay whole until the step
ends; its gradients stay whole across micro-batches and are reduce-scattered once,
after the last micro-batch's backward of the unit. Per optimizer step that is one
all-gather and one reduce-scatter whatever the number of micro-batches: the bytes
of DeepSpeed ZeRO-1's all-reduce (a ring all-reduce is a reduce-scatter and an
all-gather), where ``shard_grad_op`` gathers once and ``full_shard`` twice per
micro-batch. DeepSpeed all-gathers the updated parameters right after the update
and keeps them whole across steps; funcshard runs that all-gather at the next
step's first forward, so between steps a rank holds only its shards, and no whole
copy can go stale when the shards are updated. All-reducing the gradients instead
and updating one slice would send the same bytes and then still need the
all-gather, so the reduce-scatter is the only variant. With one micro-batch the
step is ``shard_grad_op``'s.

[Note: partial copies]
A ``partial_reshard`` or ``hybrid_shard_optimizer`` unit is stored like a
``full_shard`` one: its shards, gradients and optimizer state are 1/N a rank, over
every mesh axis, so checkpoints reshard between it and every other strategy. Its
*partial copy* is the shards of the ranks that share its coordinate on the last
mesh axis (on ``{"node": N, "local": L}``, the N shards of its ``local`` index):
1/L of the unit, so the L ranks of one coordinate on the other axes hold it
whole between them, sharded over the last axis only. When the unit is gathered
from its shards (one all-gather over every rank, as ``full_shard``), each rank
copies its partial copy out of the gathered rows (no collective); every later
gather is an all-gather of the partial copy over the last axis alone, whose rows
are the same shards in another order (the last axis major). So those gathers
never cross the other axes (across nodes, when the last axis is a node's ranks).

- ``partial_reshard`` keeps the partial copy from forward to backward of each
  micro-batch: backward's re-gather runs over the last axis only, as FSDP2's
  ``reshard_after_forward=L`` and ZeRO++'s hpZ do (a secondary copy inside the
  node).
- ``hybrid_shard_optimizer`` keeps it for the whole step: only the step's first
  gather crosses the other axes. Parameters are sharded over the last axis (as
  ``hybrid_shard``'s) through the step, while shards, gradients, optimizer state
  and any fp32 master are sharded over every rank, as Megatron-FSDP's HFSDP
  shards its optimizer over the outer data-parallel ranks. Between steps a rank
  holds only its shards; the partial copy is made again from the updated shards
  at the next step's first gather, so it can never go stale.

``partial_reshard``'s gradients are reduce-scattered over every rank, as
``full_shard``'s. ``hybrid_shard_optimizer``'s take two hops: over the last axis each
micro-batch, into a *partial gradient* sharded like the partial copy and held
across micro-batches, and over the other axes once a step ([Note: two-hop
reductions] in ``execute/param_group.py``), so that gradients too cross the other axes
once a step, for 1/L of their bytes. The root unit
and a unit on a mesh with one axis (the partial copy is the shard) are gathered as
``full_shard``'s. The partial copy of every unit is alive at the end of forward:
the memory the strategies trade for the gathers they keep inside the last axis.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeAlias, get_args

from funcshard._src.spec.mesh import Mesh
from funcshard._src.spec.partition_spec import P

Strategy: TypeAlias = Literal[
    "full_shard",
    "shard_grad_op",
    "shard_optimizer",
    "no_shard",
    "hybrid_shard",
    "partial_reshard",
    "hybrid_shard_optimizer",
]
STRATEGIES: tuple[Strategy, ...] = get_args(Strategy)


# what each strategy does, in one line, for explain()
MEANINGS: dict[Strategy, str] = {
    "full_shard": "ZeRO-3: gathered for forward, freed, gathered again for backward; "
    "gradients reduce-scattered",
    "shard_grad_op": "ZeRO-2: gathered for forward and kept to its backward; gradients "
    "reduce-scattered",
    "shard_optimizer": "ZeRO-1: gathered once per step and kept for every micro-batch; "
    "gradients kept whole and reduce-scattered once per step; shards, gradients and "
    "optimizer state 1/N",
    "no_shard": "DDP: whole on every rank; gradients all-reduced",
    "hybrid_shard": "sharded over the last mesh axis and replicated over the others; freed "
    "after forward; gradients reduce-scattered, then all-reduced across replicas",
    "partial_reshard": "hpZ: stored as full_shard; after forward, a copy sharded over the "
    "last mesh axis is kept, so backward re-gathers over that axis only",
    "hybrid_shard_optimizer": "HFSDP: stored as full_shard (optimizer state 1/N); a copy "
    "sharded over the last mesh axis is kept for the step, so only the step's first gather "
    "crosses the other axes; gradients are reduced over that axis each micro-batch and "
    "across the others once a step",
}


def check_strategy(strategy: object, /) -> Strategy:
    """Returns ``strategy`` if it names a strategy.

    Raises:
        ValueError: anything else, listing the strategies.
    """
    for known in STRATEGIES:
        if strategy == known:
            return known
    raise ValueError(f"unknown strategy {strategy!r}; choose one of {list(STRATEGIES)}")


def reshards_after_forward(strategy: Strategy, /) -> bool:
    """Whether a (non-root) unit of ``strategy`` is freed after forward and gathered again for backward.

    Example:
        >>> [reshards_after_forward(s) for s in ("full_shard", "shard_grad_op", "hybrid_shard")]
        [True, False, True]
    """
    return strategy in ("full_shard", "hybrid_shard", "partial_reshard", "hybrid_shard_optimizer")


def keeps_for_step(strategy: Strategy, /) -> bool:
    """Whether a unit of ``strategy`` stays gathered, and keeps its gradients whole, across a step's micro-batches.

    See [Note: shard_optimizer].

    Example:
        >>> keeps_for_step("shard_optimizer"), keeps_for_step("shard_grad_op")
        (True, False)
    """
    return strategy == "shard_optimizer"


def keeps_partial_copy(strategy: Strategy, /) -> Literal["call", "step"] | None:
    """How long a unit of ``strategy`` keeps its partial copy: a call's forward to its backward, the step, or never.

    See [Note: partial copies].

    Example:
        >>> keeps_partial_copy("partial_reshard"), keeps_partial_copy("hybrid_shard_optimizer")
        ('call', 'step')
        >>> keeps_partial_copy("full_shard") is None
        True
    """
    if strategy == "partial_reshard":
        return "call"
    if strategy == "hybrid_shard_optimizer":
        return "step"
    return None


def partial_axes(strategy: Strategy, mesh: Mesh, /) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The axes a unit re-gathers its partial copy over, and those the copy is replicated over.

    Both are empty for a strategy that keeps no partial copy; see [Note: partial copies].

    Example:
        >>> partial_axes("partial_reshard", Mesh({"node": 2, "local": 4}))
        (('local',), ('node',))
        >>> partial_axes("full_shard", Mesh({"node": 2, "local": 4}))
        ((), ())
    """
    if keeps_partial_copy(strategy) is None:
        return (), ()
    return mesh.axis_names[-1:], mesh.axis_names[:-1]


def partial_copy_lifetime(
    strategy: Strategy, mesh: Mesh, /, *, is_root: bool = False
) -> Literal["call", "step"] | None:
    """How long a unit of ``strategy`` on ``mesh`` keeps a partial copy (:func:`keeps_partial_copy`).

    ``None`` also where it keeps none although its strategy would: the root unit,
    and a mesh on which the copy is the shard (one row: the other axes have one
    rank), where the unit is gathered as ``full_shard``'s. The executor and the cost
    model both ask here; see [Note: partial copies].

    Example:
        >>> partial_copy_lifetime("partial_reshard", Mesh({"node": 2, "local": 4}))
        'call'
        >>> partial_copy_lifetime("partial_reshard", Mesh({"fsdp": 8})) is None
        True
    """
    lifetime = keeps_partial_copy(strategy)
    _, replicated = partial_axes(strategy, mesh)
    if lifetime is None or is_root or math.prod(mesh.axis_size(a) for a in replicated) == 1:
        return None
    return lifetime


def reduces_in_two_hops(strategy: Strategy, mesh: Mesh, /, *, is_root: bool = False) -> bool:
    """Whether a unit of ``strategy`` on ``mesh`` reduces its gradients in two hops.

    Over the last axis each reduction, then over the others once a step: a unit that
    keeps its partial copy for the step where the copy is neither the shard nor the
    whole unit. The executor and the cost model both ask here; see [Note: two-hop
    reductions] in ``execute/param_group.py``.

    Example:
        >>> reduces_in_two_hops("hybrid_shard_optimizer", Mesh({"node": 2, "local": 4}))
        True
        >>> reduces_in_two_hops("hybrid_shard_optimizer", Mesh({"node": 2, "local": 1}))
        False
    """
    regather, _ = partial_axes(strategy, mesh)
    return (
        partial_copy_lifetime(strategy, mesh, is_root=is_root) == "step"
        and math.prod(mesh.axis_size(a) for a in regather) > 1
    )


def shard_axes(strategy: Strategy, mesh: Mesh, /) -> tuple[str, ...]:
    """The mesh axes that ``strategy`` may shard a leaf over, major first.

    Example:
        >>> mesh = Mesh({"dp": 2, "fsdp": 4})
        >>> shard_axes("full_shard", mesh), shard_axes("hybrid_shard", mesh), shard_axes("no_shard", mesh)
        (('dp', 'fsdp'), ('fsdp',), ())
        >>> shard_axes("shard_optimizer", mesh), shard_axes("hybrid_shard_optimizer", mesh)
        (('dp', 'fsdp'), ('dp', 'fsdp'))
    """
    if strategy == "no_shard":
        return ()
    if strategy == "hybrid_shard":
        return mesh.axis_names[-1:]
    return mesh.axis_names


@dataclass(frozen=True)
class Capabilities:
    """What the transport does for a group, as the cost model and the executor ask.

    A transport declares them (``comm/transport.py``, [Note: transports] there);
    the plan knows no transport by name.

    Attributes:
        gathers_leaf_by_leaf: a part of several leaves, each split evenly on dim 0,
            is gathered straight into each leaf's full storage
            (execute/unit_state.py, [Note: persistent gathered storage]): no
            staging buffer (plan/unit_cost.py counts none) and no unpacking copy.
        sends_inputs_in_place: an input packed into a buffer the transport gives
            out is sent as it is, with no copy.
    """

    gathers_leaf_by_leaf: bool = False
    sends_inputs_in_place: bool = False


_DECLARED: list[Callable[[str, int], Capabilities]] = []


def declare_transport(capabilities: Callable[[str, int], Capabilities], /) -> None:
    """Declares what the transport does, by backend and group size; replaces an earlier declaration.

    Called once by ``comm/transport.py`` when it is imported (as ``import funcshard`` does).
    """
    _DECLARED[:] = [capabilities]


def transport_capabilities(backend: str, group_size: int, /) -> Capabilities:
    """The declared transport's :class:`Capabilities` for a group of ``group_size`` ranks on ``backend``.

    Nothing special where no transport was declared.

    Example:
        >>> isinstance(transport_capabilities("gloo", 2), Capabilities)
        True
    """
    if not _DECLARED:
        return Capabilities()
    return _DECLARED[0](backend, group_size)


def default_spec(
    shape: tuple[int, ...], strategy: Strategy, mesh: Mesh, /, how: str = "dim_0"
) -> P:
    """The spec of a leaf no rule matches: one dim split over the strategy's shard axes.

    ``how="dim_0"`` (the default) splits dim 0, unless another dim needs less
    zero padding to divide by the shard count (the one needing least; ties go to
    the first): a shard of dim 0 is one contiguous range of the leaf, so packing
    and unpacking it are plain copies and a unit of one such leaf is gathered in
    place. ``how="largest_dim"`` splits the largest dim (ties: the first). Scalars
    and ``no_shard`` replicate. Either is an ordinary ``PartitionSpec``.

    Example:
        >>> default_spec((8, 32), "full_shard", Mesh({"dp": 2, "fsdp": 2}))
        P(('dp', 'fsdp'))
        >>> default_spec((2, 32), "full_shard", Mesh({"fsdp": 4}))  # dim 0 would pad 2 rows
        P(None, 'fsdp')
        >>> default_spec((8, 32), "full_shard", Mesh({"fsdp": 2}), "largest_dim")
        P(None, 'fsdp')
        >>> default_spec((), "full_shard", Mesh({"fsdp": 2}))
        P()
    """
    axes = shard_axes(strategy, mesh)
    if not shape or not axes:
        return P()
    if how == "largest_dim":
        dim = max(range(len(shape)), key=lambda d: (shape[d], -d))
    else:
        count = math.prod(mesh.axis_size(a) for a in axes)
        numel = math.prod(shape)

        def padding(d: int) -> int:  # elements of zero padding when dim d is split
            if shape[d] == 0:
                return 0
            return (-shape[d] % count) * (numel // shape[d])

        dim = min(range(len(shape)), key=lambda d: (padding(d), d))
    entry = axes[0] if len(axes) == 1 else axes
    return P(*([None] * dim), entry)
