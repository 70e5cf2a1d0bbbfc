"""``fs.plan``: from params, a mesh, rules and units to a :class:`Plan`.

Resolves every leaf's spec (the first matching rule, else the strategy's
default) and unit, validates each against its leaf, and, for
``strategy="auto"`` or a ``memory_budget``, hands over to the automatic
planner (:mod:`funcshard._src.plan.auto`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from funcshard._src import tree
from funcshard._src.plan.hardware import parse_bytes
from funcshard._src.plan.plan import Default, LeafPlan, Plan, Requested
from funcshard._src.plan.rules import Rule, check_pattern, check_rules, first_match, matches
from funcshard._src.plan.strategy import Strategy, check_strategy, default_spec, shard_axes
from funcshard._src.plan.units import ROOT, Unit, resolve_units
from funcshard._src.spec.mesh import Mesh
from funcshard._src.spec.named_sharding import NamedSharding
from funcshard._src.spec.partition_spec import P

if TYPE_CHECKING:
    from funcshard._src.plan.cost import CostModel


def plan(
    params: Any,
    mesh: Mesh,
    /,
    *,
    rules: Sequence[tuple[Any, P]] = (),
    units: Sequence[Any] | Literal["auto"] = (),
    strategy: Requested = "full_shard",
    default: Default = "largest_dim",
    strict: bool = False,
    memory_budget: int | str | None = None,
    cost: CostModel | None = None,
) -> Plan:
    """Plans where every leaf of ``params`` lives on ``mesh``.

    Args:
        params: a pytree of tensors (real or on the ``meta`` device: only shapes and
            dtypes are read).
        mesh: the mesh to shard over.
        rules: ``[(pattern, P), ...]`` over leaf paths; the first match wins. A
            pattern is a glob (``*`` one segment, ``**`` any number) or a ``re.Pattern``
            matched with ``re.search``.
        units: patterns naming subtrees; each matched subtree is one unit. Leaves
            under no unit form the root unit. ``"auto"`` chooses them: the elements
            of every stack of like layers, plus subtrees as large as a layer (see
            ``docs/planner.md``).
        strategy: ``"full_shard"``, ``"shard_grad_op"``, ``"no_shard"``,
            ``"hybrid_shard"``, or ``"auto"``: per unit, the one with the least
            communication that fits ``memory_budget``.
        default: the spec of a leaf no rule matches: ``"largest_dim"`` (its largest
            dim over the strategy's shard axes; scalars replicate), a fixed ``P``,
            or ``None`` to require a rule for every leaf.
        strict: refuse dims that do not divide by their shard count, as JAX does.
        memory_budget: bytes per rank (an int or a size like ``"80GiB"``) that the
            plan must fit under ``cost``; required by ``strategy="auto"``.
        cost: how the plan will be trained (optimizer, mixed precision, workload),
            for the budget and :meth:`Plan.explain`; default AdamW in the stored dtypes.

    Returns:
        The :class:`Plan`.

    Raises:
        TypeError: a leaf that is not a tensor, or malformed rules or units.
        ValueError: a spec that does not fit its leaf or the strategy, an unmatched
            leaf with ``default=None``, a rule that places no leaf (a typo, or a rule
            shadowed by an earlier one), a unit pattern matching nothing, overlapping
            units, or a plan that does not fit ``memory_budget`` (the message says by
            how much and what would fit). Each message names the leaf path or
            pattern and the fix.

    Example:
        >>> params = {"embed": torch.zeros(16, 8), "blocks": [{"w": torch.zeros(8, 8)}] * 2}
        >>> p = plan(params, Mesh({"fsdp": 2}), rules=[("embed", P(None, "fsdp"))], units=["blocks/*"])
        >>> p.specs
        {'embed': P(None, 'fsdp'), 'blocks': [{'w': P('fsdp')}, {'w': P('fsdp')}]}
        >>> [u.name for u in p.units]
        ['<root>', 'blocks/0', 'blocks/1']
        >>> auto = plan(params, Mesh({"fsdp": 2}), units="auto", strategy="auto", memory_budget="3.6KiB")
        >>> [(u.name, u.strategy) for u in auto.units]
        [('blocks/0', 'shard_grad_op'), ('blocks/1', 'shard_grad_op'), ('embed', 'shard_grad_op')]
    """
    if not isinstance(mesh, Mesh):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise TypeError(f"plan: mesh must be a funcshard Mesh, got {type(mesh).__name__}")
    if strategy != "auto":
        strategy = check_strategy(strategy)
    checked_rules = check_rules(rules)
    auto_units = isinstance(units, str) and units == "auto"
    if not auto_units and (isinstance(units, (str, bytes)) or not isinstance(units, Sequence)):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise TypeError(
            f"units must be a list of patterns, e.g. [{units!r}], or 'auto'; got {units!r}"
        )
    if not (default is None or default == "largest_dim" or isinstance(default, P)):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise TypeError(f"default must be 'largest_dim', a P or None; got {default!r}")
    budget = _check_budget(memory_budget, strategy)

    paths, leaves, treedef = tree.flatten_with_paths(params)
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{path or '<root>'}: leaf is a {type(leaf).__name__}, not a torch.Tensor; "
                f"params must be a pytree of tensors (wrap constants with torch.tensor, or "
                f"keep them outside params)"
            )
    notes: list[str] = []
    if auto_units:
        from funcshard._src.plan import auto  # the planner builds on this module

        patterns, rule = auto.choose_units(paths, leaves)
        notes.append(f"units='auto': {rule}")
    else:
        patterns = [check_pattern(u, what=f"units[{i}]") for i, u in enumerate(units)]
    spec = Spec(
        paths, leaves, treedef, mesh, checked_rules, patterns, default, strict, tuple(notes)
    )
    if strategy == "auto" or budget is not None:
        from funcshard._src.plan import auto

        assert budget is not None
        return auto.plan_within(spec, strategy, budget, cost)
    return build(spec, strategy, cost=cost)


@dataclass(frozen=True)
class Spec:
    """Everything :func:`plan` was asked, checked; :func:`build` makes plans of it."""

    paths: list[str]
    leaves: list[Any]
    treedef: tree.TreeDef
    mesh: Mesh
    rules: Sequence[Rule]
    patterns: Sequence[Any]
    default: Default
    strict: bool
    notes: tuple[str, ...]


def build(
    spec: Spec,
    strategy: Strategy | Mapping[str, Strategy],
    /,
    *,
    requested: Requested | None = None,
    reasons: tuple[tuple[str, str], ...] = (),
    cost: CostModel | None = None,
    memory_budget: int | None = None,
) -> Plan:
    """The plan of ``spec`` with one strategy, or one per unit name (``strategy[unit]``)."""
    mesh = spec.mesh
    unit_of = {p: name for name, ps in resolve_units(spec.paths, spec.patterns) for p in ps}

    def strategy_of(unit: str) -> Strategy:
        return strategy[unit] if isinstance(strategy, Mapping) else strategy

    used = [False] * len(spec.rules)
    planned: list[LeafPlan] = []
    for path, leaf in zip(spec.paths, spec.leaves):
        shape = tuple(leaf.shape)
        unit = unit_of[path]
        leaf_spec = _resolve_spec(
            path, shape, spec.rules, used, strategy_of(unit), mesh, spec.default
        )
        NamedSharding(mesh, leaf_spec).validate(shape, path=path or "<root>", strict=spec.strict)
        planned.append(LeafPlan(path, shape, leaf.dtype, leaf_spec, unit))

    unit_paths: dict[str, list[str]] = {}
    for leaf in planned:
        unit_paths.setdefault(leaf.unit, []).append(leaf.path)
    ordered = sorted(
        unit_paths, key=lambda name: name != ROOT
    )  # stable: root first, then tree order
    unused = [i for i, hit in enumerate(used) if not hit]
    if unused:
        raise ValueError(_unused_rule(unused[0], spec))
    notes = spec.notes
    if requested is None:
        assert not isinstance(strategy, Mapping), "a plan with a strategy per unit says so"
        requested = strategy
    return Plan(
        mesh=mesh,
        treedef=spec.treedef,
        leaves=tuple(planned),
        units=tuple(Unit(name, tuple(unit_paths[name]), strategy_of(name)) for name in ordered),
        strategy=requested,
        notes=notes,
        reasons=reasons,
        cost=cost,
        memory_budget=memory_budget,
    )


def _unused_rule(i: int, spec: Spec) -> str:
    """Why ``rules[i]`` placed no leaf (a typo, or rules in the wrong order), and the fix."""
    rule = spec.rules[i]
    shadowing = [
        j
        for j, earlier in enumerate(spec.rules[:i])
        if any(matches(rule.pattern, p) and matches(earlier.pattern, p) for p in spec.paths)
    ]
    if shadowing:
        return (
            f"rules[{i}] {rule!r} places no leaf: every leaf it matches is placed by an earlier "
            f"rule ({', '.join(f'rules[{j}]' for j in shadowing)}), since the first match wins. "
            f"Move it before them, or drop it"
        )
    examples = ", ".join(repr(p) for p in spec.paths[:6])
    return (
        f"rules[{i}] {rule!r} matches no leaf of the params (leaf paths look like {examples}); "
        f"fix the pattern, or drop the rule if these params have no such leaf"
    )


def _check_budget(budget: int | str | None, strategy: Requested) -> int | None:
    if budget is None:
        if strategy == "auto":
            raise ValueError(
                "strategy='auto' needs memory_budget: the bytes per rank to fit, e.g. "
                "memory_budget='80GiB' (with cost=fs.CostModel(...) describing the training)"
            )
        return None
    if isinstance(budget, bool) or not isinstance(budget, (int, str)):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise TypeError(
            f"memory_budget must be bytes (an int) or a size like '80GiB', got {budget!r}"
        )
    return parse_bytes(budget)


def _resolve_spec(
    path: str,
    shape: tuple[int, ...],
    rules: Sequence[Rule],
    used: list[bool],
    strategy: Strategy,
    mesh: Mesh,
    default: Default,
) -> P:
    where = path or "<root>"
    i = first_match(rules, path)
    if i is not None:
        used[i] = True
        spec, origin = rules[i].spec, f"rules[{i}] {rules[i]!r}"
    elif default is None:
        raise ValueError(
            f"{where}: no rule matches this leaf and default=None; add a rule for it, "
            f"e.g. ({where!r}, P(...)), or a catch-all ('**', P('{mesh.axis_names[-1]}'))"
        )
    elif isinstance(default, P):
        spec, origin = default, f"default {default!r}"
    else:
        return default_spec(shape, strategy, mesh)
    allowed = shard_axes(strategy, mesh)
    outside = [a for a in spec.axes if a in mesh.axis_names and a not in allowed]
    if outside:
        raise ValueError(
            f"{where}: {origin} shards over mesh axis {outside[0]!r}, but strategy {strategy!r} "
            f"shards only over {list(allowed)} (the other axes replicate); drop {outside[0]!r} "
            f"from the spec or choose another strategy"
        )
    if len(spec) > len(shape):
        # name the rule as well as the leaf: the usual cause is a rule meant for bigger leaves
        spec.validate(mesh, len(shape), path=f"{where} (from {origin})")
    return spec
