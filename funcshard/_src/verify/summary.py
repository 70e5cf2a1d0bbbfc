"""From every rank's measurements to one :class:`VerifyReport`: maxima over ranks, the verdict, the fixes.

Pure: every rank summarizes the same gathered records, so every rank returns
the same report. A record is the JSON-able dict that ``verify.py`` measures on
one rank (see :func:`summarize` for its keys).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from funcshard._src.plan.estimates import Estimate
from funcshard._src.plan.plan import Plan
from funcshard._src.verify.report import CostRow, LeafRow, LossRow, VerifyReport

MAX_LEAF_PROBLEMS = 8  # then one line for the rest: the table lists every leaf

RANK_DEPENDENT = (
    "loss_fn depends on the rank (fs.rank(), a generator seeded per rank, per-rank state); make it "
    "the same function on every rank and let only the batch differ"
)


def summarize(
    records: Sequence[dict[str, Any]],
    plan: Plan,
    estimate: Estimate,
    /,
    *,
    optimizer_estimated: bool,
    precision: str,
    rtol: float,
    atol: float,
) -> VerifyReport:
    """The report of every rank's record (in rank order).

    A record holds ``problems`` (strings), ``losses`` (``[sharded, reference or
    None]`` per step), per leaf ``grad`` and ``param`` (``[diff, scale]`` or
    ``None``) and ``fingerprint`` (floats of the reference, see
    ``reference.fingerprint``), ``held`` (``[params, grads, optimizer]`` bytes,
    or ``None``), ``sent`` (bytes per ``"op:axes"``, per step) and ``peak``
    (gathered bytes, or ``None``).
    """
    problems = _merged([r["problems"] for r in records])
    steps = min(len(r["losses"]) for r in records)
    losses: list[LossRow] = []
    for t in range(steps):
        sharded = math.fsum(r["losses"][t][0] for r in records) / len(records)
        refs = [r["losses"][t][1] for r in records]
        if any(x is None for x in refs):
            continue
        row = LossRow(t, sharded, refs[0])
        losses.append(row)
        spread = max(abs(x - refs[0]) for x in refs) / max(abs(refs[0]), 1e-30)
        if spread > rtol:
            problems.append(
                f"step {t}: the ranks computed different reference losses ({_listing(refs)}): "
                + RANK_DEPENDENT
            )
        elif not abs(row.sharded - row.reference) <= atol + rtol * abs(row.reference):
            problems.append(
                f"step {t}: the loss averaged over ranks is {row.sharded:.6g} but the unsharded "
                f"reference's is {row.reference:.6g}: see the leaves below; a loss that is not "
                f"the mean over examples of each rank's batch (a sum) differs too"
            )
    leaves, leaf_problems = _leaves(records, plan, rtol, atol)
    if len(leaf_problems) > MAX_LEAF_PROBLEMS:
        more = len(leaf_problems) - MAX_LEAF_PROBLEMS
        leaf_problems = [
            *leaf_problems[:MAX_LEAF_PROBLEMS],
            f"... and {more} more leaves differ: see the table",
        ]
    problems += leaf_problems
    memory, sent, notes = _costs(records, estimate, optimizer_estimated)
    return VerifyReport(
        world_size=len(records),
        steps=steps,
        precision=precision,
        rtol=rtol,
        atol=atol,
        leaves=tuple(leaves) if steps else (),
        losses=tuple(losses),
        memory=tuple(memory),
        sent=tuple(sent),
        problems=tuple(problems),
        notes=tuple(notes),
    )


def _leaves(
    records: Sequence[dict[str, Any]], plan: Plan, rtol: float, atol: float
) -> tuple[list[LeafRow], list[str]]:
    rows: list[LeafRow] = []
    problems: list[str] = []
    for i, leaf in enumerate(plan.leaves):
        path = leaf.path or "<root>"
        grad = _max_pair([r["grad"][i] for r in records])
        param = _max_pair([r["param"][i] for r in records])
        prints = [r["fingerprint"][i] for r in records]
        spread = _spread(prints)
        agree = spread <= rtol
        grad_ok = grad is None or _close(grad, rtol, atol)
        param_ok = param is None or _close(param, rtol, atol)
        rows.append(
            LeafRow(
                path,
                leaf.unit,
                repr(leaf.spec),
                None if grad is None else grad[0],
                None if grad is None else grad[1],
                None if param is None else param[0],
                None if param is None else param[1],
                agree,
                agree and grad_ok and param_ok,
            )
        )
        tol = f"tolerance rtol {rtol:.0e}, atol {atol:.0e}"
        if not agree:
            problems.append(
                f"{path}: the ranks computed different unsharded references for this leaf "
                f"(relative spread {spread:.1e}): {RANK_DEPENDENT}"
            )
        elif grad is not None and not grad_ok:
            where = (
                "the root unit (used directly)" if leaf.unit == "<root>" else f"unit {leaf.unit!r}"
            )
            problems.append(
                f"{path}: the sharded gradient differs from the unsharded reference by "
                f"{grad[0]:.2e} (largest reference gradient {grad[1]:.2e}; {tol}). The leaf is in "
                f"{where}: check that loss_fn uses a unit's leaves only through "
                f"fs.call(fn, <that unit's subtree>, ...), is deterministic (no dropout or unseeded "
                f"randomness) and is the same on every rank; or loosen rtol for this precision"
            )
        elif param is not None and not param_ok:
            problems.append(
                f"{path}: after the optimizer step the sharded parameter differs from the "
                f"reference by {param[0]:.2e} (largest value {param[1]:.2e}; {tol}) though the "
                f"gradients agree: the optimizer must update each element on its own (clip with "
                f"fs.optim.clip_by_global_norm on the gradients, not inside update_)"
            )
    return rows, problems


def _costs(
    records: Sequence[dict[str, Any]], estimate: Estimate, optimizer_estimated: bool
) -> tuple[list[CostRow], list[CostRow], list[str]]:
    notes: list[str] = []
    held = [r["held"] for r in records if r["held"] is not None]
    memory: list[CostRow] = []
    if held and len(held) == len(records):
        m = estimate.memory
        predicted = [m.params + m.frozen, m.grads, m.optimizer if optimizer_estimated else None]
        for j, name in enumerate(("params", "grads", "optimizer state")):
            row = CostRow(name, max(h[j] for h in held), predicted[j], exact=True)
            memory.append(row)
            if row.estimated is not None and row.measured != row.estimated:
                notes.append(
                    f"{name}: a rank holds {row.measured:,} bytes where fs.cost.estimate predicts "
                    f"{row.estimated:,}"
                    + (
                        "; pass cost=fs.cost.CostModel(optimizer=...) naming the optimizer verified"
                        if name == "optimizer state"
                        else "; the estimate is exact for sharded state: please report this"
                    )
                )
    peaks = [r["peak"] for r in records if r["peak"] is not None]
    if peaks:
        row = CostRow("gathered (peak)", max(peaks), estimate.memory.gathered, exact=False)
        memory.append(row)
        if row.measured > estimate.memory.gathered:
            notes.append(
                f"gathered parameters peaked at {row.measured:,} bytes on a rank, above the "
                f"estimate of {estimate.memory.gathered:,}: leave more headroom than the estimate"
            )
    sent: list[CostRow] = []
    per_step = [s for r in records for s in r["sent"]]
    if per_step:
        predicted = {f"{op}:{','.join(axes)}": n for (op, axes), n in estimate.comm.items()}
        keys = sorted(set(predicted) | {k for s in per_step for k in s})
        for key in keys:
            measured = max(s.get(key, 0) for s in per_step)
            op, axes = key.split(":")
            row = CostRow(f"{op} over {axes or '-'}", measured, predicted.get(key, 0), exact=True)
            sent.append(row)
            if row.measured != row.estimated:
                notes.append(
                    f"{row.name}: a step sends {row.measured:,} bytes where fs.cost.estimate "
                    f"predicts {row.estimated:,}: loss_fn calls some unit more or less than once "
                    f"per step, or backward passes through a unit with no trained leaf (the "
                    f"estimate and strategy='auto' assume each unit called once, and a unit "
                    f"with no trained leaf called where no gradient reaches it)"
                )
    return memory, sent, notes


def _max_pair(pairs: list[list[float] | None]) -> tuple[float, float] | None:
    """The largest difference and scale over ranks; ``None`` if no rank compared the leaf."""
    given = [p for p in pairs if p is not None]
    if not given:
        return None
    diffs = [p[0] for p in given]
    diff = math.nan if any(math.isnan(d) for d in diffs) else max(diffs)
    return diff, max(p[1] for p in given)


def _close(pair: tuple[float, float], rtol: float, atol: float) -> bool:
    diff, scale = pair
    return diff <= atol + rtol * scale  # False for NaN


def _spread(prints: list[list[float] | None]) -> float:
    """How far any rank's reference fingerprint is from rank 0's, relative to its sum of ``|x|``."""
    given = [p for p in prints if p is not None]
    if len(given) < 2:
        return 0.0
    first = given[0]
    scale = max(max(abs(first[k]) for k in range(1, len(first), 3)), 1e-30)
    worst = max(abs(a - b) for p in given[1:] for a, b in zip(p, first))
    return worst / scale if not math.isnan(worst) else 0.0


def _merged(per_rank: list[list[str]]) -> list[str]:
    """Every rank's problems once each; a problem not on every rank names the ranks that had it."""
    out: list[str] = []
    for message in dict.fromkeys(m for problems in per_rank for m in problems):
        ranks = [r for r, problems in enumerate(per_rank) if message in problems]
        out.append(message if len(ranks) == len(per_rank) else f"rank {ranks}: {message}")
    return out


def _listing(values: list[float]) -> str:
    return ", ".join(f"rank {r}: {v:.8g}" for r, v in enumerate(values))
