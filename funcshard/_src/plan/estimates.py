"""What a plan costs one rank: bytes held by category, bytes sent, and the step time (data only)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from funcshard._src.plan.step_time import StepTime

Key = tuple[str, tuple[str, ...]]  # (collective, mesh axes)


@dataclass(frozen=True)
class Memory:
    """Bytes one rank holds, by category. Sharded categories are exact; the others estimates.

    Attributes:
        params: sharded parameters as stored (padding included).
        grads: sharded gradients, in the stored dtype as the executor returns them
            (fp32 with master weights; integer leaves get zeros).
        optimizer: optimizer state (moments and counter; fp32 with master weights).
        mixed_precision: fp32 master copies of low-precision params (``master_weights``).
        gathered: the peak of gathered units alive: the root unit, every
            ``shard_grad_op`` unit (kept from forward to backward), ``1 + prefetch``
            of the largest other units, and one unit's unreduced gradients in the
            compute dtype (all of them with ``accumulate="unsharded"``).
        activations: estimated from the workload (0 without one).
        frozen: sharded frozen parameters as stored (no gradient, no optimizer state).
        buffers: tensors every rank holds whole besides the params (buffers), when
            ``fs.cost.estimate(..., state=...)`` is told them; else 0.
    """

    params: int
    grads: int
    optimizer: int
    mixed_precision: int
    gathered: int
    activations: int
    frozen: int = 0
    buffers: int = 0

    @property
    def model_state(self) -> int:
        """Everything but activations."""
        return self.total - self.activations

    @property
    def total(self) -> int:
        """The sum of every category."""
        return sum(getattr(self, f.name) for f in fields(self))

    def rows(self) -> list[tuple[str, int]]:
        """``[(category, bytes), ...]`` in a fixed order, for tables."""
        return [(f.name.replace("_", " "), getattr(self, f.name)) for f in fields(self)]

    def to_json(self) -> dict[str, int]:
        """Every category by its field name, as JSON output shows it."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Estimate:
    """What a plan costs one rank per step.

    Attributes:
        memory: bytes held, by category.
        comm: bytes sent per step by ``(op, mesh axes)`` (equals the ledger).
        time: the step-time estimate (``None`` without a workload and hardware).
        assumptions: what the estimate assumes, in words.
    """

    memory: Memory
    comm: Mapping[Key, int]
    time: StepTime | None = None
    assumptions: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        """The estimate as JSON-ready data: memory by category and its total, bytes sent by
        ``"op:axes"``, the step time (if estimated) and the assumptions."""
        out: dict[str, Any] = {
            "memory": self.memory.to_json(),
            "total": self.memory.total,
            "comm": {f"{op}:{'+'.join(axes)}": n for (op, axes), n in sorted(self.comm.items())},
            "assumptions": list(self.assumptions),
        }
        if self.time is not None:
            t = self.time
            out["time"] = {
                "step_s": t.step_s,
                "compute_s": t.compute_s,
                "comm_s": t.comm_s,
                "exposed_comm_s": t.exposed_comm_s,
                "optimizer_s": t.optimizer_s,
                "tokens_per_s": t.tokens_per_s,
            }
        return out
