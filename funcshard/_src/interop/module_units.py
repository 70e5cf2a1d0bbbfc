"""Units of a module: the submodules gathered together, where each parameter is used, their patterns.

See [Note: tied parameters] in ``module_tree.py`` for a parameter used in several places.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any, TypeAlias

from torch import nn

from funcshard._src.interop.module_tree import subtree_at
from funcshard._src.plan.rules import matches, pattern_repr

UnitPattern: TypeAlias = "str | type[nn.Module] | re.Pattern[str]"
_GLOB_CHARS = frozenset("*?[]")


@dataclasses.dataclass(frozen=True)
class UnitInfo:
    """One unit submodule: where it is and how its subtree's leaves map to its tensor names."""

    path: str  # the subtree path in the params, e.g. "model/layers/0"
    module: nn.Module
    own: dict[str, tuple[str, ...]]  # leaf path in the unit's subtree -> names under the unit
    borrowed: tuple[tuple[str, str], ...]  # (name under the unit, root leaf path): tied to the root


@dataclasses.dataclass(frozen=True)
class Units:
    """The units of a functionalized module, in module order."""

    infos: tuple[UnitInfo, ...]
    owner: dict[str, str | None]  # canonical parameter name -> unit path (None: the root unit)

    @property
    def paths(self) -> tuple[str, ...]:
        """Every unit's subtree path."""
        return tuple(u.path for u in self.infos)

    def unit_of(self, name: str, /) -> str | None:
        """The unit path holding the leaf named ``name`` (``None``: the root unit)."""
        return self.owner[name]


def resolve_units(
    module: nn.Module, units: Sequence[UnitPattern], trainable: Sequence[tuple[str, ...]], /
) -> Units:
    """Finds the unit submodules ``units`` name and where each trainable tensor is used.

    Args:
        module: the module.
        units: classes, class names, globs or regexes over submodule paths.
        trainable: the names of every trainable tensor, canonical name first.

    Raises:
        ValueError: a pattern naming no submodule or only submodules without trainable
            parameters, the module itself, overlapping units, a tied parameter used
            outside its unit.
        TypeError: ``units`` is not a list of patterns.
    """
    if isinstance(units, (str, type, re.Pattern)) or not isinstance(units, Sequence):
        raise TypeError(f"units must be a list, e.g. [{units!r}]; got {units!r}")
    modules = [(name.replace(".", "/"), m) for name, m in module.named_modules()]
    canonical = [names[0] for names in trainable]
    chosen: dict[str, tuple[int, nn.Module]] = {}
    for i, pattern in enumerate(units):
        matched = _match(modules, pattern, i)
        if any(path == "" for path, _ in matched):
            raise ValueError(
                f"units[{i}] {_describe(pattern)} matches the module itself; a unit is a "
                f"submodule: name the layers inside it"
            )
        paths = {path for path, _ in matched}
        outer = [(p, m) for p, m in matched if not any(a in paths for a in _ancestors(p))]
        with_leaves = [(p, m) for p, m in outer if any(_under(n, p) for n in canonical)]
        if not with_leaves:
            raise ValueError(
                f"units[{i}] {_describe(pattern)} matches only submodules without trainable "
                f"parameters ({', '.join(repr(p) for p, _ in outer[:4])}); a unit is the "
                f"parameters gathered for a submodule's forward: name submodules that hold some"
            )
        for path, m in with_leaves:
            clash = next(
                (c for c in chosen if c == path or _inside(path, c) or _inside(c, path)), None
            )
            if clash is not None:
                raise ValueError(
                    f"units overlap: {path!r} (from units[{i}] {_describe(pattern)}) and {clash!r} "
                    f"(from units[{chosen[clash][0]}] {_describe(units[chosen[clash][0]])}); each "
                    f"parameter belongs to one unit: drop a pattern or make them disjoint"
                )
            chosen[path] = (i, m)
    order = {path: k for k, (path, _) in enumerate(modules)}
    unit_paths = sorted(chosen, key=order.__getitem__)
    return _assign(module, [(p, chosen[p][1]) for p in unit_paths], trainable)


def unit_patterns(paths: Sequence[str], params: Any, /) -> tuple[str | re.Pattern[str], ...]:
    """Patterns for ``fs.plan(units=...)`` that match exactly the subtrees at ``paths``.

    The entries of a list node that are all units become one glob (``model/layers/*``);
    other units keep their exact path (a ``re.Pattern`` if a name holds glob characters).

    Example:
        >>> unit_patterns(["blocks/0", "blocks/1", "head"], {"blocks": [{}, {}], "head": {}})
        ('blocks/*', 'head')
    """
    by_parent: dict[str, list[str]] = {}
    for path in paths:
        parent, _, child = path.rpartition("/")
        by_parent.setdefault(parent, []).append(child)
    out: list[str | re.Pattern[str]] = []
    for parent, children in by_parent.items():
        node = subtree_at(params, parent)
        entries = (
            {str(i) for i, e in enumerate(node) if e is not None}
            if isinstance(node, list)
            else None
        )
        if entries is not None and entries == set(children):
            out.append(_pattern(f"{parent}/*" if parent else "*", literal_tail=False))
        else:
            out.extend(_pattern(f"{parent}/{c}" if parent else c) for c in children)
    return tuple(out)


# -- helpers ---------------------------------------------------------------------------


def _match(
    modules: list[tuple[str, nn.Module]], pattern: object, i: int
) -> list[tuple[str, nn.Module]]:
    classes = sorted({type(m).__name__ for _, m in modules})
    if isinstance(pattern, type):
        if not issubclass(pattern, nn.Module):
            raise TypeError(f"units[{i}]: {pattern!r} is not an nn.Module class")
        matched = [(p, m) for p, m in modules if isinstance(m, pattern)]
    elif isinstance(pattern, str) and pattern in classes:
        matched = [(p, m) for p, m in modules if type(m).__name__ == pattern]
    elif isinstance(pattern, (str, re.Pattern)):
        matched = [(p, m) for p, m in modules if p and matches(pattern, p)]  # pyright: ignore[reportUnknownArgumentType]
    else:
        raise TypeError(
            f"units[{i}]: {pattern!r} must be an nn.Module class, a class name, a glob over "
            f"submodule paths or a re.compile(...) pattern"
        )
    if not matched:
        examples = ", ".join(repr(p) for p, _ in modules[1:7])
        raise ValueError(
            f"units[{i}] {_describe(pattern)} names no submodule of {type(modules[0][1]).__name__}: "
            f"no submodule of that class and no submodule path it matches. Classes here: "
            f"{', '.join(classes)}; paths look like {examples}"
        )
    return matched


def _assign(
    module: nn.Module, units: list[tuple[str, nn.Module]], trainable: Sequence[tuple[str, ...]]
) -> Units:
    """Maps every name of every trainable tensor to its unit; see ``[Note: tied parameters]`` in ``interop/module_tree.py``."""
    unit_by_id = {id(m): path for path, m in units}
    occurrence: dict[str, tuple[str | None, str]] = {}  # module name -> (unit path, its prefix)
    for name, m in module.named_modules(remove_duplicate=False):
        parent = occurrence.get(name.rpartition(".")[0], (None, "")) if name else (None, "")
        if id(m) in unit_by_id and parent[0] is None:
            occurrence[name] = (unit_by_id[id(m)], name)
        else:
            occurrence[name] = parent
    own: dict[str, dict[str, list[str]]] = {path: {} for path, _ in units}
    borrowed: dict[str, list[tuple[str, str]]] = {path: [] for path, _ in units}
    owner: dict[str, str | None] = {}
    for names in trainable:
        home, _ = occurrence[names[0].rpartition(".")[0]]
        owner[names[0]] = home
        leaf = names[0].replace(".", "/")
        for name in names:
            unit, prefix = occurrence[name.rpartition(".")[0]]
            rel = name[len(prefix) + 1 :] if prefix else name
            if unit is not None and home is None:
                borrowed[unit].append((rel, leaf))
            elif unit == home and home is not None:
                own[home].setdefault(leaf[len(home) + 1 :], []).append(rel)
            elif unit != home:
                where = f"unit {unit!r}" if unit else "outside every unit"
                raise ValueError(
                    f"tied parameter {names[0]!r} (a leaf of unit {home!r}) is also used as "
                    f"{name!r}, {where}; a unit's leaves are full only inside its own forward. "
                    f"Put both submodules in one unit, or leave {home!r} out of units so that the "
                    f"leaf is in the root unit"
                )
    infos = tuple(
        UnitInfo(
            path,
            m,
            {k: tuple(v) for k, v in own[path].items()},
            tuple(borrowed[path]),
        )
        for path, m in units
    )
    return Units(infos, owner)


def _pattern(path: str, *, literal_tail: bool = True) -> str | re.Pattern[str]:
    segments = path.split("/")
    literal = segments if literal_tail else segments[:-1]
    if not any(_GLOB_CHARS & set(s) for s in literal):
        return path
    parts = [re.escape(s) for s in literal] + ([] if literal_tail else ["[^/]+"])
    return re.compile("^" + "/".join(parts) + "$")


def _describe(pattern: object) -> str:
    if isinstance(pattern, type):
        return f"class {pattern.__name__}"
    if isinstance(pattern, (str, re.Pattern)):
        return pattern_repr(pattern)  # pyright: ignore[reportUnknownArgumentType]
    return repr(pattern)


def _ancestors(path: str) -> list[str]:
    parts = path.split("/")
    return ["/".join(parts[:k]) for k in range(len(parts) - 1, 0, -1)]


def _inside(path: str, outer: str) -> bool:
    return path.startswith(outer + "/")


def _under(name: str, path: str) -> bool:
    return name.replace(".", "/").startswith(path + "/")
