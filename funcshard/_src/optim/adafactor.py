"""Adafactor with factored second moments, as ``torch.optim.Adafactor``, on sharded leaves.

[Note: adafactor sums]
Adafactor needs sums over whole leaves: the row and column means of ``g * g``,
the RMS of the parameter (its relative step) and the RMS of the update (its
clipping). A rank holds only its shard of each leaf, so each rank writes its
partial sums into full-size zero vectors at its shard's index
(``sharding.local_index``), only where it holds replica 0 of the leaf (so a
replicated leaf counts once), and one all-reduce over every mesh axis of one
concatenated buffer per phase adds them up: two all-reduces per step, whatever
the number of leaves; none outside a distributed run. The buffers are float64
and hold squares of float norms, which are exact there: where one rank holds
the whole leaf (one process), the sums equal torch's values bit for bit. The
row and column factors are full tensors on every rank (``O(R + C)`` per
matrix); every rank updates them alike from the same sums.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from funcshard._src import tree
from funcshard._src.comm import collectives, groups, runtime, settle
from funcshard._src.optim.adafactor_state import (
    Leaf,
    factor,
    factor_numel,
    leaves_of,
    moment_sums,
    update_moments,
    vector_zeros,
)
from funcshard._src.optim.base import (
    LearningRate,
    Optimizer,
    check_hyperparameter,
    check_learning_rate,
    floating_flats,
    learning_rate,
    refuse_flat,
)
from funcshard._src.shard.sharded import flats_of, trainable

Steps = Generator[torch.Tensor, torch.Tensor, None]  # yields partial sums, receives their totals


@tree.register_namedtuple  # checkpoints name it in their tree structure
class AdafactorState(NamedTuple):
    """``count`` updates so far and the second moments, ``None`` where a leaf has none.

    ``row`` ``(..., R, 1)`` and ``col`` ``(..., 1, C)``: the factors of each leaf of
    two or more dims, full (not sharded) on every rank; ``variance``: the second
    moment of each leaf of fewer dims, sharded like the param.
    """

    count: torch.Tensor
    row: Any
    col: Any
    variance: Any


def adafactor(
    lr: LearningRate = 1e-2,
    beta2_decay: float = -0.8,
    eps: tuple[float | None, float] = (None, 1e-3),
    d: float = 1.0,
    weight_decay: float = 0.0,
    *,
    maximize: bool = False,
) -> Optimizer:
    """Adafactor whose ``update_`` writes params and state in place, with ``torch.optim.Adafactor``'s numerics.

    The numerics are those of torch's default single-tensor implementation
    (``foreach=False``). A leaf of two or more dims keeps its second moment
    factored over its last two dims: a row factor ``(..., R, 1)`` and a column
    factor ``(..., 1, C)``, full on every rank, ``O(R + C)`` memory per matrix
    rather than a shard of it; a leaf of fewer dims keeps a full variance,
    sharded like the param. Each update all-reduces twice over the whole mesh
    (one buffer each, of the row and column sums and one number per leaf), and
    not at all outside a distributed run; see [Note: adafactor sums]. The
    arithmetic runs leaf by leaf, as torch's does (the factors are per matrix).
    Collective: every rank calls ``update_``.

    Args:
        lr: a learning rate, or a schedule ``lr(count)`` of the number of earlier
            updates: the largest relative step ``min(lr, 1 / sqrt(t))`` and the
            weight-decay factor, as in torch.
        beta2_decay: ``1 - beta2_t = t ** beta2_decay`` at update ``t``; <= 0.
        eps: ``(eps1, eps2)``: ``eps1`` bounds the variance estimate from below
            (``None``: the machine epsilon of each leaf's dtype); ``eps2`` bounds
            the parameter RMS that scales the step.
        d: the clipping threshold of the update's RMS; >= 1.
        weight_decay: decoupled weight decay (``p *= 1 - lr * weight_decay``).
        maximize: ascend the gradient instead.

    Returns:
        An :class:`Optimizer` whose ``update_`` writes into params and state in place.

    Raises:
        ValueError: a hyperparameter out of range; the message names it.

    Example:
        >>> import funcshard as fs
        >>> params = {"w": torch.ones(2, 3), "b": torch.ones(3)}
        >>> plan = fs.plan(params, fs.Mesh({"x": 1}))
        >>> sparams = fs.shard(params, plan)
        >>> grads = fs.shard({"w": torch.full((2, 3), 0.5), "b": torch.ones(3)}, plan)
        >>> opt = adafactor(lr=0.1)
        >>> state = opt.init(sparams)
        >>> sparams, state = opt.update_(grads, state, sparams)
        >>> sparams["w"].local
        tensor([[0.9000, 0.9000, 0.9000],
                [0.9000, 0.9000, 0.9000]])
        >>> state.row["w"].shape, state.col["w"].shape, state.variance["b"].local
        (torch.Size([2, 1]), torch.Size([1, 3]), tensor([1., 1., 1.]))
    """
    if not callable(lr):
        check_learning_rate(lr)
    if (
        isinstance(beta2_decay, bool)
        or not isinstance(beta2_decay, (int, float))
        or not -math.inf < beta2_decay <= 0
    ):
        raise ValueError(
            f"adafactor: beta2_decay must be a finite number <= 0, got {beta2_decay!r}"
        )
    if not isinstance(eps, (tuple, list)) or len(eps) != 2:
        raise ValueError(f"adafactor: eps must be a pair (eps1 or None, eps2), got {eps!r}")
    eps1, eps2 = eps
    if eps1 is not None:
        check_hyperparameter("adafactor: eps[0]", eps1, low=0.0)
    check_hyperparameter("adafactor: eps[1]", eps2, low=0.0)
    check_hyperparameter("adafactor: d", d, low=1.0)
    check_hyperparameter("adafactor: weight_decay", weight_decay, low=0.0)
    if not isinstance(maximize, bool):
        raise ValueError(f"adafactor: maximize must be True or False, got {maximize!r}")
    rule = _Adafactor(
        lr,
        float(beta2_decay),
        None if eps1 is None else float(eps1),
        float(eps2),
        float(d),
        float(weight_decay),
        maximize,
    )
    return Optimizer(rule.init, rule.update_)


@dataclass(frozen=True)
class _Adafactor:
    """The hyperparameters (validated by :func:`adafactor`) and the rule."""

    lr: LearningRate
    beta2_decay: float
    eps1: float | None
    eps2: float
    d: float
    weight_decay: float
    maximize: bool

    def init(self, sparams: Any, /) -> AdafactorState:
        live = trainable(sparams)
        refuse_flat(live, "adafactor", "factored moments sum rows and columns of each matrix")
        return AdafactorState(
            torch.zeros((), dtype=torch.int64),
            tree.tree_map(functools.partial(factor, dim=-1), live),
            tree.tree_map(functools.partial(factor, dim=-2), live),
            vector_zeros(live),
        )

    def update_(
        self, grads: Any, state: AdafactorState, sparams: Any, /
    ) -> tuple[Any, AdafactorState]:
        floating_flats(sparams, grads, names=["params", "grads"])  # the same plan, or a clear error
        flats = flats_of(sparams)
        bound = groups.bind(flats[0].layout.mesh) if flats else None

        def over_mesh(partial: torch.Tensor) -> torch.Tensor:
            assert bound is not None
            if runtime.world_size() == 1:
                return collectives.all_reduce(partial, bound, bound.mesh.axis_names).wait()
            return collectives.sum_over_mesh(partial, bound, "adafactor", sums=partial.numel())

        with settle.operation("adafactor"):
            _run(self.steps(grads, state, sparams), over_mesh)
        return sparams, state

    def steps(self, grads: Any, state: AdafactorState, sparams: Any, /) -> Steps:
        """The update as a coroutine: yields each phase's partial sums, receives their totals.

        :meth:`update_` sums them over the mesh; a test can drive one coroutine per
        simulated rank in lockstep. See [Note: adafactor sums].
        """
        leaves = leaves_of(grads, state, sparams)
        count = int(state.count)
        step_lr = learning_rate(self.lr, count)
        t = float(count + 1)
        one_minus_beta2 = t**self.beta2_decay
        rho = min(step_lr, 1 / (t**0.5))
        if leaves:
            device = leaves[0].param.device
            sizes = [
                1 + (factor_numel(leaf.param.shape) if leaf.factored else 0) for leaf in leaves
            ]
            starts = list(itertools.accumulate(sizes, initial=0))
            with torch.no_grad():
                partial = torch.zeros(starts[-1], dtype=torch.float64, device=device)
                for leaf, start, size in zip(leaves, starts, sizes):
                    moment_sums(leaf, partial[start : start + size])
            total = yield partial  # (sum of 1 + B * (R + C) per leaf,)
            with torch.no_grad():
                param_sq = total[starts[:-1]].tolist()
                for leaf, start, size in zip(leaves, starts, sizes):
                    update_moments(leaf, total[start + 1 : start + size], one_minus_beta2)
                zero = torch.zeros((), dtype=torch.float64, device=device)
                partial = torch.stack(
                    [
                        self._update(leaf).norm(2).double().square() if leaf.counted else zero
                        for leaf in leaves
                    ]
                )
            update_sq = (yield partial).tolist()  # (leaves,)
            with torch.no_grad():
                for leaf, p_sq, u_sq in zip(leaves, param_sq, update_sq):
                    root_n = math.prod(leaf.param.shape) ** 0.5
                    alpha = max(self.eps2, math.sqrt(p_sq) / root_n) * rho
                    denom = max(1.0, math.sqrt(u_sq) / (root_n * self.d))
                    # the update again rather than kept: one leaf's temporary at a time
                    update = self._update(leaf)
                    local = leaf.param.local
                    if self.weight_decay != 0:
                        local.mul_(1 - step_lr * self.weight_decay)
                    local.add_(update, alpha=-alpha / denom)
        state.count.add_(1)

    def _update(self, leaf: Leaf, /) -> torch.Tensor:
        """This rank's shard of the update before scaling, in torch's order of operations."""
        grad = leaf.grad.local
        eps1 = self.eps1 if self.eps1 is not None else torch.finfo(leaf.param.dtype).eps
        if leaf.row is not None and leaf.col is not None:
            index = leaf.index
            var = leaf.row[index[:-1]] @ leaf.col[(*index[:-2], slice(None), index[-1])]
            var.div_(leaf.row.mean(dim=-2, keepdim=True).clamp_(min=eps1)[index[:-2]])
        else:
            assert leaf.variance is not None
            var = leaf.variance.local.clone()
        update = var.clamp_(min=eps1 * eps1).rsqrt_()
        return update.mul_(-grad if self.maximize else grad)


def _run(steps: Steps, sum_over_ranks: Callable[[torch.Tensor], torch.Tensor], /) -> None:
    """Drives ``steps`` to the end, answering each partial sum with ``sum_over_ranks`` of it."""
    try:
        partial = next(steps)
        while True:
            partial = steps.send(sum_over_ranks(partial))
    except StopIteration:
        pass
