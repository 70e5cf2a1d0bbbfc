"""Plan: every leaf's spec and unit, every unit's strategy; built by :func:`plan`.

A plan is immutable and holds no tensors, only shapes and dtypes, so a plan for
a model far larger than this machine costs nothing to build. It round-trips
through JSON and has a fingerprint that is equal on every rank that built it
from the same inputs.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from funcshard._src import tree
from funcshard._src.plan import explain as _explain
from funcshard._src.plan.rules import Rule, check_pattern, check_rules, first_match
from funcshard._src.plan.strategy import Strategy, check_strategy, default_spec, shard_axes
from funcshard._src.plan.units import ROOT, Unit, resolve_units
from funcshard._src.spec.mesh import Mesh
from funcshard._src.spec.named_sharding import NamedSharding
from funcshard._src.spec.partition_spec import P

Default = Literal["largest_dim"] | P | None
_JSON_VERSION = 1


@dataclass(frozen=True)
class LeafPlan:
    """One leaf's placement: path, global shape, dtype, spec and unit."""

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    spec: P
    unit: str

    def sharding(self, mesh: Mesh, /) -> NamedSharding:
        """The leaf's :class:`NamedSharding` on ``mesh``."""
        return NamedSharding(mesh, self.spec)

    @property
    def numel(self) -> int:
        """Elements of the whole leaf."""
        n = 1
        for size in self.shape:
            n *= size
        return n

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize


@dataclass(frozen=True)
class Plan:
    """Where every leaf lives: built by :func:`plan`, immutable, JSON round-trippable.

    Attributes:
        mesh: the mesh the plan places leaves on.
        treedef: the params' tree structure.
        leaves: one :class:`LeafPlan` per leaf, in leaf order.
        units: the units, root unit (if any) first, then in tree order.
        strategy: the strategy requested for the plan.
        notes: remarks made while planning (rules that matched no leaf, ...).
    """

    mesh: Mesh
    treedef: tree.TreeDef
    leaves: tuple[LeafPlan, ...]
    units: tuple[Unit, ...]
    strategy: Strategy
    notes: tuple[str, ...] = ()

    @property
    def specs(self) -> Any:
        """A pytree of :class:`P` with the params' structure (JAX ``in_shardings`` style)."""
        return tree.unflatten(self.treedef, [leaf.spec for leaf in self.leaves])

    @property
    def shardings(self) -> Any:
        """A pytree of :class:`NamedSharding` with the params' structure."""
        return tree.unflatten(self.treedef, [leaf.sharding(self.mesh) for leaf in self.leaves])

    @functools.cached_property
    def _by_path(self) -> dict[str, LeafPlan]:
        return {leaf.path: leaf for leaf in self.leaves}

    @functools.cached_property
    def _units_by_name(self) -> dict[str, Unit]:
        return {unit.name: unit for unit in self.units}

    def leaf(self, path: str, /) -> LeafPlan:
        """The plan of the leaf at ``path``.

        Raises:
            KeyError: no leaf has that path.
        """
        try:
            return self._by_path[path]
        except KeyError:
            raise KeyError(f"no leaf {path!r} in the plan") from None

    def unit(self, name: str, /) -> Unit:
        """The unit called ``name`` (``"<root>"`` for the root unit).

        Raises:
            KeyError: no such unit; the message lists the units.
        """
        try:
            return self._units_by_name[name]
        except KeyError:
            raise KeyError(f"no unit {name!r}; units are {[u.name for u in self.units]}") from None

    def explain(self) -> str:
        """A readable report: per leaf its spec, shard shape and unit; per unit its strategy and bytes.

        Example:
            >>> params = {"w": torch.zeros(8, 4), "b": torch.zeros(4)}
            >>> print(plan(params, Mesh({"fsdp": 2})).explain())  # doctest: +ELLIPSIS
            Plan on Mesh({'fsdp': 2}) (2 ranks), strategy full_shard
            ...
        """
        return _explain.explain(self)

    def to_json(self) -> dict[str, Any]:
        """The plan as JSON-ready data; :meth:`from_json` inverts it."""
        return {
            "version": _JSON_VERSION,
            "mesh": self.mesh.to_json(),
            "strategy": self.strategy,
            "treedef": tree.treedef_to_json(self.treedef),
            "leaves": [
                {
                    "path": leaf.path,
                    "shape": list(leaf.shape),
                    "dtype": str(leaf.dtype).removeprefix("torch."),
                    "spec": leaf.spec.to_json(),
                    "unit": leaf.unit,
                }
                for leaf in self.leaves
            ],
            "units": [
                {"name": u.name, "strategy": u.strategy, "paths": list(u.paths)} for u in self.units
            ],
            "notes": list(self.notes),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | str, /) -> Plan:
        """Rebuilds a plan from :meth:`to_json` output (a dict or its JSON text).

        Raises:
            ValueError: the data is not a funcshard plan of a known version.
        """
        d: Mapping[str, Any] = json.loads(data) if isinstance(data, str) else data
        if d.get("version") != _JSON_VERSION:
            raise ValueError(
                f"not a funcshard plan of version {_JSON_VERSION}: version {d.get('version')!r}"
            )
        leaves = tuple(
            LeafPlan(
                path=str(x["path"]),
                shape=tuple(int(s) for s in x["shape"]),
                dtype=_dtype(x["dtype"]),
                spec=P.from_json(x["spec"]),
                unit=str(x["unit"]),
            )
            for x in d["leaves"]
        )
        units = tuple(
            Unit(str(u["name"]), tuple(str(p) for p in u["paths"]), check_strategy(u["strategy"]))
            for u in d["units"]
        )
        return cls(
            mesh=Mesh.from_json(d["mesh"]),
            treedef=tree.treedef_from_json(d["treedef"]),
            leaves=leaves,
            units=units,
            strategy=check_strategy(d["strategy"]),
            notes=tuple(str(n) for n in d.get("notes", ())),
        )

    def fingerprint(self) -> str:
        """A stable 16-hex-digit digest of everything that decides placement.

        Equal plans have equal fingerprints in every process; ranks compare them
        to catch diverged configurations before the first collective.
        """
        payload = {**self.to_json(), "treedef": repr(self.treedef), "notes": None}
        text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def plan(
    params: Any,
    mesh: Mesh,
    /,
    *,
    rules: Sequence[tuple[Any, P]] = (),
    units: Sequence[Any] = (),
    strategy: Strategy = "full_shard",
    default: Default = "largest_dim",
    strict: bool = False,
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
            under no unit form the root unit.
        strategy: ``"full_shard"``, ``"shard_grad_op"``, ``"no_shard"`` or ``"hybrid_shard"``.
        default: the spec of a leaf no rule matches: ``"largest_dim"`` (its largest
            dim over the strategy's shard axes; scalars replicate), a fixed ``P``,
            or ``None`` to require a rule for every leaf.
        strict: refuse dims that do not divide by their shard count, as JAX does.

    Returns:
        The :class:`Plan`.

    Raises:
        TypeError: a leaf that is not a tensor, or malformed rules or units.
        ValueError: a spec that does not fit its leaf or the strategy, an unmatched
            leaf with ``default=None``, a unit pattern matching nothing, overlapping
            units. Each message names the leaf path or pattern and the fix.

    Example:
        >>> params = {"embed": torch.zeros(16, 8), "blocks": [{"w": torch.zeros(8, 8)}] * 2}
        >>> p = plan(params, Mesh({"fsdp": 2}), rules=[("embed", P(None, "fsdp"))], units=["blocks/*"])
        >>> p.specs
        {'embed': P(None, 'fsdp'), 'blocks': [{'w': P('fsdp')}, {'w': P('fsdp')}]}
        >>> [u.name for u in p.units]
        ['<root>', 'blocks/0', 'blocks/1']
    """
    if not isinstance(mesh, Mesh):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise TypeError(f"plan: mesh must be a funcshard Mesh, got {type(mesh).__name__}")
    strategy = check_strategy(strategy)
    checked_rules = check_rules(rules)
    if isinstance(units, (str, bytes)) or not isinstance(units, Sequence):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise TypeError(f"units must be a list of patterns, e.g. [{units!r}]; got {units!r}")
    patterns = [check_pattern(u, what=f"units[{i}]") for i, u in enumerate(units)]
    if not (default is None or default == "largest_dim" or isinstance(default, P)):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise TypeError(f"default must be 'largest_dim', a P or None; got {default!r}")

    paths, leaves, treedef = tree.flatten_with_paths(params)
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{path or '<root>'}: leaf is a {type(leaf).__name__}, not a torch.Tensor; "
                f"params must be a pytree of tensors (wrap constants with torch.tensor, or "
                f"keep them outside params)"
            )
    unit_of = {p: name for name, ps in resolve_units(paths, patterns) for p in ps}
    used = [False] * len(checked_rules)
    planned: list[LeafPlan] = []
    for path, leaf in zip(paths, leaves):
        shape = tuple(leaf.shape)
        spec = _resolve_spec(path, shape, checked_rules, used, strategy, mesh, default)
        NamedSharding(mesh, spec).validate(shape, path=path or "<root>", strict=strict)
        planned.append(LeafPlan(path, shape, leaf.dtype, spec, unit_of[path]))

    unit_paths: dict[str, list[str]] = {}
    for leaf in planned:
        unit_paths.setdefault(leaf.unit, []).append(leaf.path)
    ordered = sorted(
        unit_paths, key=lambda name: name != ROOT
    )  # stable: root first, then tree order
    notes = tuple(
        f"rules[{i}] {rule!r} matched no leaf"
        for i, (rule, hit) in enumerate(zip(checked_rules, used))
        if not hit
    )
    return Plan(
        mesh=mesh,
        treedef=treedef,
        leaves=tuple(planned),
        units=tuple(Unit(name, tuple(unit_paths[name]), strategy) for name in ordered),
        strategy=strategy,
        notes=notes,
    )


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


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in plan JSON")
    return dtype
