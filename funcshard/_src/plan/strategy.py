"""Sharding strategies per unit, and the mesh axes each one shards over.

``full_shard`` is ZeRO-3 (free after forward, re-gather for backward),
``shard_grad_op`` ZeRO-2 (keep gathered from forward to backward), ``shard_optimizer``
ZeRO-1 (gathered once per step and kept for all its micro-batches, gradients kept
whole until the step's last micro-batch, then reduce-scattered), ``no_shard`` DDP
(replicate, all-reduce gradients) and ``hybrid_shard`` shards over the last mesh
axis and replicates over the others, freed after forward as ``full_shard``
(PyTorch FSDP's ``HYBRID_SHARD``: reduce-scatter inside the shard group,
all-reduce across replicas).

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
"""

from __future__ import annotations

import math
from typing import Literal, TypeAlias

from funcshard._src.spec.mesh import Mesh
from funcshard._src.spec.partition_spec import P

Strategy: TypeAlias = Literal[
    "full_shard", "shard_grad_op", "shard_optimizer", "no_shard", "hybrid_shard"
]
STRATEGIES: tuple[Strategy, ...] = (
    "full_shard",
    "shard_grad_op",
    "shard_optimizer",
    "no_shard",
    "hybrid_shard",
)


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
    return strategy in ("full_shard", "hybrid_shard")


def keeps_for_step(strategy: Strategy, /) -> bool:
    """Whether a unit of ``strategy`` stays gathered, and keeps its gradients whole, across a step's micro-batches.

    See [Note: shard_optimizer].

    Example:
        >>> keeps_for_step("shard_optimizer"), keeps_for_step("shard_grad_op")
        (True, False)
    """
    return strategy == "shard_optimizer"


def shard_axes(strategy: Strategy, mesh: Mesh, /) -> tuple[str, ...]:
    """The mesh axes that ``strategy`` may shard a leaf over, major first.

    Example:
        >>> mesh = Mesh({"dp": 2, "fsdp": 4})
        >>> shard_axes("full_shard", mesh), shard_axes("hybrid_shard", mesh), shard_axes("no_shard", mesh)
        (('dp', 'fsdp'), ('fsdp',), ())
        >>> shard_axes("shard_optimizer", mesh)
        ('dp', 'fsdp')
    """
    if strategy == "no_shard":
        return ()
    if strategy == "hybrid_shard":
        return mesh.axis_names[-1:]
    return mesh.axis_names


# Where a part of several leaves is gathered leaf by leaf into its storage
# (execute/unit_state.py, [Note: persistent gathered storage]): (backend, group size). On
# gloo over two ranks one ring per leaf writes straight into the leaf and saves the
# unpacking copy into fresh pages (comm/all_gather.py, leaf_algorithm). Elsewhere it is not
# measured: gloo's native all-gather and its rings over more ranks step through buffers or
# waits of their own, and on nccl one collective per leaf costs a launch each where the
# unpacking copy is cheap. execute/gather_group.py gathers so and plan/unit_cost.py counts no
# staging buffer for such a part.
LEAF_GATHERS: frozenset[tuple[str, int]] = frozenset({("gloo", 2)})


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
