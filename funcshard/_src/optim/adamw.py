"""AdamW with decoupled weight decay, as ``torch.optim.AdamW``."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from funcshard._src import tree
from funcshard._src.optim.base import (
    HostCount,
    LearningRate,
    Optimizer,
    can_skip_on_device,
    check_hyperparameter,
    device_of,
    floating_flats,
    resolve_betas,
    resolve_learning_rate,
    skip_flag,
    zeros_like_tree,
)
from funcshard._src.optim.base import learning_rate as rate_at
from funcshard._src.optim.select import Mask, decay_, selected_paths


@tree.register_namedtuple  # checkpoints name it in their tree structure
class AdamWState(NamedTuple):
    """``count`` updates applied so far; first (``mu``) and second (``nu``) moments, sharded like the params."""

    count: torch.Tensor
    mu: Any
    nu: Any


def adamw(
    lr: LearningRate | None = None,
    betas: tuple[float, float] | None = None,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    *,
    mask: Mask | None = None,
    fused: bool = True,
    learning_rate: LearningRate | None = None,
    b1: float | None = None,
    b2: float | None = None,
    eps_root: float = 0.0,
    mu_dtype: object = None,
    nesterov: bool = False,
) -> Optimizer:
    """AdamW whose ``update_`` writes params and state in place, with ``torch.optim.AdamW``'s numerics.

    One pass over all flat buffers at once. optax's names are accepted for a
    port from optax (``learning_rate=``, ``b1=``, ``b2=``; ``eps``,
    ``weight_decay`` and ``mask`` are the same names), but **the default weight
    decay is torch's 0.01, not optax's 1e-4**: a port from
    ``optax.adamw(learning_rate)`` passes ``weight_decay=1e-4`` to keep its decay.
    Every other default equals both torch's and optax's (``b1=0.9``,
    ``b2=0.999``, ``eps=1e-8``, ``eps_root=0``, no mask, no Nesterov). The
    updates equal optax's to rounding in float64 (tests/interop/test_optax_optim.py).

    The update count stays on the params' device and no update reads it back
    (see [Note: update counts on the device] in ``base.py``).

    Args:
        lr: a learning rate, or a schedule ``lr(count)`` of the number of earlier updates
            (``learning_rate=``, optax's name, is the same; give one).
        betas: decay rates ``(b1, b2)`` of the first and second moments
            (default ``(0.9, 0.999)``; or optax's ``b1=``, ``b2=``).
        eps: added to the denominator (1e-8, as torch and optax).
        weight_decay: decoupled weight decay (``p -= lr * weight_decay * p``); default
            0.01 as ``torch.optim.AdamW`` (``optax.adamw``'s is 1e-4).
        mask: the leaves that decay (a function ``(path, leaf) -> bool``, path
            patterns or a tree of bools; e.g. :func:`decay_mask_default`: not
            biases, norms or embeddings); default: every leaf, as ``torch.optim.AdamW``
            and ``optax.adamw``. Equal to ``torch.optim.AdamW`` with two parameter
            groups, one with ``weight_decay=0``, and to optax's ``mask``.
        fused: one fused kernel per dtype (``torch.optim.AdamW(fused=True)``'s numerics:
            one pass over memory, no temporaries); ``False`` runs foreach ops with the
            numerics of ``torch.optim.AdamW``'s default implementation.
        learning_rate: optax's name for ``lr``.
        b1: optax's name for ``betas[0]``.
        b2: optax's name for ``betas[1]``.
        eps_root: optax's epsilon inside the square root; only its default, 0, is supported.
        mu_dtype: optax's dtype of the first moment; only its default, ``None`` (the
            params' dtype), is supported.
        nesterov: optax's Nesterov variant; only its default, ``False``, is supported.

    Returns:
        An :class:`Optimizer` whose ``update_`` writes into params and state in place.

    Raises:
        TypeError: the learning rate or the decay rates given in both spellings, or not at all.
        ValueError: a hyperparameter out of range, or an optax option funcshard does not support.

    Example:
        >>> import funcshard as fs
        >>> params = {"w": torch.ones(2)}
        >>> sparams = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1})))
        >>> opt = adamw(lr=0.1, weight_decay=0.0)
        >>> sparams, state = opt.update_(sparams, opt.init(sparams), sparams)  # grads = params
        >>> sparams["w"].local
        tensor([0.9000, 0.9000])
    """
    lr = resolve_learning_rate("adamw", lr, learning_rate)
    betas = resolve_betas("adamw", betas, b1, b2, (0.9, 0.999))
    _refuse_unsupported(eps_root=eps_root, mu_dtype=mu_dtype, nesterov=nesterov)
    beta1, beta2 = betas
    check_hyperparameter("adamw: betas[0]", beta1, low=0.0, high=1.0)
    check_hyperparameter("adamw: betas[1]", beta2, low=0.0, high=1.0)
    check_hyperparameter("adamw: eps", eps, low=0.0)
    check_hyperparameter("adamw: weight_decay", weight_decay, low=0.0)

    counts = HostCount()  # See [Note: update counts on the device] (base.py)

    def init(sparams: Any, /) -> AdamWState:
        if mask is not None:
            selected_paths(mask, sparams, what="adamw")  # a bad mask fails here, not mid-run
        count = counts.made(torch.zeros((), dtype=torch.int64, device=device_of(sparams)))
        return AdamWState(count, zeros_like_tree(sparams), zeros_like_tree(sparams))

    def _flats(grads: Any, state: AdamWState, sparams: Any) -> list[list[torch.Tensor]]:
        """The floating flat buffers the update reads and writes: params, grads, mu, nu."""
        return floating_flats(
            sparams,
            grads,
            state.mu,
            state.nu,
            names=["params", "grads", "state.mu", "state.nu"],
            split_by=1,
        )

    def update_(grads: Any, state: AdamWState, sparams: Any, /) -> tuple[Any, AdamWState]:
        skip = skip_flag() if on_device else None
        if skip is not None:  # See [Note: skipping on the device] (base.py)
            return _skippable_update(grads, state, sparams, skip)
        count = counts.read(state.count)
        step_lr = rate_at(lr, count)
        params, g, mu, nu = _flats(grads, state, sparams)
        if not params:  # a mask that leaves no leaf here
            counts.advance_(state.count, count)
            return sparams, state
        t = count + 1
        decay = weight_decay
        if mask is not None and weight_decay:  # decay the selected leaves first, as torch does
            decay_(sparams, mask, 1 - step_lr * weight_decay, what="adamw")
            decay = 0.0
        if fused:
            counts.advance_(state.count, count)  # the kernel reads t from the tensor, on the device
            _fused_update(
                params, g, mu, nu, state.count, lr=step_lr, betas=betas, eps=eps, weight_decay=decay
            )
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
        counts.advance_(state.count, count)
        return sparams, state

    def _skippable_update(
        grads: Any, state: AdamWState, sparams: Any, skip: torch.Tensor
    ) -> tuple[Any, AdamWState]:
        """The fused update with a constant rate, left undone where ``skip`` is 1: no host read."""
        params, g, mu, nu = _flats(grads, state, sparams)
        state.count.add_((1 - skip).to(state.count.device, state.count.dtype))
        counts.forget()  # advanced by a value the host does not know
        if params:
            step_lr = float(lr)  # type: ignore[arg-type]  # constant: see on_device
            _fused_update(
                params,
                g,
                mu,
                nu,
                state.count,
                lr=step_lr,
                betas=betas,
                eps=eps,
                weight_decay=weight_decay,
                found_inf=skip,
            )
        return sparams, state

    # the fused kernel skips on the device (found_inf) and needs no count on the host
    # when the rate is constant; a mask's decay runs outside the kernel
    on_device = fused and not callable(lr) and (mask is None or not weight_decay)
    return Optimizer(init, can_skip_on_device(update_) if on_device else update_)


def _fused_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    mu: list[torch.Tensor],
    nu: list[torch.Tensor],
    step: torch.Tensor,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    found_inf: torch.Tensor | None = None,
) -> None:
    """``torch._fused_adamw_`` over the flat buffers, one call per (device, dtype) group; mutates them.

    ``step`` is the 0-d count of updates including this one; the kernel reads it as
    float32 on each group's device, as ``torch.optim.AdamW`` keeps its ``step``.
    Where ``found_inf`` (a 0-d float32) is 1, the kernel leaves everything as it was.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.device, p.dtype), []).append(i)
    for (device, _), members in groups.items():
        steps = [step.to(device=device, dtype=torch.float32)] * len(members)
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
                found_inf=None if found_inf is None else found_inf.to(device),
            )


def _refuse_unsupported(*, eps_root: float, mu_dtype: object, nesterov: bool) -> None:
    """Refuses optax options that change optax's AdamW in ways funcshard's does not implement."""
    if eps_root != 0.0:
        raise ValueError(
            f"adamw: eps_root={eps_root!r} (optax's epsilon inside the square root) is not "
            f"supported; leave it at 0.0, optax's default, and use eps"
        )
    if mu_dtype is not None:
        raise ValueError(
            f"adamw: mu_dtype={mu_dtype!r} is not supported; the moments take the params' dtype "
            f"(optax's default, mu_dtype=None)"
        )
    if nesterov:
        raise ValueError(
            "adamw: nesterov=True (optax's NAdamW) is not supported; use "
            "fs.optim.from_torch(torch.optim.NAdam, decoupled_weight_decay=True, ...)"
        )
