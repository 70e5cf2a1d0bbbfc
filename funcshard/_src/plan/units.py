"""Units: the sets of leaves gathered together (one all-gather, one reduce-scatter each).

A unit pattern names subtrees: every subtree whose path it matches is one unit
(for a pattern that matches nested subtrees, the outermost). Leaves under no
unit form the *root unit*, gathered at the start of forward and kept until its
backward, as FSDP treats the root module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from funcshard._src.plan.rules import Pattern, matches, pattern_repr
from funcshard._src.plan.strategy import Strategy

ROOT = "<root>"

# How a unit stores its leaves: "leaf", each leaf's chunk of its PartitionSpec; "flat", the
# unit's leaves concatenated and cut into equal ranges (spec/flat_sharding.py)
Layout = Literal["leaf", "flat"]
LAYOUTS: tuple[Layout, ...] = ("leaf", "flat")
# what fs.plan(layout=...) accepts: a layout for every unit, or "auto", one per unit
# (plan/resolve.py, choose_layout)
RequestedLayout = Literal["leaf", "flat", "auto"]
REQUESTED_LAYOUTS: tuple[RequestedLayout, ...] = ("leaf", "flat", "auto")


@dataclass(frozen=True)
class Unit:
    """One unit: its ``name`` (the subtree path, or ``"<root>"``), leaf paths, strategy and layout."""

    name: str
    paths: tuple[str, ...]
    strategy: Strategy
    layout: Layout = "leaf"

    @property
    def is_root(self) -> bool:
        """Whether this is the root unit (the leaves under no unit)."""
        return self.name == ROOT


def resolve_units(
    paths: Sequence[str], patterns: Sequence[Pattern], /
) -> list[tuple[str, tuple[str, ...]]]:
    """Groups leaf ``paths`` into ``(unit name, leaf paths)``, in tree order, root unit first.

    Raises:
        ValueError: a pattern that matches no subtree, or two units that overlap
            (one contains the other); the message names both and the patterns.

    Example:
        >>> resolve_units(["embed", "blocks/0/w", "blocks/1/w"], ["blocks/*"])
        [('<root>', ('embed',)), ('blocks/0', ('blocks/0/w',)), ('blocks/1', ('blocks/1/w',))]
    """
    nodes = _subtree_paths(paths)
    owner: dict[str, int] = {}  # unit name -> index of the pattern that made it
    for i, pattern in enumerate(patterns):
        matched = [n for n in nodes if matches(pattern, n)]
        if not matched:
            examples = ", ".join(repr(n) for n in nodes[:6])
            raise ValueError(
                f"units[{i}] {pattern_repr(pattern)} matches no subtree of the params; "
                f"subtree paths look like {examples}"
            )
        chosen = set(matched)
        for name in matched:
            if any(a in chosen for a in _ancestors(name)):
                continue  # nested inside a match of the same pattern: part of that unit
            clash = next((a for a in (name, *_ancestors(name)) if a in owner), None)
            if clash is not None:
                raise ValueError(_overlap(name, i, pattern, clash, owner[clash], patterns))
            owner[name] = i
    for name, i in owner.items():  # a unit that contains a later pattern's unit
        inner = next((o for o in owner if o != name and o.startswith(name + "/")), None)
        if inner is not None:
            raise ValueError(
                _overlap(inner, owner[inner], patterns[owner[inner]], name, i, patterns)
            )
    members: dict[str, list[str]] = {ROOT: []}
    for path in paths:
        unit = next((a for a in (path, *_ancestors(path)) if a in owner), ROOT)
        members.setdefault(unit, []).append(path)
    return [(name, tuple(ps)) for name, ps in members.items() if ps]


def _subtree_paths(paths: Sequence[str]) -> list[str]:
    """Every subtree path (internal nodes and leaves, root excluded) in tree order."""
    seen: dict[str, None] = {}
    for path in paths:
        parts = path.split("/") if path else []
        for k in range(1, len(parts) + 1):
            seen.setdefault("/".join(parts[:k]))
    return list(seen)


def _ancestors(path: str) -> list[str]:
    parts = path.split("/")
    return ["/".join(parts[:k]) for k in range(len(parts) - 1, 0, -1)]


def _overlap(
    inner: str, i: int, pattern: Pattern, outer: str, j: int, patterns: Sequence[Pattern]
) -> str:
    what = "is the same subtree as" if inner == outer else "lies inside"
    return (
        f"units overlap: {inner!r} (from units[{i}] {pattern_repr(pattern)}) {what} {outer!r} "
        f"(from units[{j}] {pattern_repr(patterns[j])}); each leaf belongs to one unit, so "
        f"drop one pattern or make them disjoint"
    )
