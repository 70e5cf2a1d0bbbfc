"""DeepSpeed's model-state estimators beside funcshard's estimate of the same training.

[Note: DeepSpeed's formulas]
DeepSpeed estimates model-state bytes per GPU without offload as (deepspeed/runtime/zero/
``stage3.py: estimate_zero3_model_states_mem_needs`` and ``stage_1_and_2.py:
estimate_zero2_model_states_mem_needs``, the latter since PR #5099)::

    ZeRO-3: 4 * largest_layer_params + int(18 * total_params / total_gpus)
    ZeRO-2: 2 * total_params         + int(18 * total_params / total_gpus)

``stage_1_and_2.py`` holds one estimator for stages 1 and 2, so ZeRO-1 is compared
with the ZeRO-2 formula, beside ``shard_optimizer``. With one micro-batch
``shard_optimizer`` holds what ``shard_grad_op`` holds (see [Note: shard_optimizer]
in ``plan/strategy.py``); with several (``--micro-batches``) it also keeps every
unit's gradients whole in the reduce dtype until the step's last micro-batch, as
DeepSpeed's stage 1 keeps its fp16 gradients whole, which its estimator leaves out.

for fp16 training with Adam: the 18 partitioned bytes are fp32 params, gradients,
momentum and variance (4 each) and 2 of fp16 params (ZeRO-3) or fp16 gradients
(ZeRO-2); ZeRO-2 keeps the fp16 params whole (2 * P); ZeRO-3 gathers the largest
layer's fp16 params and computes its fp16 gradients (2 + 2 per parameter of one module).
``CostModel(master_weights=True, mixed_precision=MixedPrecision(reduce_dtype=float32),
prefetch=0)`` on fp16 params, one unit per module, is that training: ``full_shard``
is ZeRO-3 and ``shard_grad_op`` ZeRO-2. funcshard splits the same bytes into two
terms, *partitioned* (params + grads + master weights + optimizer state, less its
8-byte step counter) and *gathered*, and :func:`compare` sets each beside the formula's.
Where they differ it is because the layouts do:

- the 8-byte int64 step counter, which DeepSpeed leaves out (always +8);
- ZeRO-2 gathered: funcshard also counts the largest unit's fp16 gradients before their
  reduce-scatter (+2 * largest), which DeepSpeed's ZeRO-3 formula counts and its ZeRO-2
  one does not;
- world size 1: a shard is the whole parameter, so funcshard gathers no copy: ZeRO-3's
  gathered is the largest unit's fp16 gradients alone (2 * largest, not 4 * largest) and
  ZeRO-2's whole fp16 params are the partition itself (gathered 2 * largest, not 2 * P);
  the partitioned 18 * P agree;
- staging: the executor's buffers for the largest all-gather output and reduce-scatter
  input, which DeepSpeed's model states leave out (a term of its own when not 0);
- padding: funcshard's shards are padded to a multiple of the shard group, so the
  partitioned term can exceed ``int(18 * P / N)`` by the padding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from funcshard._src.plan.activations import Workload
from funcshard._src.plan.cost_model import CostModel
from funcshard._src.plan.estimates import Memory
from funcshard._src.plan.hardware import Hardware
from funcshard._src.plan.precision import MixedPrecision
from funcshard._src.plan.sizes import format_bytes

COUNTER = 8  # funcshard's int64 step counter, which DeepSpeed's formulas leave out


def deepspeed_cost_model(
    *, workload: Workload | None = None, hardware: Hardware | None = None
) -> CostModel:
    """DeepSpeed's layout (for fp16 params): fp32 master weights, fp32 Adam, fp32 reduction, no prefetch.

    Example:
        >>> deepspeed_cost_model().master_weights
        True
    """
    return CostModel(
        optimizer="adamw",
        mixed_precision=MixedPrecision(reduce_dtype=torch.float32),
        master_weights=True,
        prefetch=0,
        workload=workload,
        hardware=hardware,
    )


def zero3_model_states(total: int, largest: int, gpus: int, /) -> int:
    """``estimate_zero3_model_states_mem_needs`` without offload (See [Note: DeepSpeed's formulas]).

    Example:
        >>> zero3_model_states(6_738_415_616, 131_072_000, 8) / 2**30
        14.6...
    """
    return 4 * largest + int(18 * total / gpus)


def zero2_model_states(total: int, gpus: int, /) -> int:
    """``estimate_zero2_model_states_mem_needs`` without offload (See [Note: DeepSpeed's formulas]).

    Example:
        >>> zero2_model_states(100, 4)
        650
    """
    return 2 * total + int(18 * total / gpus)


def compare(memory: Mapping[str, Memory], total: int, largest: int, gpus: int, /) -> dict[str, Any]:
    """Each formula's terms beside funcshard's: ``full_shard`` (ZeRO-3), ``shard_grad_op`` (ZeRO-2), ``shard_optimizer`` (ZeRO-1).

    Args:
        memory: funcshard's memory by strategy (those present are compared).
        total: parameters in all. largest: DeepSpeed's ``largest_layer_params``.
        gpus: DeepSpeed's ``total_gpus``, the mesh's size.

    Returns:
        ``{"zero3": {...}, "zero2": {...}, "zero1": {...}}``: per stage the formula, funcshard's
        model states, and each term (partitioned, gathered, counter) of both.
    """
    partitioned = int(18 * total / gpus)
    whole = {"zero3": 4 * largest, "zero2": 2 * total, "zero1": 2 * total}
    out: dict[str, Any] = {
        "world_size": gpus,
        "total_params": total,
        "largest_layer_params": largest,
    }
    for stage, strategy in (
        ("zero3", "full_shard"),
        ("zero2", "shard_grad_op"),
        ("zero1", "shard_optimizer"),
    ):
        if strategy not in memory:
            continue
        m = memory[strategy]
        ours = m.params + m.grads + m.mixed_precision + m.optimizer - COUNTER
        terms = {
            "partitioned": {"deepspeed": partitioned, "funcshard": ours},
            "gathered": {"deepspeed": whole[stage], "funcshard": m.gathered},
            "step counter": {"deepspeed": 0, "funcshard": COUNTER},
        }
        if m.staging:  # collective buffers, which DeepSpeed's model states leave out
            terms["staging"] = {"deepspeed": 0, "funcshard": m.staging}
        out[stage] = {
            "strategy": strategy,
            "deepspeed": whole[stage] + partitioned,
            "funcshard": sum(t["funcshard"] for t in terms.values()),
            "terms": terms,
        }
    return out


def describe(comparison: Mapping[str, Any], /) -> list[str]:
    """The comparison as report lines, one term a line."""
    n = comparison["world_size"]
    lines = [
        f"DeepSpeed's estimators (no offload) on {n} GPU{'s' if n > 1 else ''}, P = "
        f"{comparison['total_params']:,}, largest layer {comparison['largest_layer_params']:,}:"
    ]
    formulas = {
        "zero3": "4*largest + 18*P/N",
        "zero2": "2*P + 18*P/N",
        "zero1": "2*P + 18*P/N (stage_1_and_2.py's one estimator)",
    }
    for stage in ("zero3", "zero2", "zero1"):
        if stage not in comparison:
            continue
        c = comparison[stage]
        diff = c["funcshard"] - c["deepspeed"]
        lines.append(
            f"- ZeRO-{stage[-1]} {formulas[stage]} = {c['deepspeed']:,} B "
            f"({format_bytes(c['deepspeed'])}); {c['strategy']}: {c['funcshard']:,} B "
            f"({'+' if diff >= 0 else '-'}{abs(diff):,} B)"
        )
        for term, t in c["terms"].items():
            d = t["funcshard"] - t["deepspeed"]
            same = "equal" if d == 0 else f"{'+' if d > 0 else '-'}{abs(d):,} B"
            lines.append(
                f"    {term}: DeepSpeed {t['deepspeed']:,}, funcshard {t['funcshard']:,} ({same})"
            )
    return lines
