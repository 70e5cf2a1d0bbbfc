"""From checked inputs to plans: each leaf's spec (the first matching rule, else the default) and unit.

:func:`build` is what every plan comes from: :func:`funcshard.plan` with one
strategy, and the automatic planner with one strategy per unit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from funcshard._src import tree
from funcshard._src.plan.cost_model import CostModel
from funcshard._src.plan.plan import Default, LeafPlan, Plan, Requested
from funcshard._src.plan.rules import Rule, first_match, matches, matches_within
from funcshard._src.plan.strategy import Strategy, default_spec, shard_axes
from funcshard._src.plan.units import ROOT, Layout, RequestedLayout, Unit, resolve_units
from funcshard._src.spec.mesh import Mesh
from funcshard._src.spec.named_sharding import NamedSharding
from funcshard._src.spec.partition_spec import P


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
    frozen: Sequence[Any] = ()  # patterns of leaves (or subtrees) with no gradient
    layout: RequestedLayout = "leaf"  # every unit's, or "auto": choose_layout per unit


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
    frozen = frozen_paths(spec.paths, spec.frozen)
    planned: list[LeafPlan] = []
    ruled: set[str] = set()  # leaves a rule places, which layout="auto" keeps in the leaf layout
    for path, leaf in zip(spec.paths, spec.leaves):
        shape = tuple(leaf.shape)
        unit = unit_of[path]
        rule = first_match(spec.rules, path)
        if rule is not None:
            ruled.add(path)
        leaf_spec = _resolve_spec(
            path, shape, spec.rules, rule, used, strategy_of(unit), mesh, spec.default
        )
        NamedSharding(mesh, leaf_spec).validate(shape, path=path or "<root>", strict=spec.strict)
        planned.append(LeafPlan(path, shape, leaf.dtype, leaf_spec, unit, path in frozen))

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
    layout = spec.layout
    if layout == "auto":
        layout_of: dict[str, Layout] = {
            name: choose_layout(unit_paths[name], ruled) for name in ordered
        }
        notes = (*notes, _layout_note(layout_of))
    else:
        layout_of = dict.fromkeys(ordered, layout)
    if requested is None:
        assert not isinstance(strategy, Mapping), "a plan with a strategy per unit says so"
        requested = strategy
    return Plan(
        mesh=mesh,
        treedef=spec.treedef,
        leaves=tuple(planned),
        units=tuple(
            Unit(name, tuple(unit_paths[name]), strategy_of(name), layout_of[name])
            for name in ordered
        ),
        strategy=requested,
        notes=notes,
        reasons=reasons,
        cost=cost,
        memory_budget=memory_budget,
    )


def choose_layout(paths: Sequence[str], ruled: set[str], /) -> Layout:
    """``layout="auto"``'s choice for a unit of leaves ``paths``: ``"flat"`` unless it would change a placement.

    A flat unit is one all-gather straight into one storage whose views are the
    leaves: no staging buffer, no unpacking copy and no per-leaf padding, on every
    backend and group size, and one plain copy per leaf to pack gradients. In the
    leaf layout only some parts gather in place (``shard/flat.py``,
    ``gathers_in_place``), the others through a staging buffer and a copy out. So a
    unit of several leaves is ``"flat"``, unless a rule places one of its leaves
    (``ruled``): the flat layout ignores a spec, and a rule asks for one. A unit of
    one leaf keeps ``"leaf"``: split on dim 0 it already gathers in place, and its
    spec stays a placement JAX can use.

    Example:
        >>> choose_layout(["blocks/0/w", "blocks/0/b"], set()), choose_layout(["embed"], set())
        ('flat', 'leaf')
        >>> choose_layout(["blocks/0/w", "blocks/0/b"], {"blocks/0/w"})
        'leaf'
    """
    if len(paths) < 2 or any(p in ruled for p in paths):
        return "leaf"
    return "flat"


def _layout_note(layout_of: Mapping[str, Layout], /) -> str:
    """What ``layout="auto"`` picked, for :meth:`Plan.explain`."""
    flat = [n for n, layout in layout_of.items() if layout == "flat"]
    leaf = [n for n, layout in layout_of.items() if layout == "leaf"]

    def names(units: list[str]) -> str:
        return ", ".join(units[:3]) + (f" and {len(units) - 3} more" if len(units) > 3 else "")

    picked = (
        [
            f"flat for {len(flat)} unit(s) ({names(flat)}): one all-gather into the unit's "
            f"storage, no staging, no unpacking copy, no per-leaf padding"
        ]
        if flat
        else []
    )
    if leaf:
        picked.append(f"leaf for {len(leaf)} ({names(leaf)}): one leaf, or a leaf a rule places")
    return "layout='auto': " + "; ".join(picked)


def frozen_paths(paths: Sequence[str], patterns: Sequence[Any], /) -> set[str]:
    """The leaf ``paths`` that a pattern of ``frozen`` matches (the leaf or a subtree above it).

    Raises:
        ValueError: a pattern that matches no leaf or subtree; the message shows paths.

    Example:
        >>> sorted(frozen_paths(["embed/w", "head/w", "head/b"], ["head"]))
        ['head/b', 'head/w']
    """
    out: set[str] = set()
    for i, pattern in enumerate(patterns):
        hits = {p for p in paths if matches_within(pattern, p)}
        if not hits:
            examples = ", ".join(repr(p) for p in paths[:6])
            raise ValueError(
                f"frozen[{i}] {pattern!r} matches no leaf or subtree of the params (leaf paths "
                f"look like {examples}); fix the pattern, or drop it"
            )
        out |= hits
    return out


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


def _resolve_spec(
    path: str,
    shape: tuple[int, ...],
    rules: Sequence[Rule],
    i: int | None,
    used: list[bool],
    strategy: Strategy,
    mesh: Mesh,
    default: Default,
) -> P:
    """``path``'s spec: ``rules[i]``'s (the first rule matching it), else the default."""
    where = path or "<root>"
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
        return default_spec(shape, strategy, mesh, default)
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
