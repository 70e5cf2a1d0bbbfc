"""Automatic plans: unit boundaries from the tree's shape, strategies from a memory budget.

Units (``units="auto"``): every stack of like layers (a list or tuple whose
elements have the same leaf paths, shapes and dtypes) gives one unit per element,
outermost stacks only; a remaining top-level subtree at least as large as the
median layer (a large embedding or head) is a unit too; everything else stays
in the root unit. A tree without stacks is split at its top level, descending
into subtrees larger than a quarter of the model; subtrees under 1/64 of it stay
in the root unit.

Strategies (``strategy="auto"``): every unit starts at the strategy with the
least communication, ``no_shard``, and units move, largest first, one level at
a time along a ladder ``no_shard`` -> (``shard_grad_op``, ``hybrid_shard`` on
meshes with a replica axis, in order of their communication: time on the given
hardware, else bytes) -> ``full_shard``, until the plan fits. The sequence of
moves does not depend on the budget, so a stricter budget only ever continues
it (never less sharding), and ``full_shard`` everywhere, the least memory, is
its end.
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from funcshard._src.plan.activations import Workload, activations_of
from funcshard._src.plan.cost import UnitCost, estimate, memory_of, unit_cost
from funcshard._src.plan.cost_model import CostModel, usable_budget
from funcshard._src.plan.estimates import Key
from funcshard._src.plan.hardware import Hardware, axes_bandwidth
from funcshard._src.plan.plan import Plan, Requested
from funcshard._src.plan.resolve import Spec, build
from funcshard._src.plan.sizes import format_bytes
from funcshard._src.plan.strategy import Strategy
from funcshard._src.spec.mesh import Mesh


class BudgetError(ValueError):
    """No plan fits the memory budget; the message says by how much and what would fit."""


def ladder(mesh: Mesh, /) -> tuple[Strategy, ...]:
    """The strategies ``strategy="auto"`` tries, least communication (and most memory) first.

    Example:
        >>> ladder(Mesh({"fsdp": 8})), ladder(Mesh({"dp": 2, "fsdp": 8}))[2]
        (('no_shard', 'shard_grad_op', 'full_shard'), 'hybrid_shard')
    """
    if len(mesh.axis_names) > 1:
        return ("no_shard", "shard_grad_op", "hybrid_shard", "full_shard")
    return ("no_shard", "shard_grad_op", "full_shard")


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

    Raises:
        BudgetError: nothing fits; the message gives the bytes missing per rank and
            what would fit (more ranks, remat, a smaller batch).
    """
    model = cost or CostModel()
    budget = usable_budget(budget, model)  # every comparison below is against this
    activations = _activations(model.workload, model, spec)
    if strategy != "auto":
        fixed = build(spec, strategy, cost=model, memory_budget=budget)
        costs = [unit_cost(fixed, u, model) for u in fixed.units]
        need = memory_of(costs, model).total + activations
        if need > budget:
            raise BudgetError(_missing(spec, [strategy], budget, need, costs, model, activations))
        return fixed
    options: list[Strategy] = []
    per_option: dict[Strategy, list[UnitCost]] = {}
    plans: dict[Strategy, Plan] = {}
    refused: list[str] = []
    for option in ladder(spec.mesh):
        try:
            plans[option] = build(spec, option)
        except ValueError as e:  # a rule that this strategy cannot honor
            refused.append(f"{option} not considered: {e}")
            continue
        options.append(option)
        per_option[option] = [unit_cost(plans[option], u, model) for u in plans[option].units]
    if not options:
        raise ValueError("strategy='auto': no strategy accepts the rules; " + "; ".join(refused))
    comm: dict[Strategy, Counter[Key]] = {}
    for option in options:
        comm[option] = Counter()
        for c in per_option[option]:
            comm[option].update(c.comm)
    options = _by_communication(options, comm, spec.mesh, model.hardware)
    names = [c.name for c in per_option[options[0]]]
    order = sorted(range(len(names)), key=lambda i: -per_option[options[0]][i].n_params)
    choice = [0] * len(names)

    def total() -> int:
        picked = [per_option[options[k]][i] for i, k in enumerate(choice)]
        return memory_of(picked, model).total + activations

    now = total()
    level = 0
    while now > budget and level + 1 < len(options):
        level += 1
        for i in order:  # the largest units first: the most memory per move
            choice[i] = level
            now = total()
            if now <= budget:
                break
    if now > budget:
        costs = [per_option[options[-1]][i] for i in range(len(names))]
        raise BudgetError(_missing(spec, options, budget, now, costs, model, activations))
    reasons = tuple((name, _reason(options, k, budget)) for name, k in zip(names, choice))
    plan = build(
        spec,
        {name: options[k] for name, k in zip(names, choice)},
        requested="auto",
        reasons=reasons,
        cost=model,
        memory_budget=budget,
    )
    return dataclasses.replace(plan, notes=plan.notes + tuple(refused))


def _by_communication(
    options: list[Strategy],
    comm: Mapping[Strategy, Mapping[Key, int]],
    mesh: Mesh,
    hardware: Hardware | None,
) -> list[Strategy]:
    """``no_shard`` first and ``full_shard`` last; between them, least communication first.

    ``comm`` is each option's bytes sent per step by ``(op, axes)``; they are ranked by
    time on ``hardware`` when given (links within a node are faster), else by bytes.
    """

    def cost(option: Strategy) -> float:
        sent = comm[option].items()
        if hardware is None:
            return float(sum(n for _, n in sent))
        return sum(n / axes_bandwidth(mesh.axes, axes, hardware) for (_, axes), n in sent)

    middle: list[Strategy] = sorted(
        (o for o in options if o not in ("no_shard", "full_shard")), key=cost
    )
    return [
        *(o for o in options if o == "no_shard"),
        *middle,
        *(o for o in options if o == "full_shard"),
    ]


def _reason(options: Sequence[Strategy], k: int, budget: int) -> str:
    if k == 0:
        return "least communication, and the plan fits"
    return f"with {options[k - 1]} the plan exceeds {format_bytes(budget)}"


def _activations(workload: Workload | None, model: CostModel, spec: Spec) -> int:
    return activations_of(workload, model.mixed_precision, [x.dtype for x in spec.leaves])


def _missing(
    spec: Spec,
    options: Sequence[Strategy],
    budget: int,
    need: int,
    costs: Sequence[UnitCost],
    model: CostModel,
    activations: int,
) -> str:
    """Why nothing fits, by how much, and what would."""
    strategy = options[-1]
    largest = max(costs, key=lambda c: c.gathered + c.unreduced_grads)
    head = (
        f"no plan fits memory_budget {format_bytes(budget)} per rank: the most sharded "
        f"({strategy}) needs {format_bytes(need)}, {format_bytes(need - budget)} "
        f"({need - budget:,} bytes) too many per rank"
    )
    if largest.gathered + largest.unreduced_grads > budget:
        return (
            f"{head}. memory_budget is smaller than unit {largest.name!r} alone "
            f"({format_bytes(largest.gathered + largest.unreduced_grads)} gathered with its "
            f"gradients): split it into smaller units (units=[...]) or raise the budget"
        )
    fixes: list[str] = []
    mesh = spec.mesh
    last = mesh.axis_names[-1]
    for factor in (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
        bigger = Mesh({**mesh.axes, last: mesh.axis_size(last) * factor})
        grown = dataclasses.replace(spec, mesh=bigger)
        try:
            trial = build(grown, strategy)
        except ValueError:
            continue
        if estimate(trial, model).memory.total <= budget:
            fixes.append(f"{bigger.size} ranks ({last}={bigger.axis_size(last)})")
            break
    workload = model.workload
    if workload is not None:
        state = need - activations
        if not workload.remat:
            remat = dataclasses.replace(workload, remat=True)
            if state + _activations(remat, model, spec) <= budget:
                fixes.append("remat=True (recompute activations in backward)")
        for batch in range(workload.batch_size - 1, 0, -1):
            smaller = dataclasses.replace(workload, batch_size=batch)
            if state + _activations(smaller, model, spec) <= budget:
                fixes.append(f"batch_size={batch} per rank")
                break
    if activations:
        head += f" (of which activations {format_bytes(activations)})"
    if not fixes:
        return f"{head}; neither more ranks nor less activation memory is enough"
    return f"{head}. Would fit: " + "; or ".join(fixes)


__all__ = ["BudgetError", "choose_units", "ladder", "plan_within"]
