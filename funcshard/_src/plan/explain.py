"""``Plan.explain()``: a plan and its estimate as readable tables, per leaf, per unit and per rank."""

from __future__ import annotations

import math
from typing import cast

from funcshard._src.dtypes import dtype_name
from funcshard._src.plan.estimates import Estimate
from funcshard._src.plan.plan import Plan
from funcshard._src.plan.sizes import format_bytes, shape_text, table
from funcshard._src.plan.strategy import (
    MEANINGS,
    Strategy,
    partial_axes,
    partial_copy_lifetime,
    shard_axes,
)
from funcshard._src.spec.mesh import Mesh
from funcshard._src.spec.named_sharding import NamedSharding


def explain(plan: Plan, /) -> str:
    """Renders ``plan``: header, per-leaf table, per-unit table with reasons, per-rank costs, notes."""
    mesh = plan.mesh
    leaf_rows: list[list[str]] = []
    unit_bytes: dict[str, int] = {}
    unit_full: dict[str, int] = {}
    padded_any = False
    flat = {u.name: u for u in plan.units if u.layout == "flat"}
    for leaf in plan.leaves:
        sharding = NamedSharding(mesh, leaf.spec)
        shard = sharding.shard_shape(leaf.shape)
        uneven = any(size % n for size, n in zip(leaf.shape, sharding.num_shards(leaf.shape)))
        if leaf.unit in flat:  # stored as a range of its unit's concatenation
            shard, uneven = (leaf.numel,), False
        padded_any |= uneven
        leaf_rows.append(
            [
                leaf.path or "<root>",
                shape_text(leaf.shape),
                dtype_name(leaf.dtype),
                repr(leaf.spec),
                ("flat" if leaf.unit in flat else shape_text(shard)) + ("*" if uneven else ""),
                leaf.unit,
            ]
        )
        unit_bytes[leaf.unit] = unit_bytes.get(leaf.unit, 0) + math.prod(shard) * leaf.itemsize
        unit_full[leaf.unit] = unit_full.get(leaf.unit, 0) + leaf.numel * leaf.itemsize
    for name, u in flat.items():  # one equal range of the concatenation per group rank
        g = math.prod(mesh.axis_size(a) for a in shard_axes(u.strategy, mesh))
        unit_bytes[name] = -(-unit_bytes[name] // g)
    reasons = dict(plan.reasons)
    unit_rows = [
        [
            u.name,
            u.strategy + (" (flat)" if u.layout == "flat" else ""),
            str(len(u.paths)),
            format_bytes(unit_full[u.name]),
            format_bytes(unit_bytes[u.name]),
            reasons.get(u.name, "requested" if plan.strategy != "auto" else ""),
        ]
        for u in plan.units
    ]
    total = sum(unit_full.values())
    per_rank = sum(unit_bytes.values())
    n_params = sum(leaf.numel for leaf in plan.leaves)
    lines = [
        f"Plan on {mesh!r} ({mesh.size} rank{'s' if mesh.size != 1 else ''}), strategy {plan.strategy}",
        "",
        table(["path", "shape", "dtype", "spec", "shard", "unit"], leaf_rows),
    ]
    if padded_any:
        lines.append(
            "* uneven: every rank stores the shard padded to this shape; padding sits at the end"
        )
    lines += [
        "",
        table(["unit", "strategy", "leaves", "params", "params/rank", "why"], unit_rows),
        "",
        f"{n_params:,} parameters, {format_bytes(total)}; {format_bytes(per_rank)} of parameters per rank",
        f"fingerprint {plan.fingerprint()}",
        "",
        *costs(plan),
    ]
    lines += [f"note: {note}" for note in plan.notes]
    used = {u.strategy for u in plan.units}
    lines += [f"{s}: {MEANINGS[s]}{_on_this_mesh(s, mesh)}" for s in MEANINGS if s in used]
    return "\n".join(lines)


def _on_this_mesh(strategy: Strategy, mesh: Mesh, /) -> str:
    """Where ``strategy``'s partial copy is re-gathered on ``mesh``; see [Note: partial copies] in ``plan/strategy.py``."""
    regather, replicated = partial_axes(strategy, mesh)
    if not regather:
        return ""
    if partial_copy_lifetime(strategy, mesh) is None:
        return " (here the copy is the shard: gathered as full_shard)"
    names = ", ".join(repr(a) for a in replicated)
    return f" (here: re-gathered over {regather[0]!r}, replicated over {names})"


def costs(plan: Plan, /) -> list[str]:
    """The per-rank section of :func:`explain`: memory by category, communication, time, assumptions."""
    est = cast(Estimate | None, plan.estimate)  # the plan holds it as data
    if est is None:
        return [
            "Per rank: not estimated (fs.cost.estimate(plan) gives memory, communication and time)"
        ]
    mem = est.memory
    rows = [[name, format_bytes(n), f"{n:,}"] for name, n in mem.rows()]
    rows.append(["total", format_bytes(mem.total), f"{mem.total:,}"])
    lines = ["Per rank, per step:", table(["memory", "", "bytes"], rows)]
    budget = est.budget if est.budget is not None else plan.memory_budget
    if budget is not None:
        usable = budget - est.reserve
        spare = usable - mem.total
        lines.append(
            f"budget {format_bytes(budget)}, reserve {format_bytes(est.reserve)} for the runtime "
            f"(CUDA context, communicator buffers, fragmentation): {format_bytes(usable)} usable, "
            + (
                f"{format_bytes(spare)} to spare"
                if spare >= 0
                else f"{format_bytes(-spare)} ({-spare:,} bytes) over"
            )
        )
    comm_rows = [
        [op, "+".join(axes), format_bytes(n), f"{n:,}"]
        for (op, axes), n in sorted(est.comm.items())
    ]
    lines += [
        "",
        table(["sent", "mesh axes", "", "bytes"], comm_rows) if comm_rows else "no communication",
    ]
    if est.time is not None:
        t = est.time
        lines += [
            "",
            f"estimated step {t.step_s * 1e3:.1f} ms: compute {t.compute_s * 1e3:.1f} ms, "
            f"communication {t.comm_s * 1e3:.1f} ms ({t.exposed_comm_s * 1e3:.1f} ms not hidden), "
            f"optimizer {t.optimizer_s * 1e3:.1f} ms; {t.tokens_per_s:,.0f} tokens/s over "
            f"{plan.mesh.size} ranks",
        ]
    lines += ["", "Assumptions:"] + [f"- {a}" for a in est.assumptions]
    return lines


def _explain(self: Plan) -> str:
    """A readable report: per leaf its spec and shard; per unit its strategy and why; per rank memory and communication.

    The per-rank section is the plan's :attr:`estimate`; a plan read back with
    :meth:`from_json` has none until ``fs.cost.estimate`` gives it one.

    Example:
        >>> import torch
        >>> from funcshard._src.plan.planner import plan
        >>> from funcshard._src.spec.mesh import Mesh
        >>> params = {"w": torch.zeros(8, 4), "b": torch.zeros(4)}
        >>> print(plan(params, Mesh({"fsdp": 2})).explain())  # doctest: +ELLIPSIS
        Plan on Mesh({'fsdp': 2}) (2 ranks), strategy full_shard
        ...
    """
    return explain(self)


_explain.__name__ = _explain.__qualname__ = "explain"
Plan.explain = (
    _explain  # a method added from above: See [Note: the plan is data] in ``plan/plan.py``
)
