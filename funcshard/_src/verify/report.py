"""``VerifyReport``: what :func:`funcshard.verify` found, per leaf, and its verdict, as data and as a table."""

from __future__ import annotations

from dataclasses import dataclass

from funcshard._src.plan.sizes import format_bytes, table


@dataclass(frozen=True)
class LeafRow:
    """One leaf: the largest sharded-versus-reference differences over every step and rank.

    Attributes:
        path: the leaf's path.
        unit: the name of its unit.
        spec: its partition spec, as written.
        grad_diff: the largest ``|sharded - reference|`` of its gradient (``None``:
            frozen or integer, no gradient to compare, or no step ran).
        grad_scale: the largest ``|reference gradient|``, which ``grad_diff`` is relative to.
        param_diff: the largest ``|sharded - reference|`` of the parameter after an update.
        param_scale: the largest ``|reference parameter|``.
        ranks_agree: every rank computed the same reference for this leaf.
        ok: within tolerance, and the ranks agree.
    """

    path: str
    unit: str
    spec: str
    grad_diff: float | None
    grad_scale: float | None
    param_diff: float | None
    param_scale: float | None
    ranks_agree: bool
    ok: bool

    @property
    def grad_relative(self) -> float | None:
        """``grad_diff`` relative to the leaf's largest reference gradient."""
        return _relative(self.grad_diff, self.grad_scale)

    @property
    def param_relative(self) -> float | None:
        """``param_diff`` relative to the leaf's largest reference value."""
        return _relative(self.param_diff, self.param_scale)


@dataclass(frozen=True)
class LossRow:
    """One step's loss: the mean over ranks of the sharded losses against the reference's."""

    step: int
    sharded: float
    reference: float

    @property
    def relative(self) -> float:
        """``|sharded - reference|`` relative to ``|reference|``."""
        return abs(self.sharded - self.reference) / max(abs(self.reference), 1e-30)


@dataclass(frozen=True)
class CostRow:
    """A measured figure of one rank against ``fs.cost.estimate``'s (``None``: not estimated)."""

    name: str
    measured: int
    estimated: int | None
    exact: bool  # the estimate is exact for this category (sharded state, bytes sent)


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`funcshard.verify` found: per leaf, per step, memory, bytes sent, and a verdict.

    ``str(report)`` is :meth:`table`. ``ok`` is the verdict: no ``problems``.
    ``notes`` are differences from the cost estimate, which do not fail the verdict.

    Attributes:
        world_size: ranks that ran it.
        steps: optimizer steps compared (fewer than asked if a step failed).
        precision: ``"fp32"`` or the mixed precision, in words.
        rtol: the relative tolerance that the comparisons used.
        atol: the absolute tolerance that the comparisons used.
        leaves: one row per leaf, in tree order.
        losses: one row per step.
        memory: bytes one rank holds (the largest over ranks) against the estimate.
        sent: bytes one rank sends per step, by collective and mesh axes, against the estimate.
        problems: each names the leaf (or step) and a fix; any fails the verdict.
        notes: where the measured cost differs from ``fs.cost.estimate``.
    """

    world_size: int
    steps: int
    precision: str
    rtol: float
    atol: float
    leaves: tuple[LeafRow, ...]
    losses: tuple[LossRow, ...]
    memory: tuple[CostRow, ...]
    sent: tuple[CostRow, ...]
    problems: tuple[str, ...]
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """The verdict: ``True`` when there is no problem."""
        return not self.problems

    def table(self) -> str:
        """The report as plain-text tables: the verdict, losses, leaves, memory, bytes sent, problems."""
        verdict = "PASS" if self.ok else "FAIL"
        lines = [
            f"fs.verify: {verdict}: {self.steps} step(s) on {self.world_size} rank(s), "
            f"{self.precision}, rtol {self.rtol:.0e}, atol {self.atol:.0e}",
        ]
        if self.losses:
            rows = [
                [str(r.step), f"{r.sharded:.6g}", f"{r.reference:.6g}", _num(r.relative)]
                for r in self.losses
            ]
            lines += ["", table(["step", "loss (sharded)", "loss (reference)", "rel. diff"], rows)]
        if self.leaves:
            rows = [
                [
                    r.path or "<root>",
                    r.unit,
                    r.spec,
                    _num(r.grad_diff),
                    _num(r.grad_relative),
                    _num(r.param_diff),
                    _num(r.param_relative),
                    "ok" if r.ok else "FAIL",
                ]
                for r in self.leaves
            ]
            heads = ["leaf", "unit", "spec", "grad diff", "rel.", "param diff", "rel.", ""]
            lines += ["", table(heads, rows)]
        for title, costs in (("memory per rank", self.memory), ("sent per step", self.sent)):
            if costs:
                rows = [
                    [
                        c.name,
                        format_bytes(c.measured),
                        "-" if c.estimated is None else format_bytes(c.estimated),
                        _mark(c),
                    ]
                    for c in costs
                ]
                lines += ["", table([title, "measured", "estimate", ""], rows)]
        for title, items in (("problems", self.problems), ("notes", self.notes)):
            if items:
                lines += ["", f"{title}:"] + [f"- {item}" for item in items]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _relative(diff: float | None, scale: float | None) -> float | None:
    if diff is None or scale is None:
        return None
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def _mark(row: CostRow) -> str:
    if row.estimated is None or row.measured == row.estimated:
        return ""
    if row.exact:
        return "differs"
    return "above the estimate" if row.measured > row.estimated else ""


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"
