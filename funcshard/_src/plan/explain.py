"""``Plan.explain()``: the plan as readable tables, per leaf and per unit."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from funcshard._src.spec.named_sharding import NamedSharding

if TYPE_CHECKING:
    from funcshard._src.plan.cost import CostModel
    from funcshard._src.plan.plan import Plan


def explain(plan: Plan, cost: CostModel | None = None, /) -> str:
    """Renders ``plan``: header, per-leaf table, per-unit table with reasons, per-rank costs, notes."""
    mesh = plan.mesh
    leaf_rows: list[list[str]] = []
    unit_bytes: dict[str, int] = {}
    unit_full: dict[str, int] = {}
    padded_any = False
    for leaf in plan.leaves:
        sharding = NamedSharding(mesh, leaf.spec)
        shard = sharding.shard_shape(leaf.shape)
        uneven = any(size % n for size, n in zip(leaf.shape, sharding.num_shards(leaf.shape)))
        padded_any |= uneven
        leaf_rows.append(
            [
                leaf.path or "<root>",
                _shape(leaf.shape),
                str(leaf.dtype).removeprefix("torch."),
                repr(leaf.spec),
                _shape(shard) + ("*" if uneven else ""),
                leaf.unit,
            ]
        )
        unit_bytes[leaf.unit] = unit_bytes.get(leaf.unit, 0) + math.prod(shard) * leaf.itemsize
        unit_full[leaf.unit] = unit_full.get(leaf.unit, 0) + leaf.numel * leaf.itemsize
    reasons = dict(plan.reasons)
    unit_rows = [
        [
            u.name,
            u.strategy,
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
        *costs(plan, cost),
    ]
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)


def costs(plan: Plan, cost: CostModel | None = None, /) -> list[str]:
    """The per-rank section of :func:`explain`: memory by category, communication, time, assumptions."""
    from funcshard._src.plan.cost import CostModel, estimate  # cost builds on the plan

    model = cost or plan.cost or CostModel()
    est = estimate(plan, model)
    mem = est.memory
    rows = [[name, format_bytes(n), f"{n:,}"] for name, n in mem.rows()]
    rows.append(["total", format_bytes(mem.total), f"{mem.total:,}"])
    lines = ["Per rank, per step:", table(["memory", "", "bytes"], rows)]
    if plan.memory_budget is not None:
        lines.append(
            f"budget {format_bytes(plan.memory_budget)}: "
            f"{format_bytes(plan.memory_budget - mem.total)} to spare"
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


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], /) -> str:
    """A plain-text table with left-aligned columns.

    Example:
        >>> print(table(["a", "bb"], [["xyz", "1"]]))
        a    bb
        ---  --
        xyz  1
    """
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*headers), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*row) for row in rows]
    return "\n".join(line.rstrip() for line in out)


def format_bytes(n: float, /) -> str:
    """``1536`` -> ``'1.50 KiB'``.

    Example:
        >>> format_bytes(3 * 2**30)
        '3.00 GiB'
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"
