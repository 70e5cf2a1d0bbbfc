"""Automatic plans: unit boundaries from the tree's shape, strategies from a memory budget.

Units (``units="auto"``): every stack of like layers (a list or tuple whose
elements have the same leaf paths, shapes and dtypes) gives one unit per element,
outermost stacks only; a remaining top-level subtree at least as large as the
median layer (a large embedding or head) is a unit too; everything else stays
in the root unit. A tree without stacks is split at its top level, descending
into subtrees larger than a quarter of the model; subtrees under 1/64 of it stay
in the root unit.

Strategies (``strategy="auto"``): every uniform strategy is scored, and a local
search from each of them moves units one at a time, first until the plan fits, then
while it gets faster (:mod:`funcshard._src.plan.search`); the best result, by step
time (bytes sent without a workload and hardware) then memory, is never worse than
a fixed strategy that fits. When nothing fits, :class:`BudgetError` names the
fewest changes that would (:mod:`funcshard._src.plan.advice`).
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from funcshard._src.plan.activations import activations_of
from funcshard._src.plan.advice import missing
from funcshard._src.plan.cost_model import CostModel, usable_budget
from funcshard._src.plan.plan import Plan, Requested
from funcshard._src.plan.resolve import Spec, build
from funcshard._src.plan.search import Context, assign, reasons
from funcshard._src.plan.search import ladder as ladder
from funcshard._src.plan.sizes import format_bytes
from funcshard._src.plan.strategy import Strategy
from funcshard._src.plan.unit_cost import UnitCost, memory_of, unit_cost


class BudgetError(ValueError):
    """No plan fits the memory budget; the message says by how much and what would fit."""


# -- units ------------------------------------------------------------------------------------


def choose_units(paths: Sequence[str], leaves: Sequence[Any], /) -> tuple[list[Any], str]:
    """Unit patterns for ``units="auto"`` (exact subtree paths) and the rule that chose them.

    Example:
        >>> import torch
        >>> z = torch.zeros
        >>> params = {"embed": z(100, 8), "layers": [{"w": z(8, 8)}, {"w": z(8, 8)}], "norm": z(8)}
        >>> from funcshard._src import tree
        >>> paths, leaves, _ = tree.flatten_with_paths(params)
        >>> choose_units(paths, leaves)[0]
        ['embed', 'layers/0', 'layers/1']
    """
    size = {p: _nbytes(leaf) for p, leaf in zip(paths, leaves)}
    children = _children(paths)
    total = sum(size.values())

    def bytes_of(node: str) -> int:
        return sum(n for p, n in size.items() if p == node or p.startswith(node + "/"))

    stacks = _stacks(children, size)
    units = [el for stack in stacks for el in children[stack]]
    if units:
        median = statistics.median(bytes_of(u) for u in units)
        extra = [
            top
            for top in children[""]
            if not any(top == s or s.startswith(top + "/") for s in stacks)
            and bytes_of(top) >= median
        ]
        chosen = sorted(units + extra, key=_order(paths))
        rule = (
            f"one unit per element of the layer stack{'s' if len(stacks) > 1 else ''} "
            f"{', '.join(repr(s) for s in stacks)}, plus top-level subtrees at least as large as "
            f"the median layer ({format_bytes(median)}); the rest is the root unit"
        )
        return [_exact(u) for u in chosen], rule
    frontier = list(children[""])
    while True:
        big = [n for n in frontier if bytes_of(n) > total / 4 and children.get(n)]
        if not big:
            break
        i = frontier.index(big[0])
        frontier[i : i + 1] = children[big[0]]
    chosen = [n for n in frontier if bytes_of(n) >= total / 64]
    if len(chosen) <= 1:
        return [], "no layer stack and no subtree worth a unit of its own: one root unit"
    rule = (
        "no layer stack: top-level subtrees, split while larger than 1/4 of the model; "
        "those under 1/64 stay in the root unit"
    )
    return [_exact(u) for u in chosen], rule


def _nbytes(leaf: Any) -> int:
    return math.prod(leaf.shape) * leaf.dtype.itemsize


def _children(paths: Sequence[str]) -> dict[str, list[str]]:
    """Every internal node's children, in tree order (the root is ``""``)."""
    out: dict[str, list[str]] = {"": []}
    for path in paths:
        parts = path.split("/") if path else []
        for k in range(len(parts)):
            parent, child = "/".join(parts[:k]), "/".join(parts[: k + 1])
            siblings = out.setdefault(parent, [])
            if child not in siblings:
                siblings.append(child)
    return out


def _stacks(children: Mapping[str, list[str]], size: Mapping[str, int]) -> list[str]:
    """Outermost nodes whose >= 2 children are named 0, 1, ... and have the same leaves."""
    shapes: dict[str, tuple[tuple[str, int], ...]] = {}

    def signature(node: str) -> tuple[tuple[str, int], ...]:
        if node not in shapes:
            shapes[node] = tuple(
                (p[len(node) :], n) for p, n in size.items() if p.startswith(node + "/")
            )
        return shapes[node]

    found: list[str] = []
    for node, kids in children.items():
        if len(kids) < 2 or any(node and (node + "/").startswith(f + "/") for f in found):
            continue
        names = [k.rsplit("/", 1)[-1] for k in kids]
        if names != [str(i) for i in range(len(kids))]:
            continue
        first = signature(kids[0])
        if first and all(signature(k) == first for k in kids[1:]):
            found = [f for f in found if not f.startswith(node + "/")] + [node]
    return sorted(found, key=_order(list(size)))


def _order(paths: Sequence[str]) -> Callable[[str], int]:
    def first(node: str) -> int:
        return next(i for i, p in enumerate(paths) if p == node or p.startswith(node + "/"))

    return first


def _exact(node: str) -> Any:
    return re.compile("^" + re.escape(node) + "$") if re.search(r"[*?\[\]]", node) else node


# -- strategies ------------------------------------------------------------------------------


def plan_within(spec: Spec, strategy: Requested, budget: int, cost: CostModel | None, /) -> Plan:
    """The plan of ``spec`` that fits ``budget`` bytes per rank; ``strategy`` fixed or ``"auto"``.

    ``"auto"`` gives each unit a strategy: the best assignment found from every uniform
    one, by step time (bytes sent without a workload and hardware), then memory
    (see [Note: auto dominates] in ``plan/search.py`` in :mod:`funcshard._src.plan.search`).

    Raises:
        BudgetError: nothing fits; the message gives the bytes missing per rank and
            the fewest changes that would fit (more ranks, remat, bf16, a smaller batch).
    """
    raw_budget, model = budget, cost or CostModel()
    budget = usable_budget(budget, model)  # every comparison below is against this
    activations = activations_of(
        model.workload, model.mixed_precision, [x.dtype for x in spec.leaves]
    )
    if strategy != "auto":
        fixed = build(spec, strategy, cost=model, memory_budget=raw_budget)
        costs = [unit_cost(fixed, u, model) for u in fixed.units]
        need = memory_of(costs, model).total + activations
        if need > budget:
            raise BudgetError(missing(spec, strategy, raw_budget, need, costs, model))
        return fixed
    options: list[Strategy] = []
    per_option: list[list[UnitCost]] = []
    refused: list[str] = []
    for option in ladder(spec.mesh):
        try:
            made = build(spec, option)
        except ValueError as e:  # a rule that this strategy cannot honor
            refused.append(f"{option} not considered: {e}")
            continue
        options.append(option)
        per_option.append([unit_cost(made, u, model) for u in made.units])
    if not options:
        raise ValueError("strategy='auto': no strategy accepts the rules; " + "; ".join(refused))
    ctx = Context(model, budget, activations, spec.mesh)
    choice, found, uniform = assign(options, per_option, ctx)
    if not found.fits:
        least = min(range(len(options)), key=lambda k: uniform[k][1].memory)
        raise BudgetError(
            missing(
                spec, options[least], raw_budget, uniform[least][1].memory, per_option[least], model
            )
        )
    names = [c.name for c in per_option[0]]
    why = reasons(options, per_option, ctx, choice)
    fixed_fits = [f"{s} {u.describe()}" for s, u in uniform if u.fits]
    note = (
        f"strategy='auto': searched from every uniform strategy, ranked by "
        f"{'bytes sent' if found.time is None else 'step time'} then memory; chosen "
        f"{found.describe()}; uniform that fit: {', '.join(fixed_fits) or 'none'}"
    )
    plan = build(
        spec,
        {name: options[k] for name, k in zip(names, choice)},
        requested="auto",
        reasons=tuple(zip(names, why)),
        cost=model,
        memory_budget=raw_budget,
    )
    return dataclasses.replace(plan, notes=(*plan.notes, note, *refused))


__all__ = ["BudgetError", "choose_units", "ladder", "plan_within"]
