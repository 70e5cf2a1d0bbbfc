"""How a plan will be trained: the optimizer, precision, prefetch, workload and hardware a cost depends on."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, TypeAlias

from funcshard._src.plan.activations import Workload
from funcshard._src.plan.hardware import Hardware
from funcshard._src.plan.precision import MixedPrecision
from funcshard._src.plan.quantize import Quantized
from funcshard._src.plan.sizes import format_bytes, parse_bytes
from funcshard._src.plan.step_time import StepTime, step_time
from funcshard._src.spec.mesh import Mesh

OptimizerName: TypeAlias = Literal["sgd", "sgd_momentum", "adamw"]
OPTIMIZERS: tuple[OptimizerName, ...] = ("sgd", "sgd_momentum", "adamw")
STATE_COPIES: Mapping[OptimizerName, int] = {"sgd": 0, "sgd_momentum": 1, "adamw": 2}
COUNTER_BYTES = 8  # every optimizer's int64 update counter
# passes over the optimizer's state per update: reads and writes / state copies
# (SGD: read p and g, write p, over 2 copies; with momentum 5 over 3; AdamW 7 over 4)
PASSES: Mapping[OptimizerName, float] = {"sgd": 3 / 2, "sgd_momentum": 5 / 3, "adamw": 7 / 4}


@dataclass(frozen=True)
class Reserve:
    """Device memory a plan leaves free for the runtime: ``fraction`` of the budget plus ``fixed`` bytes.

    What it stands for is not the plan's: the CUDA context and its libraries (about
    0.3 to 1 GiB per process, more with cuDNN/cuBLAS workspaces), NCCL's
    communicator buffers (a few MiB per channel and peer, per process group) and the
    caching allocator's fragmentation (grows with the memory in use). ``Reserve()``
    reserves nothing. See :func:`usable_budget` for the default.

    Attributes:
        fraction: of the budget, in ``[0, 1)``.
        fixed: bytes, or a size such as ``"1GiB"`` (stored as bytes).

    Example:
        >>> r = Reserve(fraction=0.05, fixed="1GiB")
        >>> r.fixed, r.bytes_of(80 * 2**30) == 5 * 2**30
        (1073741824, True)
    """

    fraction: float = 0.0
    fixed: int | str = 0

    def __post_init__(self) -> None:
        if not 0 <= self.fraction < 1:
            raise ValueError(f"Reserve.fraction must be in [0, 1), got {self.fraction!r}")
        fixed = self.fixed if isinstance(self.fixed, int) else parse_bytes(self.fixed)
        if fixed < 0:
            raise ValueError(f"Reserve.fixed must be >= 0 bytes, got {self.fixed!r}")
        object.__setattr__(self, "fixed", fixed)

    def bytes_of(self, budget: int, /) -> int:
        """The bytes reserved out of ``budget`` (never more than ``budget``)."""
        return min(budget, math.ceil(self.fraction * budget) + int(self.fixed))

    def describe(self) -> str:
        """In words, for reports: ``"5% + 1.00 GiB"``."""
        parts = [f"{self.fraction * 100:g}%"] if self.fraction else []
        parts += [format_bytes(int(self.fixed))] if self.fixed else []
        return " + ".join(parts) or "none"


# See [Note: default reserve]
DEFAULT_RESERVE = Reserve(fraction=0.05, fixed="1GiB")

# [Note: default reserve]
# Without CostModel(reserve=...), a budget keeps back 5 % of itself plus 1 GiB: the CUDA
# context (about 0.3-1 GiB per process on recent GPUs), NCCL's buffers (a few hundred MiB
# over several process groups) and the caching allocator's fragmentation (commonly 5-10 % of
# what is allocated). On an 80 GiB device that is 5 GiB, a plan may fill 75 GiB (93.75 %).
# The default never takes more than half of what the budget has beyond the fixed 1 GiB,
# so a budget of at most 1 GiB (every CPU test's KiB-sized budget, a slice of a device)
# reserves nothing, a 2 GiB one 0.5 GiB, and from 3.34 GiB on the full 5 % + 1 GiB apply;
# the usable budget grows with the budget everywhere (slope >= 1/2), so a larger budget
# never allows less. An explicit Reserve is taken as given, at any budget.


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
        micro_batches: micro-batches per optimizer step (``step.accumulate``'s
            count). Bytes sent are per optimizer step: a ``full_shard`` unit gathers
            twice per micro-batch, a ``shard_grad_op`` unit once, a ``shard_optimizer``
            unit once per step; a ``partial_reshard`` unit gathers from its shards once
            per micro-batch and a ``hybrid_shard_optimizer`` unit once per step, their
            other gathers re-gathering a partial copy over the last axis; reductions run
            once per micro-batch with ``accumulate="sharded"`` (once per step for
            ``shard_optimizer`` units), else once per step, and a
            ``hybrid_shard_optimizer`` unit's cross the other axes once per step.
            Compute time scales with it.
        workload: batch and model shape, for activations and compute time.
        hardware: for the step-time estimate.
        reserve: device memory kept back from every budget for the runtime
            (:class:`Reserve`); ``None`` is the default, 5 % + 1 GiB on device-sized
            budgets (see :func:`usable_budget`); ``Reserve()`` keeps nothing back.
        backend: the collective backend of the run, ``"nccl"`` or ``"gloo"``: on
            gloo over two ranks the executor gathers a part whose every leaf splits
            evenly on dim 0 leaf by leaf, straight into its storage, with no staging
            buffer (``memory.staging``).
        buffers: bytes every rank holds whole besides the params (an
            ``nn.Module``'s buffers, ``apply.state``), for planning;
            ``fs.cost.estimate(..., state=...)`` counts them from the tensors instead.
        quantize: block-quantized int8 collectives for the units it names, as
            ``fs.value_and_grad(..., quantize=...)`` runs them ([Note: quantized
            collectives] in ``quantize.py``): bytes sent and staging counted as sent.
        async_checkpoint: checkpoints are saved with ``fs.checkpoint.AsyncCheckpointer``,
            whose host staging buffers hold a copy of this rank's params, frozen params
            and optimizer state (``Estimate.checkpoint_staging``; host memory, not
            counted in ``memory.total``).

    Example:
        >>> CostModel(optimizer="sgd_momentum", prefetch=2).prefetch
        2
    """

    optimizer: OptimizerName = "adamw"
    mixed_precision: MixedPrecision | None = None
    master_weights: bool = False
    prefetch: int = 1
    accumulate: Literal["sharded", "unsharded"] = "sharded"
    micro_batches: int = 1
    workload: Workload | None = None
    hardware: Hardware | None = None
    reserve: Reserve | None = None
    buffers: int = 0
    backend: Literal["nccl", "gloo"] = "nccl"
    async_checkpoint: bool = False
    quantize: Quantized | None = None

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"unknown optimizer {self.optimizer!r}; choose one of {list(OPTIMIZERS)}"
            )
        if self.prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {self.prefetch}")
        if self.quantize is not None and not isinstance(self.quantize, Quantized):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise TypeError(
                f"CostModel.quantize must be a Quantized(...) or None, got {self.quantize!r}"
            )
        if self.accumulate not in ("sharded", "unsharded"):
            raise ValueError(
                f"accumulate must be 'sharded' or 'unsharded', got {self.accumulate!r}"
            )
        if (
            isinstance(self.micro_batches, bool)
            or not isinstance(self.micro_batches, int)  # pyright: ignore[reportUnnecessaryIsInstance]
            or self.micro_batches < 1
        ):
            raise ValueError(
                f"CostModel.micro_batches must be an int >= 1 (micro-batches per optimizer "
                f"step), got {self.micro_batches!r}"
            )
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"CostModel.backend must be 'nccl' or 'gloo', got {self.backend!r}")
        if self.buffers < 0:
            raise ValueError(f"CostModel.buffers must be >= 0 bytes, got {self.buffers}")
        if not isinstance(self.async_checkpoint, bool):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise TypeError(
                f"CostModel.async_checkpoint must be True or False, got {self.async_checkpoint!r}"
            )
        if self.reserve is not None and not isinstance(self.reserve, Reserve):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise TypeError(
                f"CostModel.reserve must be a fs.cost.Reserve or None, got {self.reserve!r}"
            )


def reserve_bytes(budget: int, model: CostModel, /) -> int:
    """The bytes of ``budget`` kept back for the runtime under ``model``.

    ``model.reserve`` when given; else 5 % of the budget plus 1 GiB, at most half of
    what the budget has beyond 1 GiB (see [Note: default reserve]).

    Example:
        >>> GiB = 2**30
        >>> [reserve_bytes(b, CostModel()) / GiB for b in (1 * GiB, 2 * GiB, 80 * GiB)]
        [0.0, 0.5, 5.0]
        >>> reserve_bytes(1000, CostModel(reserve=Reserve(fraction=0.1)))
        100
    """
    if model.reserve is not None:
        return model.reserve.bytes_of(budget)
    cap = max(0, budget - int(DEFAULT_RESERVE.fixed)) // 2
    return min(DEFAULT_RESERVE.bytes_of(budget), cap)


def describe_reserve(model: CostModel, /) -> str:
    """How ``model`` reserves, in words, for reports."""
    if model.reserve is not None:
        return model.reserve.describe()
    return f"default {DEFAULT_RESERVE.describe()}, at most half the budget beyond {format_bytes(int(DEFAULT_RESERVE.fixed))}"


def usable_budget(budget: int, model: CostModel, /) -> int:
    """The bytes of ``budget`` a plan may fill: the budget less :func:`reserve_bytes`.

    Example:
        >>> usable_budget(1000, CostModel())  # a tiny budget: the default reserves nothing
        1000
        >>> usable_budget(80 * 2**30, CostModel()) / 2**30
        75.0
    """
    return budget - reserve_bytes(budget, model)


def step_time_under(
    model: CostModel,
    mesh: Mesh,
    /,
    *,
    n_params: int,
    comm: Mapping[tuple[str, tuple[str, ...]], int],
    sharded_units: int,
    state_bytes: int,
) -> StepTime | None:
    """:func:`step_time` with ``model``'s workload, hardware, prefetch, optimizer and micro-batches.

    ``None`` where ``model`` has no workload or no hardware.

    Example:
        >>> step_time_under(CostModel(), Mesh({"fsdp": 8}), n_params=10**9, comm={},
        ...     sharded_units=0, state_bytes=0) is None
        True
    """
    if model.workload is None or model.hardware is None:
        return None
    return step_time(
        n_params=n_params,
        comm=comm,
        mesh=mesh,
        workload=model.workload,
        hardware=model.hardware,
        prefetch=model.prefetch,
        sharded_units=sharded_units,
        state_bytes=state_bytes,
        optimizer_passes=PASSES[model.optimizer],
        micro_batches=model.micro_batches,
    )
