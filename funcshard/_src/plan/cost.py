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
from collections import Counter
from typing import Any

import torch

from funcshard._src import tree
from funcshard._src.plan.activations import activation_parts
from funcshard._src.plan.cost_model import (
    CostModel,
    describe_reserve,
    reserve_bytes,
    step_time_under,
)
from funcshard._src.plan.estimates import Estimate, Key
from funcshard._src.plan.plan import Plan
from funcshard._src.plan.precision import describe_precision
from funcshard._src.plan.rules import pattern_repr
from funcshard._src.plan.sizes import parse_bytes
from funcshard._src.plan.step_time import describe as describe_time
from funcshard._src.plan.unit_cost import memory_of, trains, unit_cost


def estimate(
    plan: Plan,
    model: CostModel | None = None,
    /,
    *,
    state: Any = None,
    budget: int | str | None = None,
) -> Estimate:
    """What ``plan`` costs one rank per step under ``model`` (default: AdamW, stored dtypes).

    Frozen leaves are counted in ``memory.frozen`` (sharded, no gradient or optimizer
    state); ``state`` is a pytree of the tensors every rank holds whole besides the
    params (an ``nn.Module``'s buffers: ``apply.state``), counted in ``memory.buffers``
    (else ``model.buffers``). ``budget`` (default: ``plan.memory_budget``) gives the
    estimate its reserve (``model.reserve``) and whether the plan fits what is left.

    Example:
        >>> from funcshard._src.plan.planner import plan as make_plan
        >>> from funcshard._src.spec.mesh import Mesh
        >>> e = estimate(make_plan({"w": torch.zeros(256, 256)}, Mesh({"fsdp": 4})))
        >>> e.memory.params, e.memory.grads, dict(e.comm)
        (65536, 65536, {('all_gather', ('fsdp',)): 196608, ('reduce_scatter', ('fsdp',)): 196608})
        >>> e.memory.staging  # one leaf split on dim 0: gathered in place; reduced from 4 rows
        262144
        >>> from funcshard._src.plan.cost_model import CostModel
        >>> plan4 = make_plan({"w": torch.zeros(256, 256)}, Mesh({"fsdp": 4}))
        >>> estimate(plan4, CostModel(async_checkpoint=True)).checkpoint_staging  # params + 2 moments + count
        196616
    """
    model = model or CostModel()
    costs = [unit_cost(plan, unit, model) for unit in plan.units]
    comm: Counter[Key] = Counter()
    for c in costs:
        comm.update(c.comm)
    memory = memory_of(costs, model)
    if state is not None:
        memory = dataclasses.replace(memory, buffers=_tensor_bytes(state))
    assumptions = [
        f"optimizer {model.optimizer}"
        + (" with fp32 master weights (DeepSpeed/Megatron layout)" if model.master_weights else ""),
        f"mixed precision: {describe_precision(model.mixed_precision)}",
        f"gathered: root unit + every unit kept from forward to backward + the "
        f"{1 + model.prefetch} largest units freed after forward (prefetch {model.prefetch}) "
        f"+ one unit's unreduced gradients"
        + (" + every unit's partial copy" if any(c.partial for c in costs) else ""),
        f"{model.micro_batches} micro-batch(es) per optimizer step, accumulated "
        f"{model.accumulate}; bytes sent per optimizer step",
        "staging: the largest all-gather output and reduce-scatter input, as the executor "
        "allocates them (one reduction in flight)",
        "communication: bandwidth-optimal (ring) algorithms, bytes sent per rank"
        + (
            "; a unit with no trained leaf needs no backward (a frozen prefix)"
            if any(not trains(plan, u) for u in plan.units if not u.is_root)
            else ""
        ),
    ]
    q = model.quantize
    if q is not None:
        what = " and ".join(
            f"{w} as {fmt}"
            for w, fmt in (
                ("parameter gathers from shards", q.weight_format),
                ("gradient reductions", q.gradient_format),
            )
            if fmt
        )
        units = ", ".join(pattern_repr(u) for u in q.units)
        assumptions.append(
            f"quantized: {what}, with an fp32 scale per {q.block} elements, for units "
            f"{units} (bytes as sent)"
        )
    workload = model.workload
    if workload is not None:
        activations, logits = activation_parts(
            workload, model.mixed_precision, [leaf.dtype for leaf in plan.leaves]
        )
        memory = dataclasses.replace(memory, activations=activations, logits=logits)
        assumptions.append(
            f"activations: {workload.batch_size} x {workload.seq_len or workload.model.seq_len} "
            f"tokens per rank, {'with' if workload.remat else 'without'} remat, "
            f"{'flash' if workload.flash_attention else 'eager'} attention "
            f"(Korthikanti et al. 2022 per-layer formula); "
            + (
                f"logits and loss over a vocabulary of {workload.model.vocab:,}, "
                f"in the compute dtype and twice in fp32"
                if workload.logits
                else "logits not held whole (fused or chunked loss)"
            )
        )
    if budget is None:
        budget = plan.memory_budget
    reserve = 0
    if budget is not None:
        budget = parse_bytes(budget)
        reserve = reserve_bytes(budget, model)
        assumptions.append(
            f"reserve for the CUDA context, communicator buffers and fragmentation: "
            f"{describe_reserve(model)}"
        )
    time = step_time_under(
        model,
        plan.mesh,
        n_params=sum(c.n_params for c in costs),
        comm=comm,
        sharded_units=sum(1 for c in costs if any(op != "all_reduce" for op, _ in c.comm)),
        state_bytes=sum(c.params + c.grads + c.optimizer + c.mixed_precision for c in costs),
    )
    if model.hardware is not None and time is not None:
        assumptions.append(describe_time(model.hardware, model.prefetch))
    staging = memory.params + memory.frozen + memory.optimizer if model.async_checkpoint else 0
    if staging:
        assumptions.append(
            "checkpoint staging (host): one copy of this rank's params, frozen params and "
            "optimizer state, as fs.checkpoint.AsyncCheckpointer holds it"
        )
    return Estimate(memory, dict(comm), time, tuple(assumptions), budget, reserve, staging)


def _tensor_bytes(state: Any) -> int:
    total = 0
    for path, leaf in zip(*tree.flatten_with_paths(state)[:2]):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"estimate: state leaf {path or '<root>'!r} is a {type(leaf).__name__}, not a "
                f"tensor; pass a pytree of tensors (apply.state)"
            )
        total += leaf.numel() * leaf.element_size()
    return total
