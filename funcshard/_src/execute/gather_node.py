"""The autograd node of a call: a gathered unit's full leaves in, all their gradients out at once.

``Run`` (a call's forward) and ``replay.py`` (a recompute in backward) hand a
unit's full leaves to autograd through :class:`GatherNode`. Its backward receives
the gradients of every full leaf of that use of the unit together, and passes
them to the function it was given: ``Run.gathered_grads`` for a call,
``Run.post_backward`` for a replay.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from funcshard._src.execute.call_record import CallRecord

GradsSink = Callable[[CallRecord, Sequence[torch.Tensor | None]], None]


class GatherNode(torch.autograd.Function):
    """``apply(sink, record, dummy)``: ``record``'s unit's full leaves; backward calls ``sink(record, grads)``.

    ``dummy`` is a scalar that requires grad, so that the node is part of the
    graph whatever the leaves are; non-trained leaves are not differentiable.
    """

    @staticmethod
    def forward(
        ctx: Any, sink: GradsSink, record: CallRecord, dummy: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.sink, ctx.record = sink, record
        leaves = record.unit.full_leaves()
        ctx.mark_non_differentiable(
            *(t for t, trained in zip(leaves, record.unit.trained) if not trained)
        )
        return tuple(leaves)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, None, None]:
        ctx.sink(ctx.record, grads)
        return None, None, None
