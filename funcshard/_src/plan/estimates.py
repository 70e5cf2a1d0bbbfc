"""What a plan costs one rank: bytes held by category, the budget and its reserve, bytes sent, and the step time (data only)."""

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
            ``shard_grad_op``, ``shard_optimizer`` and ``no_shard`` unit (kept from
            forward to backward; ``shard_optimizer`` across micro-batches),
            ``1 + prefetch`` of the largest units freed after forward
            (``full_shard``, ``hybrid_shard``, ``partial_reshard``,
            ``hybrid_shard_optimizer``), one unit's unreduced gradients in the
            compute dtype (all of them with ``accumulate="unsharded"``; every
            ``shard_optimizer`` unit's with several micro-batches), every unit's
            partial copy (``partial_reshard``, ``hybrid_shard_optimizer``), and
            ``hybrid_shard_optimizer`` units' partial gradients in the stored dtype
            (every unit's with several micro-batches, else the largest).
        activations: estimated from the workload (0 without one).
        frozen: sharded frozen parameters as stored (no gradient, no optimizer state).
        buffers: tensors every rank holds whole besides the params (buffers), when
            ``fs.cost.estimate(..., state=...)`` is told them; else 0.
        logits: the logits and the loss, ``tokens * vocab`` in the compute dtype and
            twice in fp32 (0 without a workload, or with ``Workload(logits=False)``).
        staging: the collectives' own buffers, as the executor allocates them: the
            largest all-gather output (``group_size * shard`` elements in the compute
            dtype; none for a unit gathered in place or aliased) and the largest
            reduce-scatter input (``group_size * shard`` in the reduce dtype); one
            reduction is in flight at a time.
    """

    params: int
    grads: int
    optimizer: int
    mixed_precision: int
    gathered: int
    activations: int
    frozen: int = 0
    buffers: int = 0
    logits: int = 0
    staging: int = 0

    @property
    def model_state(self) -> int:
        """The ZeRO paper's model states: everything but :attr:`residual`."""
        return self.total - self.residual

    @property
    def residual(self) -> int:
        """The ZeRO paper's residual states: activations, logits and staging buffers."""
        return self.activations + self.logits + self.staging

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
        budget: the bytes per rank the plan was asked to fit (``None``: not asked).
        reserve: the bytes of ``budget`` kept back for the runtime
            (``fs.cost.CostModel(reserve=...)``); a plan fits in what is left.
        checkpoint_staging: host bytes of ``fs.checkpoint.AsyncCheckpointer``'s staging
            buffers (``CostModel(async_checkpoint=True)``; else 0): this rank's shards of
            the params, frozen params and optimizer state, padding included (at most
            what the buffers hold; equal when every shard is whole). Host memory: not in
            ``memory.total``.
    """

    memory: Memory
    comm: Mapping[Key, int]
    time: StepTime | None = None
    assumptions: tuple[str, ...] = field(default=())
    budget: int | None = None
    reserve: int = 0
    checkpoint_staging: int = 0

    @property
    def usable(self) -> int | None:
        """The budget less the reserve: what the plan may fill (``None`` without a budget)."""
        return None if self.budget is None else self.budget - self.reserve

    @property
    def fits(self) -> bool | None:
        """Whether ``memory.total`` is within :attr:`usable` (``None`` without a budget)."""
        return None if self.usable is None else self.memory.total <= self.usable

    def to_json(self) -> dict[str, Any]:
        """The estimate as JSON-ready data: memory by category and its total, the budget
        (if any: its reserve, what is usable and whether the plan fits), bytes sent by
        ``"op:axes"``, the step time (if estimated) and the assumptions."""
        out: dict[str, Any] = {
            "memory": self.memory.to_json(),
            "total": self.memory.total,
            "model_state": self.memory.model_state,
        }
        if self.budget is not None:
            out |= {
                "budget": self.budget,
                "reserve": self.reserve,
                "usable": self.usable,
                "fits": self.fits,
            }
        if self.checkpoint_staging:
            out["checkpoint_staging"] = self.checkpoint_staging
        out |= {
            "comm": {f"{op}:{'+'.join(axes)}": n for (op, axes), n in sorted(self.comm.items())},
            "assumptions": list(self.assumptions),
        }
        if self.time is not None:
            out["time"] = self.time.to_json()  # with copies, TFLOP/s per device and MFU
        return out
