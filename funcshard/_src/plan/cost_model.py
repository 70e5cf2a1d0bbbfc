"""How a plan will be trained: the optimizer, precision, prefetch, workload and hardware a cost depends on."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, TypeAlias

from funcshard._src.plan.activations import Workload
from funcshard._src.plan.hardware import Hardware
from funcshard._src.plan.precision import MixedPrecision

OptimizerName: TypeAlias = Literal["sgd", "sgd_momentum", "adamw"]
OPTIMIZERS: tuple[OptimizerName, ...] = ("sgd", "sgd_momentum", "adamw")
STATE_COPIES: Mapping[OptimizerName, int] = {"sgd": 0, "sgd_momentum": 1, "adamw": 2}
COUNTER_BYTES = 8  # every optimizer's int64 update counter
# passes over the optimizer's state per update: reads and writes / state copies
# (SGD: read p and g, write p, over 2 copies; with momentum 5 over 3; AdamW 7 over 4)
PASSES: Mapping[OptimizerName, float] = {"sgd": 3 / 2, "sgd_momentum": 5 / 3, "adamw": 7 / 4}


@dataclass(frozen=True)
class CostModel:
    """How a plan will be trained, which decides what it costs.

    Attributes:
        optimizer: ``"sgd"``, ``"sgd_momentum"`` or ``"adamw"`` (state: 0, 1 or 2
            copies of the sharded params, and an int64 counter).
        mixed_precision: gather/compute and reduce dtypes.
        master_weights: model the layout of DeepSpeed and Megatron: params stored in
            a low-precision dtype, the optimizer keeps an fp32 master copy and fp32
            state. funcshard's own optimizers update params in their stored dtype;
            this option is for comparing with those systems.
        prefetch: the executor's prefetch (units gathered ahead).
        accumulate: ``"sharded"`` (reduce every micro-batch) or ``"unsharded"`` (keep
            full gradients until the last micro-batch, as ``step.accumulate`` does).
        workload: batch and model shape, for activations and compute time.
        hardware: for the step-time estimate.

    Example:
        >>> CostModel(optimizer="sgd_momentum", prefetch=2).prefetch
        2
    """

    optimizer: OptimizerName = "adamw"
    mixed_precision: MixedPrecision | None = None
    master_weights: bool = False
    prefetch: int = 1
    accumulate: Literal["sharded", "unsharded"] = "sharded"
    workload: Workload | None = None
    hardware: Hardware | None = None

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"unknown optimizer {self.optimizer!r}; choose one of {list(OPTIMIZERS)}"
            )
        if self.prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {self.prefetch}")
        if self.accumulate not in ("sharded", "unsharded"):
            raise ValueError(
                f"accumulate must be 'sharded' or 'unsharded', got {self.accumulate!r}"
            )


def usable_budget(budget: int, model: CostModel, /) -> int:
    """The bytes of ``budget`` a plan may fill: the budget less what the runtime needs.

    Example:
        >>> usable_budget(1000, CostModel())
        1000
    """
    return budget
