"""A two-hop unit's partial gradient: its gradients reduced over the last mesh axis, before the others.

[Note: two-hop reductions]
A hybrid_shard_optimizer unit (HFSDP) keeps its partial copy, sharded over the last
mesh axis, for the whole step ([Note: partial copies] in plan/strategy.py); its
gradients are reduced the same way, so that only one reduction a step crosses the
other axes. Each micro-batch packs the unit's gradients with the last axis major
(``unit.partial.order``) and reduce-scatters them over the last axis alone: a rank
gets the sum over its last-axis group of the rows its copy holds, ``copy rows *
numel``, which it adds into a partial gradient in the stored dtype. Once the unit's
last reduction of the step is in (its last call's, in the last micro-batch: ``Run``
says which), the partial gradient is reduce-scattered over the other axes (in the
reduce dtype) while backward goes on; one whose unit was last called in an earlier
micro-batch goes at the step's end, in the order started. Every rank reduces the same
units in the same order, so every rank starts the same second hops in the same order.
The result is the rank's shard of the mean, as one reduce-scatter over every rank
would give, and the two hops send its bytes, (g - 1) / g of the unit, with only
1 / (last axis size) of them across the other axes, once a step. A partial gradient
is alive from its first reduction of the step to its second hop: across micro-batches
every unit's, within one micro-batch (or with ``accumulate="unsharded"``) one unit's at
a time, since a second hop is waited for before the next first hop finishes. Quantized
gradients are quantized on both hops (qgZ's two hops).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from funcshard._src.execute.param_group import ParamGroup
from funcshard._src.execute.unit_state import Part, UnitRuntime


@dataclass
class PartialGradient:
    """A two-hop unit's partial gradient of one part, and who takes it across the other axes; mutable (summed into)."""

    group: ParamGroup
    unit: UnitRuntime
    part: Part
    sums: torch.Tensor  # (copy rows * numel,), in the stored dtype
