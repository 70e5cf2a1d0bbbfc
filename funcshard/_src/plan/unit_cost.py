"""What one unit costs one rank: bytes held and sent per step, exactly as the executor allocates them.

Pure Python over a :class:`Plan` (shapes and dtypes only). Sharded state is counted
exactly as the executor allocates it, padding included (a rank holds each leaf's
padded chunk, :meth:`NamedSharding.shard_shape`), and communication follows the
ledger's convention (bandwidth-optimal algorithms; see ``funcshard._src.comm.ledger``),
so both equal what a run measures. :func:`memory_of` adds units up into one rank's
memory; ``cost.py`` builds the whole :class:`Estimate` on it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from funcshard._src.plan.cost_model import (
    COUNTER_BYTES,
    STATE_COPIES,
    CostModel,
)
from funcshard._src.plan.estimates import Key, Memory
from funcshard._src.plan.plan import Plan
from funcshard._src.plan.precision import FULL_PRECISION, MixedPrecision
from funcshard._src.plan.quantize import quantize_for, quantized_bytes
from funcshard._src.plan.step_counts import collectives_per_step, gathers_from_shards
from funcshard._src.plan.strategy import (
    Strategy,
    keeps_for_step,
    partial_axes,
    partial_copy_lifetime,
    reduces_in_two_hops,
    reshards_after_forward,
    shard_axes,
    transport_capabilities,
)
from funcshard._src.plan.units import Unit


def shard_numel(plan: Plan, unit: Unit, /) -> dict[torch.dtype, int]:
    """Elements of ``unit``'s flat buffers on one rank, per dtype (padding included)."""
    out: dict[torch.dtype, int] = {}
    for (dtype, _), n in _numel_by_part(plan, unit, whole=False).items():
        out[dtype] = out.get(dtype, 0) + n
    return out


def param_bytes_per_rank(plan: Plan, /) -> int:
    """Bytes of sharded parameters one rank holds, padding included.

    Example:
        >>> from funcshard._src.plan.planner import plan as make_plan
        >>> from funcshard._src.spec.mesh import Mesh
        >>> param_bytes_per_rank(make_plan({"w": torch.zeros(10, 3)}, Mesh({"fsdp": 4})))
        36
    """
    return sum(
        n * dtype.itemsize for unit in plan.units for dtype, n in shard_numel(plan, unit).items()
    )


@dataclass(frozen=True)
class UnitCost:
    """One unit's bytes on one rank under a cost model (the pieces :func:`estimate` adds up)."""

    name: str
    strategy: Strategy
    is_root: bool
    params: int
    frozen: int
    grads: int
    optimizer: int
    mixed_precision: int
    gathered: int  # its leaves whole, in the compute dtype (0 when they alias the shard)
    unreduced_grads: int  # its gradients whole, in the compute dtype, before reduction
    deferred_grads: int  # packed full gradients kept across micro-batches ("unsharded")
    comm: Mapping[Key, int]
    n_params: int
    gather_buffer: int = 0  # the all-gather's output, (group_size * shard) in the compute dtype
    reduce_buffer: int = 0  # the reduce-scatter's input, (group_size * shard) in the reduce dtype
    partial: int = (
        0  # its partial copy, in the compute dtype ([Note: partial copies] in ``plan/strategy.py``)
    )
    partial_grads: int = 0  # its partial gradient, in the stored dtype (two-hop reductions)


def trains(plan: Plan, unit: Unit, /) -> bool:
    """Whether ``unit`` has a trained leaf: floating point and not frozen.

    Example:
        >>> import torch
        >>> from funcshard._src.plan.planner import plan as make_plan
        >>> from funcshard._src.spec.mesh import Mesh
        >>> p = make_plan({"a": {"w": torch.zeros(2)}, "b": {"w": torch.zeros(2)}}, Mesh({"fsdp": 1}),
        ...     units=["a", "b"], frozen=["a/**"])
        >>> [(u.name, trains(p, u)) for u in p.units]
        [('a', False), ('b', True)]
    """
    return any(plan.leaf(p).trained for p in unit.paths)


def unit_cost(plan: Plan, unit: Unit, model: CostModel, /) -> UnitCost:
    """The bytes one rank holds and sends for ``unit`` (see :class:`Memory` for each category)."""
    mp = model.mixed_precision or FULL_PRECISION
    mesh = plan.mesh
    axes = shard_axes(unit.strategy, mesh)
    replica = tuple(a for a in mesh.axis_names if a not in axes)
    g = math.prod(mesh.axis_size(a) for a in axes)
    r = math.prod(mesh.axis_size(a) for a in replica)
    # a unit with no trained leaf is taken to need no backward: [Note: calls without a
    # backward] in execute/run.py
    trained = trains(plan, unit)
    gathers, reductions = collectives_per_step(unit, model, trained=trained)
    # the partial copy ([Note: partial copies] in strategy.py): copy_rows shards, re-gathered
    # over the last axis (of size regather) by every gather but those from the shards
    regather_axes, replicated = partial_axes(unit.strategy, mesh)
    copy_rows = math.prod(mesh.axis_size(a) for a in replicated)
    regather = math.prod(mesh.axis_size(a) for a in regather_axes)
    lifetime = partial_copy_lifetime(unit.strategy, mesh, is_root=unit.is_root)
    partial = lifetime is not None
    # [Note: two-hop reductions] in execute/param_group.py: over the last axis each reduction,
    # into a partial gradient, and over the others once a step
    two_hop = reduces_in_two_hops(unit.strategy, mesh, is_root=unit.is_root)
    from_shards = gathers_from_shards(unit, model, trained=trained) if partial else gathers
    copies = STATE_COPIES[model.optimizer]
    params = frozen = grads = optimizer = master = gathered = unreduced = deferred = 0
    gather_buffer = reduce_buffer = partial_copy = partial_grads = 0
    comm: Counter[Key] = Counter()
    full = _numel_by_part(plan, unit, whole=True)
    # [Note: quantized collectives] in quantize.py: floating parts gathered from shards and
    # trained parts reduced as int8 blocks, staged (never in place)
    quantize = quantize_for(model.quantize, unit.name) if g > 1 else None
    block = quantize.block if quantize is not None else 0
    weights = quantize.weight_format if quantize is not None else None
    gradients = quantize.gradient_format if quantize is not None else None
    leafwise = (
        transport_capabilities(model.backend, g).gathers_leaf_by_leaf
        and not partial
        and not weights
    )
    in_place: set[tuple[torch.dtype, bool]] = (
        _gathers_in_place(plan, unit, axes, leafwise=leafwise) if g > 1 else set()
    )
    if unit.layout == "flat":  # its storage is the gathered buffer, end padding included
        full = {key: g * n for key, n in _numel_by_part(plan, unit, whole=False).items()}
    for (dtype, is_frozen), n in _numel_by_part(plan, unit, whole=False).items():
        compute, grad = mp.compute_dtype(dtype), mp.gradient_dtype(dtype)
        trained = dtype.is_floating_point and not is_frozen
        # the format of its gathers from shards, if quantized
        quantized = weights if compute.is_floating_point else None
        if is_frozen:
            frozen += n * dtype.itemsize  # no gradient, no optimizer state
        elif not dtype.is_floating_point:
            params += n * dtype.itemsize
            grads += n * dtype.itemsize  # zeros, as the executor returns
            optimizer += copies * n * dtype.itemsize
        elif model.master_weights:
            params += n * dtype.itemsize
            grads += n * 4  # the fp32 gradient partition
            optimizer += copies * n * 4
            master += n * 4 if dtype.itemsize < 4 else 0
        else:
            params += n * dtype.itemsize
            grads += n * dtype.itemsize  # reduced in ``grad``, returned in the stored dtype
            optimizer += copies * n * dtype.itemsize
        if g > 1 or compute != dtype:  # else the full leaves alias the shard
            gathered += full[(dtype, is_frozen)] * compute.itemsize
            # See [Note: staging buffers]
            staged = partial or quantized or (dtype, is_frozen) not in in_place
            gather_buffer += g * n * compute.itemsize if staged else 0
            # the quantized shard sent and every rank's received
            gather_buffer += (1 + g) * quantized_bytes(n, block, quantized) if quantized else 0
        if partial:
            partial_copy += copy_rows * n * compute.itemsize
        if trained:
            unreduced += full[(dtype, is_frozen)] * compute.itemsize
            deferred += g * n * grad.itemsize
            # no_shard reduces in place: its packed rows are the gradient unless cast
            reduce_buffer += g * n * grad.itemsize if g > 1 or grad != dtype else 0
            # the quantized rows sent and received by the all-to-all
            reduce_buffer += 2 * g * quantized_bytes(n, block, gradients) if gradients else 0
            if two_hop:
                partial_grads += copy_rows * n * dtype.itemsize
        if g > 1:
            sent = quantized_bytes(n, block, quantized) if quantized else n * compute.itemsize
            comm[("all_gather", axes)] += from_shards * (g - 1) * sent
        if partial and regather > 1:
            copy = copy_rows * n * compute.itemsize
            comm[("all_gather", regather_axes)] += (gathers - from_shards) * (regather - 1) * copy
        if not trained:
            continue
        if two_hop:
            within = copy_rows * n  # the partial gradient's elements
            sent = (
                quantized_bytes(within, block, gradients) if gradients else within * grad.itemsize
            )
            comm[("reduce_scatter", regather_axes)] += reductions * (regather - 1) * sent
            sent = quantized_bytes(n, block, gradients) if gradients else n * grad.itemsize
            comm[("reduce_scatter", replicated)] += (copy_rows - 1) * sent
        elif g > 1:
            sent = quantized_bytes(n, block, gradients) if gradients else n * grad.itemsize
            comm[("reduce_scatter", axes)] += reductions * (g - 1) * sent
        if r > 1:
            comm[("all_reduce", replica)] += reductions * (2 * n * grad.itemsize * (r - 1) // r)
    return UnitCost(
        unit.name,
        unit.strategy,
        unit.is_root,
        params,
        frozen,
        grads,
        optimizer,
        master,
        gathered,
        unreduced,
        deferred,
        comm,
        sum(full.values()),
        gather_buffer,
        reduce_buffer,
        partial_copy,
        partial_grads,
    )


def defers(cost: UnitCost, model: CostModel, /) -> bool:
    """Whether the unit keeps its packed full gradients across micro-batches under ``model``.

    With ``accumulate="unsharded"`` every unit does (counted even for one micro-batch,
    the bound for any count); a ``shard_optimizer`` unit does with several.
    """
    return model.accumulate == "unsharded" or (
        keeps_for_step(cost.strategy) and model.micro_batches > 1
    )


# [Note: staging buffers]
# What the executor allocates for its collectives (execute/param_group.py, execute/param_group.py):
# - ParamGroup.prefetch: per part, an all-gather output of group_size * (shard numel) in the
#   compute dtype, alive from the gather's start until its leaves are copied out, when the
#   unit also holds its full leaves: the unit being unpacked holds both. None for a flat
#   unit's part (its storage is the gathered buffer) or a part gathered in place (one leaf split evenly on dim 0 over exactly the shard axes: its
#   output is its full storage; where the transport gathers leaf by leaf (gloo over two ranks), every leaf of the
#   part so split, one collective per leaf) or aliased (no collective, no cast). Buckets
#   (execute/param_group.py) gather their members packed: their staging is not modelled.
# - Reducer._reduce_part: per trained part, packed rows of group_size * (shard numel) in the
#   reduce dtype, alive while its reduction is in flight; MAX_PENDING = 1 reduction at a
#   time (the older is waited for before the next is packed). no_shard (group_size 1)
#   reduces the rows in place: they become the gradient, unless it is cast to another dtype.
# memory_of counts the largest of each, once: Memory.gathered already counts 1 + prefetch
# units' full leaves, which stand for the units in flight (a prefetched unit holds only its
# all-gather output until it is acquired).


def _gathers_in_place(
    plan: Plan, unit: Unit, axes: tuple[str, ...], /, *, leafwise: bool
) -> set[tuple[torch.dtype, bool]]:
    """The ``(dtype, frozen)`` parts of ``unit`` that the executor gathers into their full storage.

    Every part of a flat unit; a part of one leaf, split evenly on dim 0 over exactly ``axes`` and nowhere else
    (``funcshard._src.shard.flat.gathers_in_place``): an embedding or a head alone;
    with ``leafwise`` (``Capabilities.gathers_leaf_by_leaf``), a part whose every leaf is so split
    (``leaves_gather_in_place``), gathered one leaf at a time.
    """
    members: dict[tuple[torch.dtype, bool], list[str]] = {}
    for path in unit.paths:
        leaf = plan.leaf(path)
        members.setdefault((leaf.dtype, leaf.frozen), []).append(path)
    out: set[tuple[torch.dtype, bool]] = set()
    for key, paths in members.items():
        if unit.layout == "flat" or (
            (len(paths) == 1 or leafwise)
            and axes
            and all(_splits_on_dim_0(plan, p, axes) for p in paths)
        ):
            out.add(key)
    return out


def _splits_on_dim_0(plan: Plan, path: str, axes: tuple[str, ...], /) -> bool:
    """Whether leaf ``path`` is split evenly on dim 0 over exactly ``axes`` and nowhere else."""
    leaf = plan.leaf(path)
    sharding = leaf.sharding(plan.mesh)
    dims = sharding.dim_axes(len(leaf.shape))
    even = all(
        n * c == size
        for n, c, size in zip(
            sharding.num_shards(leaf.shape), sharding.shard_shape(leaf.shape), leaf.shape
        )
    )
    return bool(leaf.shape) and even and tuple(dims[0]) == axes and not any(dims[1:])


def _numel_by_part(
    plan: Plan, unit: Unit, /, *, whole: bool
) -> dict[tuple[torch.dtype, bool], int]:
    """Elements of ``unit`` per ``(dtype, frozen)``: on one rank (padded), or whole.

    A flat unit's part is its leaves' elements over the group size, rounded up.
    """
    out: dict[tuple[torch.dtype, bool], int] = {}
    flat = unit.layout == "flat" and not whole
    for path in unit.paths:
        leaf = plan.leaf(path)
        n = (
            leaf.numel
            if whole or flat
            else math.prod(leaf.sharding(plan.mesh).shard_shape(leaf.shape))
        )
        out[(leaf.dtype, leaf.frozen)] = out.get((leaf.dtype, leaf.frozen), 0) + n
    if flat:
        g = math.prod(plan.mesh.axis_size(a) for a in shard_axes(unit.strategy, plan.mesh))
        out = {key: -(-n // g) for key, n in out.items()}
    return out


def comm_bytes_per_step(
    plan: Plan, /, mixed_precision: MixedPrecision | None = None
) -> Counter[Key]:
    """Bytes one rank sends in one step (forward and backward of one batch), by ``(op, axes)``.

    Per unit and dtype, with ``B`` its flat buffer's bytes on one rank and ``g`` the
    size of its shard group: a ``full_shard`` or ``hybrid_shard`` unit is
    all-gathered twice (forward, and again for backward), the root unit and
    ``shard_grad_op`` and ``shard_optimizer`` units once; each
    sends ``(g - 1) * B`` bytes. Floating-point gradients are reduce-scattered
    once (``(g - 1) * B``), then all-reduced across replica axes of size ``r``
    (``2 * (r - 1) / r * B``): ``hybrid_shard`` across ``dp``, ``no_shard`` across
    every axis. Gathers move ``param_dtype`` bytes, reductions ``reduce_dtype`` bytes.
    """
    model = CostModel(mixed_precision=mixed_precision)
    total: Counter[Key] = Counter()
    for unit in plan.units:
        total.update(unit_cost(plan, unit, model).comm)
    return total


def memory_of(costs: list[UnitCost], model: CostModel, /) -> Memory:
    """Adds up unit costs into one rank's :class:`Memory` (activations and logits not included)."""
    root = sum(c.gathered for c in costs if c.is_root)
    # every unit that does not reshard after forward is kept to its backward (the executor's
    # UnitRuntime.frees_after_forward), shard_optimizer's across micro-batches too
    kept = sum(
        c.gathered for c in costs if not reshards_after_forward(c.strategy) and not c.is_root
    )
    others = sorted(
        (c.gathered for c in costs if reshards_after_forward(c.strategy) and not c.is_root),
        reverse=True,
    )
    alive = sum(others[: 1 + model.prefetch])
    grads_alive = sum(c.deferred_grads for c in costs if defers(c, model)) + max(
        (c.unreduced_grads for c in costs), default=0
    )
    # every partial copy is alive at the end of forward ([Note: partial copies] in ``plan/strategy.py``); partial
    # gradients ([Note: two-hop reductions] in execute/param_group.py): every unit's between
    # micro-batches, one unit's at a time within one
    across = model.micro_batches > 1 and model.accumulate == "sharded"
    partial_grads = [c.partial_grads for c in costs]
    partial = sum(c.partial for c in costs) + (
        sum(partial_grads) if across else max(partial_grads, default=0)
    )
    return Memory(
        staging=max((c.gather_buffer for c in costs), default=0)
        + max((c.reduce_buffer for c in costs), default=0),
        buffers=model.buffers,
        params=sum(c.params for c in costs),
        grads=sum(c.grads for c in costs),
        optimizer=sum(c.optimizer for c in costs) + COUNTER_BYTES,
        mixed_precision=sum(c.mixed_precision for c in costs),
        gathered=root + kept + alive + grads_alive + partial,
        activations=0,
        frozen=sum(c.frozen for c in costs),
    )
