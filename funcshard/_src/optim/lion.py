"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"), as ``optax.lion``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from funcshard._src import tree
from funcshard._src.optim.base import (
    HostCount,
    LearningRate,
    Optimizer,
    check_hyperparameter,
    device_of,
    floating_flats,
    resolve_betas,
    resolve_learning_rate,
    zeros_like_tree,
)
from funcshard._src.optim.base import learning_rate as rate_at
from funcshard._src.optim.select import Mask, decay_, selected_paths


@tree.register_namedtuple  # checkpoints name it in their tree structure
class LionState(NamedTuple):
    """``count`` updates applied so far; the momentum ``mu``, sharded like the params."""

    count: torch.Tensor
    mu: Any


def lion(
    lr: LearningRate | None = None,
    betas: tuple[float, float] | None = None,
    weight_decay: float = 1e-3,
    *,
    mask: Mask | None = None,
    learning_rate: LearningRate | None = None,
    b1: float | None = None,
    b2: float | None = None,
) -> Optimizer:
    """Lion, whose ``update_`` writes params and state in place, with ``optax.lion``'s numerics.

    Per update: ``p -= lr * (sign(b1 * mu + (1 - b1) * g) + weight_decay * p)``,
    then ``mu = b2 * mu + (1 - b2) * g``. One state buffer (``mu``) per param,
    half of AdamW's; use a learning rate 3-10x smaller than AdamW's.

    Its defaults are optax's (``b1=0.9``, ``b2=0.99``, ``weight_decay=1e-3``), and
    optax's names are accepted for a port (``learning_rate=``, ``b1=``, ``b2=``).

    Args:
        lr: a learning rate, or a schedule ``lr(count)`` of the number of earlier updates
            (``learning_rate=``, optax's name, is the same; give one).
        betas: ``(b1, b2)``: the interpolation of the update's sign and the momentum's decay
            (default ``(0.9, 0.99)``; or optax's ``b1=``, ``b2=``).
        weight_decay: decoupled weight decay.
        mask: the leaves that decay (as in :func:`adamw`); default: every leaf.
        learning_rate: optax's name for ``lr``.
        b1: optax's name for ``betas[0]``.
        b2: optax's name for ``betas[1]``.

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
    lr = resolve_learning_rate("lion", lr, learning_rate)
    betas = resolve_betas("lion", betas, b1, b2, (0.9, 0.99))
    beta1, beta2 = betas
    check_hyperparameter("lion: betas[0]", beta1, low=0.0, high=1.0)
    check_hyperparameter("lion: betas[1]", beta2, low=0.0, high=1.0)
    check_hyperparameter("lion: weight_decay", weight_decay, low=0.0)

    counts = HostCount()  # See [Note: update counts on the device] (base.py)

    def init(sparams: Any, /) -> LionState:
        if mask is not None:
            selected_paths(mask, sparams, what="lion")
        count = counts.made(torch.zeros((), dtype=torch.int64, device=device_of(sparams)))
        return LionState(count, zeros_like_tree(sparams))

    def update_(grads: Any, state: LionState, sparams: Any, /) -> tuple[Any, LionState]:
        count = counts.read(state.count)
        step_lr = rate_at(lr, count)
        params, g, mu = floating_flats(
            sparams, grads, state.mu, names=["params", "grads", "state.mu"], split_by=1
        )
        if not params:  # a mask that leaves no leaf here
            counts.advance_(state.count, count)
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
        counts.advance_(state.count, count)
        return sparams, state

    return Optimizer(init, update_)
