"""Per-unit strategies within a budget: the best assignment found from every uniform start.

[Note: auto dominates]
``strategy="auto"`` scores every uniform strategy exactly as
``fs.cost.estimate`` would, then searches from each of them: units move one at a time,
first to fit (the move giving up the least step time per byte saved), then while a
move makes the plan faster (ties: less memory). The result is the best of the uniform
plans and every searched one, so it never loses to a fixed strategy that fits, in step
time (bytes sent without a hardware and workload) and then memory.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from funcshard._src.plan.cost_model import CostModel, step_time_under
from funcshard._src.plan.estimates import Key
from funcshard._src.plan.sizes import format_bytes
from funcshard._src.plan.strategy import Strategy
from funcshard._src.plan.unit_cost import UnitCost, memory_of
from funcshard._src.spec.mesh import Mesh

MAX_EVALUATIONS = 20_000  # moves scored per search: bounds a plan with many unlike units
# every strategy, most memory first at one micro-batch (ties: the first wins)
LADDER: tuple[Strategy, ...] = (
    "no_shard",
    "shard_grad_op",
    "shard_optimizer",
    "hybrid_shard",
    "partial_reshard",
    "hybrid_shard_optimizer",
    "full_shard",
)
# the strategies that are another one on a mesh of one axis (full_shard, for these)
SEVERAL_AXES: frozenset[Strategy] = frozenset(
    {"hybrid_shard", "partial_reshard", "hybrid_shard_optimizer"}
)


def ladder(mesh: Mesh, /) -> tuple[Strategy, ...]:
    """The strategies ``strategy="auto"`` considers, most memory first at one micro-batch.

    Ties go to the first: ``shard_optimizer`` equals ``shard_grad_op`` at one
    micro-batch, and wins on bytes sent with several (``CostModel.micro_batches``).
    On a mesh of several axes ``hybrid_shard_optimizer`` sends fewer bytes across the
    other axes than ``partial_reshard`` and holds more (its partial gradients; see
    [Note: partial copies] in ``strategy.py``).

    Example:
        >>> ladder(Mesh({"fsdp": 8}))
        ('no_shard', 'shard_grad_op', 'shard_optimizer', 'full_shard')
        >>> ladder(Mesh({"dp": 2, "fsdp": 8}))[3]
        'hybrid_shard'
    """
    if len(mesh.axis_names) > 1:
        return LADDER
    return tuple(s for s in LADDER if s not in SEVERAL_AXES)


class Score(NamedTuple):
    """What an assignment costs one rank: the fields ``fs.cost.estimate`` would give."""

    fits: bool
    memory: int  # bytes held, activations included
    time: float | None  # step seconds, when the cost model has a workload and hardware
    sent: int  # bytes sent per step

    def rank(self) -> tuple[int, float, float]:
        """Smaller is better: fitting first, then step time (else bytes sent), then memory."""
        primary = float(self.sent) if self.time is None else self.time
        return (0, primary, self.memory) if self.fits else (1, self.memory, primary)

    def describe(self) -> str:
        """``"0.5903 s/step, 55.47 GiB"`` (bytes sent without a time)."""
        head = (
            f"sends {format_bytes(self.sent)}" if self.time is None else f"{self.time:.4g} s/step"
        )
        return f"{head}, {format_bytes(self.memory)}"


@dataclass(frozen=True)
class Context:
    """What a search scores against: the cost model, the usable budget, the activations."""

    model: CostModel
    budget: int
    activations: int
    mesh: Mesh


def score(costs: Sequence[UnitCost], ctx: Context, /) -> Score:
    """The exact score of one assignment, computed as :func:`estimate` computes it."""
    comm: Counter[Key] = Counter()
    for c in costs:
        comm.update(c.comm)
    memory = memory_of(list(costs), ctx.model).total + ctx.activations
    time = step_time_under(
        ctx.model,
        ctx.mesh,
        n_params=sum(c.n_params for c in costs),
        comm=comm,
        sharded_units=sum(1 for c in costs if any(op != "all_reduce" for op, _ in c.comm)),
        state_bytes=sum(c.params + c.grads + c.optimizer + c.mixed_precision for c in costs),
    )
    return Score(
        memory <= ctx.budget, memory, None if time is None else time.step_s, sum(comm.values())
    )


class _Terms(NamedTuple):
    """One unit's share of the sums that :func:`step_time` takes."""

    state: int  # what the optimizer streams
    comm: tuple[tuple[Key, int], ...]
    sharded: int

    @classmethod
    def of(cls, c: UnitCost) -> _Terms:
        return cls(
            c.params + c.grads + c.optimizer + c.mixed_precision,
            tuple(sorted(c.comm.items())),
            int(any(op != "all_reduce" for op, _ in c.comm)),
        )


class Search:
    """Local search over per-unit strategies (see [Note: auto dominates]).

    Memory is :func:`memory_of` over the assignment (it has maxima and a top-k, so it
    is recomputed); communication and the step time's sums are updated per move.
    """

    def __init__(self, per_option: Sequence[Sequence[UnitCost]], ctx: Context, /) -> None:
        self.ctx, self.evaluations = ctx, 0
        self.costs = [list(col) for col in zip(*per_option)]  # [unit][option]
        self.terms = [[_Terms.of(c) for c in row] for row in self.costs]
        self.n_params = sum(c.n_params for c in per_option[0])
        classes: dict[tuple[object, ...], list[int]] = {}
        for i, row in enumerate(self.costs):  # like units are interchangeable: move one of each
            key = tuple(
                repr(dataclasses.replace(c, name="", comm=dict(sorted(c.comm.items()))))
                for c in row
            )
            classes.setdefault(key, []).append(i)
        self.classes = list(classes.values())
        self.choice: list[int] = []
        self.picked: list[UnitCost] = []

    def start(self, choice: Sequence[int], /) -> Score:
        """Makes ``choice`` (an option index per unit) the current assignment; returns its score."""
        self.choice = list(choice)
        self.picked = [self.costs[i][k] for i, k in enumerate(self.choice)]
        picked = [self.terms[i][k] for i, k in enumerate(self.choice)]
        self.state = sum(t.state for t in picked)
        self.sharded = sum(t.sharded for t in picked)
        self.comm: Counter[Key] = Counter()
        for t in picked:
            self.comm.update(dict(t.comm))
        self.current = self.moved(0, self.choice[0])
        return self.current

    def moved(self, i: int, b: int, /) -> Score:
        """The score with unit ``i`` at option ``b`` instead (the assignment is unchanged)."""
        self.evaluations += 1
        old, new = self.terms[i][self.choice[i]], self.terms[i][b]
        comm = dict(self.comm)
        for key, n in old.comm:
            comm[key] -= n
        for key, n in new.comm:
            comm[key] = comm.get(key, 0) + n
        picked = list(self.picked)
        picked[i] = self.costs[i][b]
        memory = memory_of(picked, self.ctx.model).total + self.ctx.activations
        time = step_time_under(
            self.ctx.model,
            self.ctx.mesh,
            n_params=self.n_params,
            comm=comm,
            sharded_units=self.sharded - old.sharded + new.sharded,
            state_bytes=self.state - old.state + new.state,
        )
        return Score(
            memory <= self.ctx.budget,
            memory,
            None if time is None else time.step_s,
            sum(comm.values()),
        )

    def apply(self, i: int, b: int, /) -> None:
        """Moves unit ``i`` to option ``b``."""
        self.choice[i] = b
        self.start(self.choice)

    def moves(self) -> list[tuple[int, int, Score]]:
        """One scored move per class of like units, current option and new option."""
        out: list[tuple[int, int, Score]] = []
        n_options = len(self.costs[0])
        for members in self.classes:
            seen: set[int] = set()
            for i in members:
                a = self.choice[i]
                if a in seen:
                    continue
                seen.add(a)
                out.extend((i, b, self.moved(i, b)) for b in range(n_options) if b != a)
        return out

    def run(self, start: Sequence[int], /) -> tuple[list[int], Score]:
        """From ``start``: moves saving the most memory per second until it fits, then
        the best move while one improves the score; bounded by :data:`MAX_EVALUATIONS`."""
        now = self.start(start)
        while not now.fits and self.evaluations < MAX_EVALUATIONS:
            options = [(i, b, s) for i, b, s in self.moves() if s.memory < now.memory]
            if not options:
                break
            fitting = [m for m in options if m[2].fits]
            if fitting:
                i, b, _ = min(fitting, key=lambda m: m[2].rank())
            else:
                base = now.rank()[2]
                i, b, _ = min(
                    options, key=lambda m: (m[2].rank()[2] - base) / (now.memory - m[2].memory)
                )
            self.apply(i, b)
            now = self.current
        while now.fits and self.evaluations < MAX_EVALUATIONS:
            better = [m for m in self.moves() if m[2].rank() < now.rank()]
            if not better:
                break
            i, b, _ = min(better, key=lambda m: m[2].rank())
            self.apply(i, b)
            now = self.current
        return list(self.choice), now


def assign(
    options: Sequence[Strategy], per_option: Sequence[Sequence[UnitCost]], ctx: Context, /
) -> tuple[list[int], Score, list[tuple[str, Score]]]:
    """The best assignment found (an option index per unit), its exact score, and every
    uniform strategy's score (see [Note: auto dominates])."""
    n = len(per_option[0])
    uniform = [(s, score(per_option[k], ctx)) for k, s in enumerate(options)]
    pool = [([k] * n, s) for k, (_, s) in enumerate(uniform)]
    search = Search(per_option, ctx)
    for k in range(len(options)):
        choice, _ = search.run([k] * n)
        pool.append((choice, score([per_option[c][i] for i, c in enumerate(choice)], ctx)))
    best, best_score = min(pool, key=lambda p: p[1].rank())
    return best, best_score, uniform


def reasons(
    options: Sequence[Strategy],
    per_option: Sequence[Sequence[UnitCost]],
    ctx: Context,
    choice: Sequence[int],
    /,
) -> list[str]:
    """Per unit, why its strategy: what each other strategy for it alone would give."""
    search = Search(per_option, ctx)
    now = search.start(choice)
    goal = "fewest bytes sent" if now.time is None else "fastest step"
    out: list[str] = []
    for i, k in enumerate(choice):
        others: list[str] = []
        best = True
        for b, option in enumerate(options):
            if b == k:
                continue
            s = search.moved(i, b)
            best = best and s.rank() >= now.rank()
            others.append(
                f"{option} exceeds {format_bytes(ctx.budget)}"
                if not s.fits
                else f"{option} {s.describe()}"
            )
        head = f"the {goal} that fits" if best else "the best found by the bounded search"
        out.append(f"{head} ({now.describe()}); " + "; ".join(others))
    return out


__all__ = ["Context", "Score", "Search", "assign", "ladder", "reasons", "score"]
