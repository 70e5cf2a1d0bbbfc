"""Cost model: bytes each rank holds and sends per step, and an estimate of the step time.

Pure Python over a :class:`Plan` (shapes and dtypes only): it plans a 70B run on a
laptop. Sharded state is counted exactly as the executor allocates it, padding
included (a rank holds each leaf's padded chunk, :meth:`NamedSharding.shard_shape`),
and communication follows the ledger's convention (bandwidth-optimal algorithms;
see ``funcshard._src.comm.ledger``), so both equal what a run measures. Gathered
parameters, activations and the step time are estimates; every
:class:`Estimate` lists the assumptions behind them.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Literal, TypeAlias

import torch

from funcshard._src.plan.activations import Workload, activations_of
from funcshard._src.plan.hardware import Hardware
from funcshard._src.plan.plan import Plan
from funcshard._src.plan.precision import FULL_PRECISION, MixedPrecision
from funcshard._src.plan.step_time import StepTime, step_time
from funcshard._src.plan.strategy import Strategy, shard_axes
from funcshard._src.plan.units import Unit

Key = tuple[str, tuple[str, ...]]
OptimizerName: TypeAlias = Literal["sgd", "sgd_momentum", "adamw"]
OPTIMIZERS: tuple[OptimizerName, ...] = ("sgd", "sgd_momentum", "adamw")
_STATE_COPIES: Mapping[OptimizerName, int] = {"sgd": 0, "sgd_momentum": 1, "adamw": 2}
_COUNTER_BYTES = 8  # every optimizer's int64 update counter
# passes over the optimizer's state per update: reads and writes / state copies
# (SGD: read p and g, write p, over 2 copies; with momentum 5 over 3; AdamW 7 over 4)
_PASSES: Mapping[OptimizerName, float] = {"sgd": 3 / 2, "sgd_momentum": 5 / 3, "adamw": 7 / 4}


@dataclass(frozen=True)
class CostModel:
    """How a plan will be trained, which decides what it costs.

    Attributes:
        optimizer: ``"sgd"``, ``"sgd_momentum"`` or ``"adamw"`` (state: 0, 1 or 2
            copies of the sharded params, and an int64 counter).
        mixed_precision: gather/compute and reduce dtypes.
        master_weights: model the layout of DeepSpeed and Megatron: params stored in
            a low-precision dtype, the optimizer keeps an fp32 master copy and fp32
            state. funcshard's own optimizers update params in their stored dtype;
            this option is for comparing with those systems.
        prefetch: the executor's prefetch (units gathered ahead).
        accumulate: ``"sharded"`` (reduce every micro-batch) or ``"unsharded"`` (keep
            full gradients until the last micro-batch, as ``step.accumulate`` does).
        workload: batch and model shape, for activations and compute time.
        hardware: for the step-time estimate.

    Example:
        >>> import torch
        >>> from funcshard._src.plan.planner import plan
        >>> from funcshard._src.spec.mesh import Mesh
        >>> p = plan({"w": torch.zeros(1024, 1024)}, Mesh({"fsdp": 4}))
        >>> CostModel(optimizer="adamw").estimate(p).memory.optimizer
        2097160
    """

    optimizer: OptimizerName = "adamw"
    mixed_precision: MixedPrecision | None = None
    master_weights: bool = False
    prefetch: int = 1
    accumulate: Literal["sharded", "unsharded"] = "sharded"
    workload: Workload | None = None
    hardware: Hardware | None = None

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"unknown optimizer {self.optimizer!r}; choose one of {list(OPTIMIZERS)}"
            )
        if self.prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {self.prefetch}")
        if self.accumulate not in ("sharded", "unsharded"):
            raise ValueError(
                f"accumulate must be 'sharded' or 'unsharded', got {self.accumulate!r}"
            )

    def estimate(self, plan: Plan, /) -> Estimate:
        """What ``plan`` costs each rank under this model (see :class:`Estimate`)."""
        return estimate(plan, self)


@dataclass(frozen=True)
class Memory:
    """Bytes one rank holds, by category. Sharded categories are exact; the others estimates.

    Attributes:
        params: sharded parameters as stored (padding included).
        grads: sharded gradients, in the stored dtype as the executor returns them
            (fp32 with master weights; integer leaves get zeros).
        optimizer: optimizer state (moments and counter; fp32 with master weights).
        mixed_precision: fp32 master copies of low-precision params (``master_weights``).
        gathered: the peak of gathered units alive: the root unit, every
            ``shard_grad_op`` unit (kept from forward to backward), ``1 + prefetch``
            of the largest other units, and one unit's unreduced gradients in the
            compute dtype (all of them with ``accumulate="unsharded"``).
        activations: estimated from the workload (0 without one).
    """

    params: int
    grads: int
    optimizer: int
    mixed_precision: int
    gathered: int
    activations: int

    @property
    def model_state(self) -> int:
        """Everything but activations."""
        return self.total - self.activations

    @property
    def total(self) -> int:
        """The sum of every category."""
        return sum(getattr(self, f.name) for f in fields(self))

    def rows(self) -> list[tuple[str, int]]:
        """``[(category, bytes), ...]`` in a fixed order, for tables."""
        return [(f.name.replace("_", " "), getattr(self, f.name)) for f in fields(self)]


@dataclass(frozen=True)
class Estimate:
    """What a plan costs one rank per step.

    Attributes:
        memory: bytes held, by category.
        comm: bytes sent per step by ``(op, mesh axes)`` (equals the ledger).
        time: the step-time estimate (``None`` without a workload and hardware).
        assumptions: what the estimate assumes, in words.
    """

    memory: Memory
    comm: Mapping[Key, int]
    time: StepTime | None = None
    assumptions: tuple[str, ...] = field(default=())

    def comm_by_axes(self) -> dict[tuple[str, ...], int]:
        """Bytes sent per step on each group of mesh axes, over every op."""
        out: dict[tuple[str, ...], int] = {}
        for (_, axes), n in self.comm.items():
            out[axes] = out.get(axes, 0) + n
        return out


def shard_numel(plan: Plan, unit: Unit, /) -> dict[torch.dtype, int]:
    """Elements of ``unit``'s flat buffer on one rank, per dtype (padding included)."""
    out: dict[torch.dtype, int] = {}
    for path in unit.paths:
        leaf = plan.leaf(path)
        out[leaf.dtype] = out.get(leaf.dtype, 0) + math.prod(
            leaf.sharding(plan.mesh).shard_shape(leaf.shape)
        )
    return out


def full_numel(plan: Plan, unit: Unit, /) -> dict[torch.dtype, int]:
    """Elements of ``unit``'s leaves, whole, per dtype."""
    out: dict[torch.dtype, int] = {}
    for path in unit.paths:
        leaf = plan.leaf(path)
        out[leaf.dtype] = out.get(leaf.dtype, 0) + leaf.numel
    return out


def param_bytes_per_rank(plan: Plan, /) -> int:
    """Bytes of sharded parameters one rank holds.

    Example:
        >>> from funcshard._src.plan.planner import plan as make_plan
        >>> from funcshard._src.spec.mesh import Mesh
        >>> param_bytes_per_rank(make_plan({"w": torch.zeros(10, 4)}, Mesh({"fsdp": 4})))
        48
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
    grads: int
    optimizer: int
    mixed_precision: int
    gathered: int  # its leaves whole, in the compute dtype (0 when they alias the shard)
    unreduced_grads: int  # its gradients whole, in the compute dtype, before reduction
    deferred_grads: int  # packed full gradients kept across micro-batches ("unsharded")
    comm: Mapping[Key, int]
    n_params: int


def unit_cost(plan: Plan, unit: Unit, model: CostModel, /) -> UnitCost:
    """The bytes one rank holds and sends for ``unit`` (see :class:`Memory` for each category)."""
    mp = model.mixed_precision or FULL_PRECISION
    mesh = plan.mesh
    axes = shard_axes(unit.strategy, mesh)
    replica = tuple(a for a in mesh.axis_names if a not in axes)
    g = math.prod(mesh.axis_size(a) for a in axes)
    r = math.prod(mesh.axis_size(a) for a in replica)
    gathers = 2 if unit.strategy == "full_shard" and not unit.is_root else 1
    copies = _STATE_COPIES[model.optimizer]
    params = grads = optimizer = master = gathered = unreduced = deferred = 0
    comm: Counter[Key] = Counter()
    full = full_numel(plan, unit)
    for dtype, n in shard_numel(plan, unit).items():
        compute, grad = mp.compute_dtype(dtype), mp.gradient_dtype(dtype)
        params += n * dtype.itemsize
        if not dtype.is_floating_point:
            grads += n * dtype.itemsize  # zeros, as the executor returns
            optimizer += copies * n * dtype.itemsize
        elif model.master_weights:
            grads += n * 4  # the fp32 gradient partition
            optimizer += copies * n * 4
            master += n * 4 if dtype.itemsize < 4 else 0
        else:
            grads += n * dtype.itemsize  # reduced in ``grad``, returned in the stored dtype
            optimizer += copies * n * dtype.itemsize
        if g > 1 or compute != dtype:
            gathered += full[dtype] * compute.itemsize
        if dtype.is_floating_point:
            unreduced += full[dtype] * compute.itemsize
            deferred += g * n * grad.itemsize
        if g > 1:
            comm[("all_gather", axes)] += gathers * (g - 1) * n * compute.itemsize
        if not dtype.is_floating_point:
            continue
        if g > 1:
            comm[("reduce_scatter", axes)] += (g - 1) * n * grad.itemsize
        if r > 1:
            comm[("all_reduce", replica)] += 2 * n * grad.itemsize * (r - 1) // r
    return UnitCost(
        unit.name,
        unit.strategy,
        unit.is_root,
        params,
        grads,
        optimizer,
        master,
        gathered,
        unreduced,
        deferred,
        comm,
        sum(full.values()),
    )


def comm_bytes_per_step(
    plan: Plan, /, mixed_precision: MixedPrecision | None = None
) -> Counter[Key]:
    """Bytes one rank sends in one step (forward and backward of one batch), by ``(op, axes)``.

    Per unit and dtype, with ``B`` its flat buffer's bytes on one rank and ``g`` the
    size of its shard group: a ``full_shard`` unit is all-gathered twice (forward,
    and again for backward), the root unit and ``shard_grad_op`` units once; each
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
    """Adds up unit costs into one rank's :class:`Memory` (activations not included)."""
    root = sum(c.gathered for c in costs if c.is_root)
    kept = sum(c.gathered for c in costs if c.strategy == "shard_grad_op" and not c.is_root)
    others = sorted(
        (c.gathered for c in costs if c.strategy != "shard_grad_op" and not c.is_root),
        reverse=True,
    )
    alive = sum(others[: 1 + model.prefetch])
    if model.accumulate == "unsharded":
        grads_alive = sum(c.deferred_grads for c in costs) + max(
            (c.unreduced_grads for c in costs), default=0
        )
    else:
        grads_alive = max((c.unreduced_grads for c in costs), default=0)
    return Memory(
        params=sum(c.params for c in costs),
        grads=sum(c.grads for c in costs),
        optimizer=sum(c.optimizer for c in costs) + _COUNTER_BYTES,
        mixed_precision=sum(c.mixed_precision for c in costs),
        gathered=root + kept + alive + grads_alive,
        activations=0,
    )


def estimate(plan: Plan, model: CostModel | None = None, /) -> Estimate:
    """What ``plan`` costs one rank per step under ``model`` (default: AdamW, stored dtypes).

    Example:
        >>> from funcshard._src.plan.planner import plan as make_plan
        >>> from funcshard._src.spec.mesh import Mesh
        >>> e = estimate(make_plan({"w": torch.zeros(256, 256)}, Mesh({"fsdp": 4})))
        >>> e.memory.params, e.memory.grads, dict(e.comm)
        (65536, 65536, {('all_gather', ('fsdp',)): 196608, ('reduce_scatter', ('fsdp',)): 196608})
    """
    model = model or CostModel()
    costs = [unit_cost(plan, unit, model) for unit in plan.units]
    comm: Counter[Key] = Counter()
    for c in costs:
        comm.update(c.comm)
    memory = memory_of(costs, model)
    assumptions = [
        f"optimizer {model.optimizer}"
        + (" with fp32 master weights (DeepSpeed/Megatron layout)" if model.master_weights else ""),
        f"mixed precision: {_describe_mp(model.mixed_precision)}",
        f"gathered: root unit + shard_grad_op units + {1 + model.prefetch} largest other units "
        f"(prefetch {model.prefetch}) + one unit's unreduced gradients; collective staging "
        f"buffers are transient and not counted",
        "communication: bandwidth-optimal (ring) algorithms, bytes sent per rank",
    ]
    workload = model.workload
    if workload is not None:
        activations = activations_of(
            workload, model.mixed_precision, [leaf.dtype for leaf in plan.leaves]
        )
        memory = dataclasses.replace(memory, activations=activations)
        assumptions.append(
            f"activations: {workload.batch_size} x {workload.seq_len or workload.model.seq_len} "
            f"tokens per rank, {'with' if workload.remat else 'without'} remat, "
            f"{'flash' if workload.flash_attention else 'eager'} attention "
            f"(Korthikanti et al. 2022 per-layer formula)"
        )
    time = None
    if workload is not None and model.hardware is not None:
        sharded = sum(1 for c in costs if any(op != "all_reduce" for op, _ in c.comm))
        time = step_time(
            n_params=sum(c.n_params for c in costs),
            comm=comm,
            mesh=plan.mesh,
            workload=workload,
            hardware=model.hardware,
            prefetch=model.prefetch,
            sharded_units=sharded,
            state_bytes=sum(c.params + c.grads + c.optimizer + c.mixed_precision for c in costs),
            optimizer_passes=_PASSES[model.optimizer],
        )
        hw = model.hardware
        assumptions.append(
            f"time on {hw.name}: {hw.efficiency:.0%} of {hw.peak_flops / 1e12:.0f} TFLOP/s peak; "
            f"6 FLOPs per parameter and token (8 with remat) plus attention; links "
            f"{hw.intra_node_bandwidth / 1e9:.0f} GB/s in a node of {hw.devices_per_node}, "
            f"{hw.inter_node_bandwidth / 1e9:.0f} GB/s across; communication overlaps compute "
            f"{'except one unit' if model.prefetch else 'not at all (prefetch 0)'}"
        )
    return Estimate(memory, dict(comm), time, tuple(assumptions))


def _describe_mp(mp: MixedPrecision | None) -> str:
    if mp is None or mp == FULL_PRECISION:
        return "none (compute and reduce in the stored dtypes)"

    def name(dtype: torch.dtype | None) -> str:
        return "stored" if dtype is None else str(dtype).removeprefix("torch.")

    return f"compute {name(mp.param_dtype)}, reduce {name(mp.reduce_dtype)}"
