"""SGD with momentum, Nesterov and weight decay, as ``torch.optim.SGD``."""

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
    resolve_learning_rate,
    zeros_like_tree,
)
from funcshard._src.optim.base import learning_rate as rate_at


@tree.register_namedtuple  # checkpoints name it in their tree structure
class SGDState(NamedTuple):
    """``count`` updates applied so far; ``momentum`` buffers (``None`` without momentum)."""

    count: torch.Tensor
    momentum: Any


def sgd(
    lr: LearningRate | None = None,
    momentum: float | None = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    *,
    learning_rate: LearningRate | None = None,
) -> Optimizer:
    """SGD whose ``update_`` writes params and state in place, with ``torch.optim.SGD``'s numerics (dampening 0).

    Args:
        lr: a learning rate, or a schedule ``lr(count)`` of the number of earlier updates
            (``learning_rate=``, optax's name, is the same; give one).
        momentum: momentum factor (0 for none; optax's ``momentum=None`` is 0 here).
        nesterov: use Nesterov momentum (needs ``momentum > 0``).
        weight_decay: L2 penalty added to the gradient, as ``torch.optim.SGD`` does.
        learning_rate: optax's name for ``lr``.

    Returns:
        An :class:`Optimizer` whose ``update_`` writes into params and state in place.

    Example:
        >>> import funcshard as fs
        >>> params = {"w": torch.ones(2)}
        >>> sparams = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1})))
        >>> opt = sgd(lr=0.5)
        >>> sparams, state = opt.update_(sparams, opt.init(sparams), sparams)  # grads = params
        >>> sparams["w"].local
        tensor([0.5000, 0.5000])
    """
    lr = resolve_learning_rate("sgd", lr, learning_rate)
    momentum = 0.0 if momentum is None else momentum  # optax's "no momentum"
    check_hyperparameter("sgd: momentum", momentum, low=0.0)
    check_hyperparameter("sgd: weight_decay", weight_decay, low=0.0)
    if nesterov and momentum <= 0:
        raise ValueError("sgd: nesterov=True needs momentum > 0")

    counts = HostCount()  # See [Note: update counts on the device] (base.py)

    def init(sparams: Any, /) -> SGDState:
        count = counts.made(torch.zeros((), dtype=torch.int64, device=device_of(sparams)))
        return SGDState(count, zeros_like_tree(sparams) if momentum else None)

    def update_(grads: Any, state: SGDState, sparams: Any, /) -> tuple[Any, SGDState]:
        count = counts.read(state.count)
        step_lr = rate_at(lr, count)
        trees = (sparams, grads, state.momentum) if momentum else (sparams, grads)
        flats = floating_flats(*trees, names=["params", "grads", "state.momentum"], split_by=1)
        params, g = flats[0], flats[1]
        if not params:  # a mask that leaves no leaf here
            counts.advance_(state.count, count)
            return sparams, state
        with torch.no_grad():
            if weight_decay:  # grads are only read: new tensors, as torch.optim.SGD's
                g = torch._foreach_add(g, params, alpha=weight_decay)
            if momentum:
                buf = flats[2]
                torch._foreach_mul_(buf, momentum)
                torch._foreach_add_(buf, g)
                g = torch._foreach_add(g, buf, alpha=momentum) if nesterov else buf
            torch._foreach_add_(params, g, alpha=-step_lr)
        counts.advance_(state.count, count)
        return sparams, state

    return Optimizer(init, update_)
