"""AdamW with decoupled weight decay, as ``torch.optim.AdamW``."""

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
class AdamWState(NamedTuple):
    """``count`` updates applied so far; first (``mu``) and second (``nu``) moments, sharded like the params."""

    count: torch.Tensor
    mu: Any
    nu: Any


def adamw(
    lr: LearningRate,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    *,
    mask: Mask | None = None,
    fused: bool = True,
) -> Optimizer:
    """AdamW whose ``update_`` writes params and state in place, with ``torch.optim.AdamW``'s numerics.

    One pass over all flat buffers at once.

    Args:
        lr: a learning rate, or a schedule ``lr(count)`` of the number of earlier updates.
        betas: decay rates of the first and second moments.
        eps: added to the denominator.
        weight_decay: decoupled weight decay (``p -= lr * weight_decay * p``).
        mask: the leaves that decay (a function ``(path, leaf) -> bool``, path
            patterns or a tree of bools; e.g. :func:`decay_mask_default`: not
            biases, norms or embeddings); default: every leaf, as ``torch.optim.AdamW``.
            Equal to ``torch.optim.AdamW`` with two parameter groups, one with
            ``weight_decay=0``.
        fused: one fused kernel per dtype (``torch.optim.AdamW(fused=True)``'s numerics:
            one pass over memory, no temporaries); ``False`` runs foreach ops with the
            numerics of ``torch.optim.AdamW``'s default implementation.

    Returns:
        An :class:`Optimizer` whose ``update_`` writes into params and state in place.

    Example:
        >>> import funcshard as fs
        >>> params = {"w": torch.ones(2)}
        >>> sparams = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1})))
        >>> opt = adamw(lr=0.1, weight_decay=0.0)
        >>> sparams, state = opt.update_(sparams, opt.init(sparams), sparams)  # grads = params
        >>> sparams["w"].local
        tensor([0.9000, 0.9000])
    """
    beta1, beta2 = betas
    if not callable(lr):
        check_learning_rate(lr)
    check_hyperparameter("adamw: betas[0]", beta1, low=0.0, high=1.0)
    check_hyperparameter("adamw: betas[1]", beta2, low=0.0, high=1.0)
    check_hyperparameter("adamw: eps", eps, low=0.0)
    check_hyperparameter("adamw: weight_decay", weight_decay, low=0.0)

    def init(sparams: Any, /) -> AdamWState:
        if mask is not None:
            selected_paths(mask, sparams, what="adamw")  # a bad mask fails here, not mid-run
        return AdamWState(
            torch.zeros((), dtype=torch.int64), zeros_like_tree(sparams), zeros_like_tree(sparams)
        )

    def update_(grads: Any, state: AdamWState, sparams: Any, /) -> tuple[Any, AdamWState]:
        count = int(state.count)
        step_lr = learning_rate(lr, count)
        params, g, mu, nu = floating_flats(
            sparams,
            grads,
            state.mu,
            state.nu,
            names=["params", "grads", "state.mu", "state.nu"],
            split_by=1,
        )
        if not params:  # a mask that leaves no leaf here
            state.count.add_(1)
            return sparams, state
        t = count + 1
        decay = weight_decay
        if mask is not None and weight_decay:  # decay the selected leaves first, as torch does
            decay_(sparams, mask, 1 - step_lr * weight_decay, what="adamw")
            decay = 0.0
        if fused:
            _fused_update(
                params, g, mu, nu, t, lr=step_lr, betas=betas, eps=eps, weight_decay=decay
            )
            state.count.add_(1)
            return sparams, state
        bias_correction1 = 1 - beta1**t
        bias_correction2 = 1 - beta2**t
        with torch.no_grad():
            # the order of operations of torch.optim.AdamW, for equal numerics
            if decay:
                torch._foreach_mul_(params, 1 - step_lr * decay)
            torch._foreach_lerp_(mu, g, 1 - beta1)
            torch._foreach_mul_(nu, beta2)
            torch._foreach_addcmul_(nu, g, g, 1 - beta2)
            denom = torch._foreach_sqrt(nu)
            torch._foreach_div_(denom, bias_correction2**0.5)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(params, mu, denom, -(step_lr / bias_correction1))
        state.count.add_(1)
        return sparams, state

    return Optimizer(init, update_)


def _fused_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    mu: list[torch.Tensor],
    nu: list[torch.Tensor],
    step: int,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """``torch._fused_adamw_`` over the flat buffers, one call per (device, dtype) group; mutates them."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.device, p.dtype), []).append(i)
    for (device, _), members in groups.items():
        steps = [torch.tensor(float(step), device=device)] * len(members)
        with torch.no_grad():
            torch._fused_adamw_(
                [params[i] for i in members],
                [grads[i] for i in members],
                [mu[i] for i in members],
                [nu[i] for i in members],
                [],
                steps,
                amsgrad=False,
                lr=lr,
                beta1=betas[0],
                beta2=betas[1],
                weight_decay=weight_decay,
                eps=eps,
                maximize=False,
                grad_scale=None,
                found_inf=None,
            )
