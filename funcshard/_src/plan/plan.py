"""Plan: every leaf's spec and unit, every unit's strategy; built by :func:`plan`.

A plan is immutable and holds no tensors, only shapes and dtypes, so a plan for
a model far larger than this machine costs nothing to build. It round-trips
through JSON and has a fingerprint that is equal on every rank that built it
from the same inputs.

[Note: the plan is data]
A plan is what the executor runs: specs, units, strategies. It imports nothing of
cost, step time, hardware or explanation, so a step loads only the modules it
runs (``tests/test_layering.py`` follows the executor's imports to check it). What
describes a plan is added from above: ``explain.py`` adds :meth:`Plan.explain`,
and the plan's ``cost`` and ``estimate`` are filled in by the planner.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from funcshard._src import tree, tree_json
from funcshard._src.dtypes import MAX_ELEMENTS, dtype_name, dtype_of, plain_dtype
from funcshard._src.plan.leaf import LeafPlan as LeafPlan
from funcshard._src.plan.strategy import Strategy, check_strategy
from funcshard._src.plan.units import LAYOUTS, Unit
from funcshard._src.spec.mesh import Mesh
from funcshard._src.spec.named_sharding import NamedSharding
from funcshard._src.spec.partition_spec import P
from funcshard._src.untrusted import loads_json

Default = Literal["dim_0", "largest_dim"] | P | None
Requested = Strategy | Literal["auto"]
_JSON_VERSION = 1


@dataclass(frozen=True)
class Plan:
    """Where every leaf lives: built by :func:`plan`, immutable, JSON round-trippable.

    Attributes:
        mesh: the mesh the plan places leaves on.
        treedef: the params' tree structure.
        leaves: one :class:`LeafPlan` per leaf, in leaf order.
        units: the units, root unit (if any) first, then in tree order.
        strategy: the strategy requested for the plan (``"auto"``: chosen per unit).
        notes: remarks made while planning (rules that matched no leaf, ...).
        reasons: per unit, why it has its strategy (``(unit name, reason)``).
        cost: the :class:`~funcshard.cost.CostModel` the plan was made with.
        memory_budget: the bytes per rank the plan was asked to fit, if any.
        estimate: an :class:`~funcshard.cost.Estimate`: what the plan costs each rank under ``cost`` (AdamW in the stored
            dtypes by default), as :func:`funcshard.plan` computed it; :meth:`explain`
            reports it. Not part of the plan's identity (equality, JSON, fingerprint).
    """

    mesh: Mesh
    treedef: tree.TreeDef
    leaves: tuple[LeafPlan, ...]
    units: tuple[Unit, ...]
    strategy: Requested
    notes: tuple[str, ...] = ()
    reasons: tuple[tuple[str, str], ...] = ()
    # a CostModel and an Estimate (cost_model.py, estimates.py), typed here as what the plan
    # itself never reads: See [Note: the plan is data]
    cost: object | None = None
    memory_budget: int | None = None
    estimate: object | None = field(default=None, compare=False, repr=False)

    @property
    def specs(self) -> Any:
        """A pytree of :class:`P` with the params' structure (JAX ``in_shardings`` style)."""
        return tree.unflatten(self.treedef, [leaf.spec for leaf in self.leaves])

    @property
    def shardings(self) -> Any:
        """A pytree of :class:`NamedSharding` with the params' structure."""
        return tree.unflatten(self.treedef, [leaf.sharding(self.mesh) for leaf in self.leaves])

    def to_jax_shardings(self, jax_mesh: Any, /) -> Any:
        """A pytree of ``jax.sharding.NamedSharding`` with the params' structure, for ``jax.jit``.

        Each leaf's spec on ``jax_mesh``; with device id = rank, every device holds the
        slices its rank holds here (``NamedSharding.indices``). JAX refuses dims that do
        not divide evenly, so plan with ``strict=True`` to use the shardings on arrays.

        Args:
            jax_mesh: a ``jax.sharding.Mesh`` with this plan's axis names and sizes, in order.

        Raises:
            ValueError: the JAX mesh's axes differ from the plan's.
            ImportError: JAX is not installed.

        Example:
            >>> import jax, numpy as np  # doctest: +SKIP
            >>> from funcshard._src.plan.planner import plan  # doctest: +SKIP
            >>> p = plan({"w": torch.zeros(4, 2)}, Mesh({"fsdp": 2}))  # doctest: +SKIP
            >>> jmesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("fsdp",))  # doctest: +SKIP
            >>> p.to_jax_shardings(jmesh)["w"].spec  # doctest: +SKIP
            P('fsdp',)
        """
        # JAX is optional: imported here, typed Any, so that the plan layer needs it only now
        import importlib

        try:
            jax_sharding: Any = importlib.import_module("jax.sharding")
        except ImportError as e:
            raise ImportError(
                f"Plan.to_jax_shardings needs JAX ({e}); pip install 'funcshard[jax]'"
            ) from None
        axes = {str(name): int(size) for name, size in dict(jax_mesh.shape).items()}
        if tuple(axes) != self.mesh.axis_names or tuple(axes.values()) != self.mesh.shape:
            raise ValueError(
                f"the JAX mesh has axes {axes}, the plan's mesh {self.mesh.axes}; build the JAX "
                f"mesh with the same axis names and sizes in the same order, e.g. "
                f"jax.sharding.Mesh(np.array(jax.devices()[:{self.mesh.size}])"
                f".reshape{self.mesh.shape}, {self.mesh.axis_names})"
            )
        return tree.unflatten(
            self.treedef,
            [
                jax_sharding.NamedSharding(jax_mesh, jax_sharding.PartitionSpec(*leaf.spec))
                for leaf in self.leaves
            ],
        )

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

    if TYPE_CHECKING:  # added by explain.py: See [Note: the plan is data]

        def explain(self) -> str: ...

    def to_json(self) -> dict[str, Any]:
        """The plan as JSON-ready data; :meth:`from_json` inverts it."""
        return {
            "version": _JSON_VERSION,
            "mesh": self.mesh.to_json(),
            "strategy": self.strategy,
            "treedef": tree_json.treedef_to_json(self.treedef),
            "leaves": [
                {
                    "path": leaf.path,
                    "shape": list(leaf.shape),
                    "dtype": dtype_name(leaf.dtype),
                    "spec": leaf.spec.to_json(),
                    "unit": leaf.unit,
                    **({"frozen": True} if leaf.frozen else {}),
                }
                for leaf in self.leaves
            ],
            "units": [
                {
                    "name": u.name,
                    "strategy": u.strategy,
                    "paths": list(u.paths),
                    **({"layout": u.layout} if u.layout != "leaf" else {}),
                }
                for u in self.units
            ],
            "notes": list(self.notes),
            "reasons": [list(r) for r in self.reasons],
            "memory_budget": self.memory_budget,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | str, /) -> Plan:
        """Rebuilds a plan from :meth:`to_json` output (a dict or its JSON text).

        The data is untrusted: every field is checked, the tree structure names
        only types this process knows (``fs.register_namedtuple``), and the leaves,
        units and specs must agree with each other and with the mesh.

        Raises:
            ValueError: the data is not a sound funcshard plan of a known version;
                the message names the field.

        Example:
            >>> from funcshard._src.plan.planner import plan
            >>> p = plan({"w": torch.zeros(4, 2)}, Mesh({"fsdp": 2}))
            >>> Plan.from_json(json.dumps(p.to_json())) == p
            True
        """
        # strict: no NaN, Infinity or 1e400, no key twice, at most 256 deep (a tree node is three
        # JSON levels); See [Note: reader discipline] in ``untrusted.py``
        d: Any = (
            loads_json(data, what="plan JSON", max_depth=256) if isinstance(data, str) else data
        )
        if not isinstance(d, Mapping) or d.get("version") != _JSON_VERSION:  # pyright: ignore[reportUnknownMemberType]
            version = d.get("version") if isinstance(d, Mapping) else None  # pyright: ignore[reportUnknownMemberType, reportUnknownVariableType]
            raise ValueError(
                f"not a funcshard plan of version {_JSON_VERSION}: version {version!r}"
            )
        try:
            plan = _plan_from_json(d)  # pyright: ignore[reportUnknownArgumentType]
        except ValueError as e:
            raise ValueError(f"plan JSON: {e}") from None
        except (TypeError, KeyError, IndexError, AttributeError, RecursionError) as e:
            raise ValueError(f"plan JSON is malformed ({type(e).__name__}: {e})") from None
        return plan

    def fingerprint(self) -> str:
        """A stable 16-hex-digit digest of everything that decides placement.

        Equal plans have equal fingerprints in every process; ranks compare them
        to catch diverged configurations before the first collective.
        """
        return self._fingerprint

    @functools.cached_property
    def _fingerprint(self) -> str:
        payload = {
            **self.to_json(),
            "treedef": repr(self.treedef),
            "notes": None,
            "reasons": None,
            "memory_budget": None,
        }
        text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


MAX_RANKS = 1 << 20  # a mesh axis, and the whole mesh
MAX_BUDGET = 1 << 60  # bytes per rank: an exabyte


def _dtype(name: object, what: str) -> torch.dtype:
    dtype = dtype_of(name)
    if dtype is None or not plain_dtype(dtype):
        raise ValueError(
            f"{what} is {str(name)[:40]!r}: unknown dtype, or one no leaf can have (a leaf is "
            f"floating, complex, integer or bool, of a byte or more)"
        )
    return dtype


def _int(x: object, what: str, limit: int | None = None) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or x < 0:
        raise ValueError(f"{what} must be an integer >= 0, got {repr(x)[:40]}")
    if limit is not None and x > limit:
        raise ValueError(f"{what} is {str(x)[:40]}, more than the {limit} a plan may hold")
    return x


def _shape(x: object, where: str) -> tuple[int, ...]:
    shape = tuple(_int(n, f"{where}.shape", MAX_ELEMENTS) for n in _list(x, f"{where}.shape"))
    if len(shape) > 64 or math.prod(shape) >= MAX_ELEMENTS:
        raise ValueError(
            f"{where}.shape {list(shape)[:8]} has {len(shape)} dims and {math.prod(shape)} "
            f"elements; a leaf has at most 64 and fewer than {MAX_ELEMENTS}"
        )
    return shape


def _bool(x: object, what: str) -> bool:
    if not isinstance(x, bool):
        raise ValueError(f"{what} must be true or false, got {x!r}")
    return x


def _str(x: object, what: str) -> str:
    if not isinstance(x, str):
        raise ValueError(f"{what} must be a string, got {x!r}")
    return x


def _list(x: object, what: str) -> list[Any]:
    if not isinstance(x, list):
        raise ValueError(f"{what} must be a list, got {type(x).__name__}")
    return x  # pyright: ignore[reportUnknownVariableType]


def _plan_from_json(d: Mapping[str, Any]) -> Plan:
    raw_mesh = _list(d["mesh"], "mesh")
    mesh = Mesh.from_json(
        [
            (_str(a[0], "a mesh axis name"), _int(a[1], "a mesh axis size", MAX_RANKS))
            for a in raw_mesh
        ]
    )
    if mesh.size > MAX_RANKS:
        raise ValueError(f"mesh has {mesh.size} ranks, more than the {MAX_RANKS} a plan may hold")
    treedef = tree_json.treedef_from_json(d["treedef"])
    leaves: list[LeafPlan] = []
    for i, x in enumerate(_list(d["leaves"], "leaves")):
        where = f"leaves[{i}]"
        spec = P.from_json(_list(x["spec"], f"{where}.spec"))
        leaf = LeafPlan(
            path=_str(x["path"], f"{where}.path"),
            shape=_shape(x["shape"], where),
            dtype=_dtype(x["dtype"], f"{where}.dtype"),
            spec=spec,
            unit=_str(x["unit"], f"{where}.unit"),
            frozen=_bool(x.get("frozen", False), f"{where}.frozen"),
        )
        NamedSharding(mesh, spec).validate(leaf.shape, path=leaf.path or "<root>")
        leaves.append(leaf)
    if treedef.num_leaves != len(leaves):
        raise ValueError(
            f"the tree structure has {treedef.num_leaves} leaves, the plan lists {len(leaves)}"
        )
    expected = tree.flatten_with_paths(tree.unflatten(treedef, [0] * len(leaves)))[0]
    if [leaf.path for leaf in leaves] != expected:
        raise ValueError("the leaf paths differ from the tree structure's")
    units: list[Unit] = []
    for i, u in enumerate(_list(d["units"], "units")):
        paths = tuple(_str(p, f"units[{i}].paths") for p in _list(u["paths"], f"units[{i}].paths"))
        layout = u.get("layout", "leaf")
        if layout not in LAYOUTS:
            raise ValueError(f"units[{i}].layout is {layout!r}, not one of {list(LAYOUTS)}")
        units.append(
            Unit(_str(u["name"], f"units[{i}].name"), paths, check_strategy(u["strategy"]), layout)
        )
    by_unit = {u.name: set(u.paths) for u in units}
    for leaf in leaves:
        if leaf.path not in by_unit.get(leaf.unit, set()):
            raise ValueError(f"leaf {leaf.path!r} names unit {leaf.unit!r}, which does not list it")
    if sum(len(u.paths) for u in units) != len(leaves) or len(by_unit) != len(units):
        raise ValueError("the units do not list every leaf exactly once")
    budget = d.get("memory_budget")
    strategy = d["strategy"]
    return Plan(
        mesh=mesh,
        treedef=treedef,
        leaves=tuple(leaves),
        units=tuple(units),
        strategy="auto" if strategy == "auto" else check_strategy(strategy),
        notes=tuple(_str(n, "notes") for n in _list(d.get("notes", []), "notes")),
        reasons=tuple(
            (_str(r[0], "reasons"), _str(r[1], "reasons"))
            for r in _list(d.get("reasons", []), "reasons")
        ),
        memory_budget=None if budget is None else _int(budget, "memory_budget", MAX_BUDGET),
    )
