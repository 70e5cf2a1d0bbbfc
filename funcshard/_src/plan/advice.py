"""What would fit when no plan does: the fewest changes among more ranks, remat, bf16, a smaller batch.

Changes are tried in combinations, fewest first; each graded change at its mildest
(the fewest ranks, the largest batch) that fits with the others. Fitting is checked
on the most sharded strategy (the least memory); every combination that fits with
the fewest changes is then planned with ``strategy="auto"`` and reported with its
memory and step time, least time per token on a rank first.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from funcshard._src.plan.activations import Workload, activations_of
from funcshard._src.plan.cost_model import CostModel, usable_budget
from funcshard._src.plan.precision import FULL_PRECISION, MixedPrecision
from funcshard._src.plan.resolve import Spec, build
from funcshard._src.plan.search import Context, Score, assign, ladder
from funcshard._src.plan.sizes import format_bytes
from funcshard._src.plan.strategy import Strategy
from funcshard._src.plan.unit_cost import UnitCost, memory_of, unit_cost
from funcshard._src.spec.mesh import Mesh

FACTORS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # growths of the last mesh axis tried
BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
LEVERS = ("bf16", "batch", "remat", "ranks")  # the order ties are broken in, cheapest first


class Change(NamedTuple):
    """One combination of changes: a mesh-axis growth, remat, mixed precision, batch size."""

    factor: int = 1
    remat: bool = False
    bf16: bool = False
    batch: int | None = None


def missing(
    spec: Spec,
    strategy: Strategy,
    raw_budget: int,
    need: int,
    costs: Sequence[UnitCost],
    model: CostModel,
) -> str:
    """Why nothing fits ``raw_budget``, by how much, and the smallest changes that would.

    ``need`` is what the most sharded plan (``strategy``, unit costs ``costs``) needs.
    """
    budget = usable_budget(raw_budget, model)
    activations = _activations(spec, model.workload, model.mixed_precision)
    largest = max(costs, key=lambda c: c.gathered + c.unreduced_grads)
    usable = "" if budget == raw_budget else f" ({format_bytes(budget)} usable)"
    head = (
        f"no plan fits memory_budget {format_bytes(raw_budget)}{usable} per rank: the most sharded "
        f"({strategy}) needs {format_bytes(need)}, {format_bytes(need - budget)} "
        f"({need - budget:,} bytes) too many per rank"
    )
    if largest.gathered + largest.unreduced_grads > budget:
        return (
            f"{head}. memory_budget is smaller than unit {largest.name!r} alone "
            f"({format_bytes(largest.gathered + largest.unreduced_grads)} gathered with its "
            f"gradients): split it into smaller units (units=[...]) or raise the budget"
        )
    if activations:
        head += f" (of which activations {format_bytes(activations)})"
    found = _Advisor(spec, strategy, raw_budget, model).smallest()
    if not found:
        return (
            f"{head}; neither more ranks (up to {FACTORS[-1]}x), remat, bf16 mixed precision "
            f"nor a smaller batch, alone or together, is enough"
        )
    return f"{head}. Would fit: " + "; or ".join(
        f"{_describe(spec.mesh, model, c)} (auto plan: {s.describe()})" for c, s in found
    )


def _activations(spec: Spec, workload: Workload | None, mp: MixedPrecision | None) -> int:
    return activations_of(workload, mp, [x.dtype for x in spec.leaves])


class _Advisor:
    def __init__(self, spec: Spec, strategy: Strategy, raw_budget: int, model: CostModel):
        self.spec, self.raw, self.model = spec, raw_budget, model
        self.strategy: Strategy = strategy
        self.state: dict[tuple[int, bool], int | None] = {}
        workload, mp = model.workload, model.mixed_precision or FULL_PRECISION
        self.levers: list[str] = []
        floats = [x.dtype for x in spec.leaves if x.dtype.is_floating_point]
        if any(mp.compute_dtype(d).itemsize > 2 for d in floats):
            self.levers.append("bf16")
        if workload is not None and workload.batch_size > 1:
            self.levers.append("batch")
        if workload is not None and not workload.remat:
            self.levers.append("remat")
        self.levers.append("ranks")

    def model_for(self, change: Change) -> CostModel:
        mp = self.model.mixed_precision
        if change.bf16:
            mp = dataclasses.replace(mp or FULL_PRECISION, param_dtype=torch.bfloat16)
            mp = mp if mp.reduce_dtype is not None else BF16
        workload = self.model.workload
        if workload is not None and (change.remat or change.batch is not None):
            workload = dataclasses.replace(
                workload,
                remat=workload.remat or change.remat,
                batch_size=change.batch or workload.batch_size,
            )
        return dataclasses.replace(self.model, mixed_precision=mp, workload=workload)

    def spec_for(self, factor: int) -> Spec:
        mesh = self.spec.mesh
        last = mesh.axis_names[-1]
        grown = Mesh({**mesh.axes, last: mesh.axis_size(last) * factor})
        return dataclasses.replace(self.spec, mesh=grown)

    def fits(self, change: Change) -> bool:
        """Whether the most sharded plan fits under ``change``."""
        key = (change.factor, change.bf16)
        model = self.model_for(change)
        if key not in self.state:
            try:
                plan = build(self.spec_for(change.factor), self.strategy)
            except ValueError:  # a rule the grown mesh cannot honor
                self.state[key] = None
            else:
                costs = [unit_cost(plan, u, model) for u in plan.units]
                self.state[key] = memory_of(costs, model).total
        state = self.state[key]
        if state is None:
            return False
        activations = _activations(self.spec, model.workload, model.mixed_precision)
        return state + activations <= usable_budget(self.raw, model)

    def mildest(self, levers: Sequence[str]) -> Change | None:
        """The mildest change using every lever in ``levers`` that fits, if any."""
        on = Change(remat="remat" in levers, bf16="bf16" in levers)
        factors = FACTORS if "ranks" in levers else (1,)
        workload = self.model.workload
        batches: Sequence[int | None] = [None]
        if "batch" in levers and workload is not None:
            batches = range(workload.batch_size - 1, 0, -1)
        for factor, batch in itertools.product(factors, batches):
            change = on._replace(factor=factor, batch=batch)
            if self.fits(change):
                return change
        return None

    def smallest(self) -> list[tuple[Change, Score]]:
        """Every fitting combination with the fewest changes, least time per token first."""
        for size in range(1, len(self.levers) + 1):
            found = [
                c
                for levers in itertools.combinations(self.levers, size)
                if (c := self.mildest(levers)) is not None
            ]
            if found:
                planned = [(c, self.plan(c)) for c in found]
                return sorted(planned, key=self._cost_of)
        return []

    def _cost_of(self, item: tuple[Change, Score]) -> tuple[float, int]:
        """Seconds per token on a rank (when estimated), then the cheapest lever used."""
        change, s = item
        workload = self.model_for(change).workload
        per_token = math.inf if s.time is None or workload is None else s.time / workload.tokens
        used = (change.bf16, change.batch is not None, change.remat, change.factor > 1)
        return (per_token, min(k for k, on in enumerate(used) if on))

    def plan(self, change: Change) -> Score:
        """The score of the auto plan under ``change``."""
        spec, model = self.spec_for(change.factor), self.model_for(change)
        per_option: list[list[UnitCost]] = []
        options: list[Strategy] = []
        for option in ladder(spec.mesh):
            try:
                plan = build(spec, option)
            except ValueError:
                continue
            options.append(option)
            per_option.append([unit_cost(plan, u, model) for u in plan.units])
        activations = _activations(self.spec, model.workload, model.mixed_precision)
        ctx = Context(model, usable_budget(self.raw, model), activations, spec.mesh)
        return assign(options, per_option, ctx)[1]


def _describe(mesh: Mesh, model: CostModel, change: Change) -> str:
    parts: list[str] = []
    if change.factor > 1:
        last = mesh.axis_names[-1]
        size = mesh.axis_size(last) * change.factor
        parts.append(f"{mesh.size * change.factor} ranks ({last}={size})")
    if change.remat:
        parts.append("remat=True (recompute activations in backward)")
    if change.bf16:
        parts.append("bf16 mixed precision (MixedPrecision(param_dtype=torch.bfloat16))")
    if change.batch is not None:
        parts.append(f"batch_size={change.batch} per rank")
    return " + ".join(parts)


__all__ = ["Change", "missing"]
