"""``fs.plan``: from params, a mesh, rules and units to a :class:`Plan`.

Checks what it is asked, resolves every leaf's spec and unit
(:mod:`funcshard._src.plan.resolve`) or, for ``strategy="auto"`` or a
``memory_budget``, hands over to the automatic planner
(:mod:`funcshard._src.plan.auto`), and attaches the plan's estimate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import torch

from funcshard._src import tree
from funcshard._src.plan import auto
from funcshard._src.plan import (
    explain as explain,  # adds Plan.explain: See [Note: the plan is data] in ``plan/plan.py``
)
from funcshard._src.plan.cost import estimate
from funcshard._src.plan.cost_model import CostModel
from funcshard._src.plan.plan import Default, Plan, Requested
from funcshard._src.plan.resolve import Spec, build
from funcshard._src.plan.rules import check_pattern, check_rules
from funcshard._src.plan.sizes import parse_bytes
from funcshard._src.plan.strategy import check_strategy
from funcshard._src.plan.units import REQUESTED_LAYOUTS, RequestedLayout
from funcshard._src.spec.mesh import Mesh
from funcshard._src.spec.partition_spec import P


def plan(
    params: Any,
    mesh: Mesh,
    /,
    *,
    rules: Sequence[tuple[Any, P]] = (),
    units: Sequence[Any] | Literal["auto"] = (),
    frozen: Sequence[Any] = (),
    strategy: Requested = "full_shard",
    default: Default = "dim_0",
    layout: RequestedLayout = "leaf",
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
        frozen: patterns naming leaves (or subtrees) that are not trained: sharded,
            gathered and freed per unit like the others, with no gradient and no
            optimizer state (a LoRA base; ``frozen=apply.frozen`` for an ``nn.Module``).
        strategy: ``"full_shard"`` (ZeRO-3), ``"shard_grad_op"`` (ZeRO-2),
            ``"shard_optimizer"`` (ZeRO-1), ``"no_shard"``, ``"hybrid_shard"``, or
            ``"auto"``: per unit, the one with the least communication that fits
            ``memory_budget`` (see ``plan.explain()`` for what each does).
        default: the spec of a leaf no rule matches: ``"dim_0"`` (dim 0 over the
            strategy's shard axes, unless another dim needs less padding; scalars
            replicate), ``"largest_dim"`` (its largest dim), a fixed ``P``, or
            ``None`` to require a rule for every leaf.
        layout: how every unit stores its leaves: ``"leaf"``, each leaf's chunk of
            its spec; ``"flat"`` (FSDP1 / ZeRO style), the unit's leaves concatenated
            and cut into one equal range per rank, so a gathered unit is one buffer
            whose full leaves are views of it and nothing pads a leaf. The flat
            layout is funcshard's extension of ``PartitionSpec`` semantics: a leaf's
            spec is then only its JAX counterpart (``docs/planner.md``, "Layouts").
            ``"auto"``: per unit, ``"flat"`` where it is faster and places the same
            leaves, ``"leaf"`` for a unit of one leaf or one with a leaf a rule
            places; :meth:`Plan.explain` says which it picked.
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
        >>> auto = plan(params, Mesh({"fsdp": 2}), units="auto", strategy="auto", memory_budget="4.1KiB")
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
    if not (default is None or default in ("dim_0", "largest_dim") or isinstance(default, P)):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise TypeError(f"default must be 'dim_0', 'largest_dim', a P or None; got {default!r}")
    if layout not in REQUESTED_LAYOUTS:
        raise ValueError(f"layout must be one of {list(REQUESTED_LAYOUTS)}; got {layout!r}")
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
        patterns, rule = auto.choose_units(paths, leaves)
        notes.append(f"units='auto': {rule}")
    else:
        patterns = [check_pattern(u, what=f"units[{i}]") for i, u in enumerate(units)]
    if isinstance(frozen, (str, bytes)) or not isinstance(frozen, Sequence):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise TypeError(f"frozen must be a list of patterns, e.g. [{frozen!r}]; got {frozen!r}")
    frozen_patterns = tuple(check_pattern(f, what=f"frozen[{i}]") for i, f in enumerate(frozen))
    spec = Spec(
        paths,
        leaves,
        treedef,
        mesh,
        checked_rules,
        patterns,
        default,
        strict,
        tuple(notes),
        frozen_patterns,
        layout,
    )
    if strategy == "auto" or budget is not None:
        assert budget is not None
        made = auto.plan_within(spec, strategy, budget, cost)
    else:
        made = build(spec, strategy, cost=cost)
    _check_requires_grad(leaves, made)
    _refuse_complex(leaves, made)
    return dataclasses.replace(made, estimate=estimate(made, cost))


def _check_requires_grad(leaves: list[torch.Tensor], made: Plan) -> None:
    """Refuses ``requires_grad=False`` leaves among leaves that require grad, unless frozen.

    funcshard trains every floating leaf the plan does not freeze, whatever its
    ``requires_grad``; a leaf left out on purpose (an ``nn.Module``'s frozen parameter)
    would be trained without a word. ``fs.shard`` checks the same of values; this
    catches it where no values pass through ``fs.shard`` (``fs.materialize``, loading).
    """
    floating = [
        (lp.path, t)
        for t, lp in zip(leaves, made.leaves)
        if t.is_floating_point() and not lp.frozen
    ]
    if not any(t.requires_grad for _, t in floating):
        return
    off = [p or "<root>" for p, t in floating if not t.requires_grad]
    if off:
        raise ValueError(
            f"{off[:5]} have requires_grad=False while other leaves require grad: funcshard "
            f"computes gradients for every leaf of params that the plan does not freeze, so "
            f"requires_grad=False would be ignored. Freeze them in the plan: fs.plan(..., "
            f"frozen={off[:2]!r}) (sharded, no gradient, no optimizer state; for an nn.Module, "
            f"frozen=apply.frozen), or give every leaf the same requires_grad"
        )


def _refuse_complex(leaves: list[torch.Tensor], made: Plan) -> None:
    """Refuses a complex leaf that requires grad and is not frozen: only real floating leaves train."""
    for t, lp in zip(leaves, made.leaves):
        if t.is_complex() and t.requires_grad and not lp.frozen:
            raise ValueError(
                f"{lp.path or '<root>'}: a complex leaf ({t.dtype}); funcshard trains real "
                f"floating leaves, so its gradient would be dropped. Fix: keep it as real pairs "
                f"(torch.view_as_real) and view them as complex in the forward "
                f"(torch.view_as_complex), or freeze it: fs.plan(..., frozen=[{lp.path!r}])"
            )


def _check_budget(budget: int | str | None, strategy: Requested) -> int | None:
    if budget is None:
        if strategy == "auto":
            raise ValueError(
                "strategy='auto' needs memory_budget: the bytes per rank to fit, e.g. "
                "memory_budget='80GiB' (with cost=fs.cost.CostModel(...) describing the training)"
            )
        return None
    if isinstance(budget, bool) or not isinstance(budget, (int, str)):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise TypeError(
            f"memory_budget must be bytes (an int) or a size like '80GiB', got {budget!r}"
        )
    return parse_bytes(budget)
