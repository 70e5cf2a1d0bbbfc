"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"), as ``optax.lion``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from funcshard._src import tree
from funcshard._src.optim.base import (
    LearningRate,
    Optimizer,
    check_hyperparameter,
    check_learning_rate,
    floating_flats,
    learning_rate,
    zeros_like_tree,
)
from funcshard._src.optim.select import Mask, decay_, selected_paths


@tree.register_namedtuple  # checkpoints name it in their tree structure
class LionState(NamedTuple):
    """``count`` updates applied so far; the momentum ``mu``, sharded like the params."""

    count: torch.Tensor
    mu: Any


def lion(
    lr: LearningRate,
    betas: tuple[float, float] = (0.9, 0.99),
    weight_decay: float = 1e-3,
    *,
    mask: Mask | None = None,
) -> Optimizer:
    """Lion, whose ``update_`` writes params and state in place, with ``optax.lion``'s numerics.

    Per update: ``p -= lr * (sign(b1 * mu + (1 - b1) * g) + weight_decay * p)``,
    then ``mu = b2 * mu + (1 - b2) * g``. One state buffer (``mu``) per param,
    half of AdamW's; use a learning rate 3-10x smaller than AdamW's.

    Args:
        lr: a learning rate, or a schedule ``lr(count)`` of the number of earlier updates.
        betas: ``(b1, b2)``: the interpolation of the update's sign and the momentum's decay.
        weight_decay: decoupled weight decay.
        mask: the leaves that decay (as in :func:`adamw`); default: every leaf.

    Returns:
        An :class:`Optimizer` whose ``update_`` writes into params and state in place.

    Example:
        >>> import funcshard as fs
        >>> params = {"w": torch.tensor([1.0, -2.0])}
        >>> sparams = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1})))
        >>> opt = lion(lr=0.1, weight_decay=0.0)
        >>> sparams, state = opt.update_(sparams, opt.init(sparams), sparams)  # grads = params
        >>> sparams["w"].local
        tensor([ 0.9000, -1.9000])
    """
    beta1, beta2 = betas
    if not callable(lr):
        check_learning_rate(lr)
    check_hyperparameter("lion: betas[0]", beta1, low=0.0, high=1.0)
    check_hyperparameter("lion: betas[1]", beta2, low=0.0, high=1.0)
    check_hyperparameter("lion: weight_decay", weight_decay, low=0.0)

    def init(sparams: Any, /) -> LionState:
        if mask is not None:
            selected_paths(mask, sparams, what="lion")
        return LionState(torch.zeros((), dtype=torch.int64), zeros_like_tree(sparams))

    def update_(grads: Any, state: LionState, sparams: Any, /) -> tuple[Any, LionState]:
        step_lr = learning_rate(lr, int(state.count))
        params, g, mu = floating_flats(
            sparams, grads, state.mu, names=["params", "grads", "state.mu"], split_by=1
        )
        if not params:  # a mask that leaves no leaf here
            state.count.add_(1)
            return sparams, state
        with torch.no_grad():
            direction = torch._foreach_mul(mu, beta1)
            torch._foreach_add_(direction, g, alpha=1 - beta1)
            torch._foreach_sign_(direction)
            if weight_decay and mask is not None:
                decay_(sparams, mask, 1 - step_lr * weight_decay, what="lion")
            elif weight_decay:
                torch._foreach_mul_(params, 1 - step_lr * weight_decay)
            torch._foreach_add_(params, direction, alpha=-step_lr)
            torch._foreach_mul_(mu, beta2)
            torch._foreach_add_(mu, g, alpha=1 - beta2)
        state.count.add_(1)
        return sparams, state

    return Optimizer(init, update_)
