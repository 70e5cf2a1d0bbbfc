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
from funcshard._src.comm import collectives, groups, settle
from funcshard._src.optim.base import (
    LearningRate,
    Optimizer,
    check_hyperparameter,
    check_learning_rate,
    floating_flats,
    learning_rate,
    refuse_flat,
)
from funcshard._src.shard.flat import FlatLayout, Slot
from funcshard._src.shard.sharded import FlatShard, ShardedTensor, flats_of, trainable
from funcshard._src.spec.named_sharding import Index, NamedSharding

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


class _Leaf(NamedTuple):
    """One trainable floating leaf and its state, as one rank sees them."""

    param: ShardedTensor
    grad: ShardedTensor
    row: torch.Tensor | None  # (..., R, 1), full
    col: torch.Tensor | None  # (..., 1, C), full
    variance: ShardedTensor | None
    index: Index  # this rank's slices of the leaf
    counted: bool  # replica 0: its partial sums count

    @property
    def factored(self) -> bool:
        return self.row is not None


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
            tree.tree_map(functools.partial(_factor, dim=-1), live),
            tree.tree_map(functools.partial(_factor, dim=-2), live),
            _vector_zeros(live),
        )

    def update_(
        self, grads: Any, state: AdafactorState, sparams: Any, /
    ) -> tuple[Any, AdafactorState]:
        floating_flats(sparams, grads, names=["params", "grads"])  # the same plan, or a clear error
        flats = flats_of(sparams)
        bound = groups.bind(flats[0].layout.mesh) if flats else None

        def over_mesh(partial: torch.Tensor) -> torch.Tensor:
            assert bound is not None
            return collectives.all_reduce(partial, bound, bound.mesh.axis_names).wait()

        with settle.operation("adafactor"):
            _run(self.steps(grads, state, sparams), over_mesh)
        return sparams, state

    def steps(self, grads: Any, state: AdafactorState, sparams: Any, /) -> Steps:
        """The update as a coroutine: yields each phase's partial sums, receives their totals.

        :meth:`update_` sums them over the mesh; a test can drive one coroutine per
        simulated rank in lockstep. See [Note: adafactor sums].
        """
        leaves = _leaves(grads, state, sparams)
        count = int(state.count)
        step_lr = learning_rate(self.lr, count)
        t = float(count + 1)
        one_minus_beta2 = t**self.beta2_decay
        rho = min(step_lr, 1 / (t**0.5))
        if leaves:
            device = leaves[0].param.device
            sizes = [
                1 + (_factor_numel(leaf.param.shape) if leaf.factored else 0) for leaf in leaves
            ]
            starts = list(itertools.accumulate(sizes, initial=0))
            with torch.no_grad():
                partial = torch.zeros(starts[-1], dtype=torch.float64, device=device)
                for leaf, start, size in zip(leaves, starts, sizes):
                    _moment_sums(leaf, partial[start : start + size])
            total = yield partial  # (sum of 1 + B * (R + C) per leaf,)
            with torch.no_grad():
                param_sq = total[starts[:-1]].tolist()
                for leaf, start, size in zip(leaves, starts, sizes):
                    _update_moments(leaf, total[start + 1 : start + size], one_minus_beta2)
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

    def _update(self, leaf: _Leaf, /) -> torch.Tensor:
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


def _moment_sums(leaf: _Leaf, out: torch.Tensor, /) -> None:
    """Writes this rank's partial sums of ``leaf`` into ``out``: ``|p|^2``, then the row and
    column sums of ``g * g`` at this shard's index (factored leaves); zeros unless ``counted``."""
    if not leaf.counted:
        return
    out[0] = leaf.param.local.norm(2).double().square()
    if leaf.factored:
        shape = leaf.param.shape
        batch, rows_n, cols_n = math.prod(shape[:-2]), shape[-2], shape[-1]
        rows = out[1 : 1 + batch * rows_n].view(*shape[:-2], rows_n, 1)
        cols = out[1 + batch * rows_n :].view(*shape[:-2], 1, cols_n)
        grad, index = leaf.grad.local, leaf.index
        # torch.norm(...).square(), as torch computes the means, squared exactly in float64
        rows[index[:-1]] = torch.norm(grad, dim=-1, keepdim=True).double().square()
        cols[(*index[:-2], slice(None), index[-1])] = (
            torch.norm(grad, dim=-2, keepdim=True).double().square()
        )


def _update_moments(leaf: _Leaf, sums: torch.Tensor, one_minus_beta2: float, /) -> None:
    """Moves the second moments of ``leaf`` towards this step's, from the summed ``sums``; mutates."""
    if leaf.row is not None and leaf.col is not None:
        shape = leaf.param.shape
        split = math.prod(shape[:-2]) * shape[-2]
        row_mean = sums[:split].view(leaf.row.shape).to(leaf.row.dtype).div_(shape[-1])
        leaf.row.lerp_(row_mean, one_minus_beta2)
        col_mean = sums[split:].view(leaf.col.shape).to(leaf.col.dtype).div_(shape[-2])
        leaf.col.lerp_(col_mean, one_minus_beta2)
    else:
        assert leaf.variance is not None
        grad = leaf.grad.local
        leaf.variance.local.lerp_(grad * grad, one_minus_beta2)


def _leaves(grads: Any, state: AdafactorState, sparams: Any) -> list[_Leaf]:
    """The trainable floating leaves of ``sparams`` with something to update, with their state."""
    found: list[_Leaf] = []

    def visit(param: Any, grad: Any, row: Any, col: Any, variance: Any) -> None:
        if not isinstance(param, ShardedTensor) or not param.dtype.is_floating_point:
            return
        factored = param.ndim >= 2
        expected = (
            _factor_shape(param.shape, -1) if factored else None,
            _factor_shape(param.shape, -2) if factored else None,
        )
        got = tuple(None if x is None else tuple(x.shape) for x in (row, col))
        if got != expected or (not factored) != isinstance(variance, ShardedTensor):
            raise ValueError(
                f"{param.path}: the Adafactor state does not fit this leaf of shape {param.shape}; "
                f"build it with this optimizer's init(sparams) for these params"
            )
        if math.prod(param.shape) == 0:
            return  # nothing to update (torch.optim.Adafactor divides by its size)
        index, counted = _placement(param.slot, param.flat.rank)
        found.append(_Leaf(param, grad, row, col, variance, index, counted))

    try:
        tree.tree_map(visit, trainable(sparams), grads, state.row, state.col, state.variance)
    except ValueError as e:
        if "Adafactor state" in str(e):
            raise
        raise ValueError(
            f"adafactor: grads or state are not structured like the trainable params ({e}); pass "
            f"grads from a step of the plan that sharded the params and the state of init(sparams)"
        ) from None
    return found


@functools.lru_cache(maxsize=4096)
def _placement(slot: Slot, rank: int) -> tuple[Index, bool]:
    """``rank``'s slices of ``slot``'s leaf, and whether it holds replica 0 (whose sums count)."""
    sharding = slot.sharding
    assert isinstance(sharding, NamedSharding), "init refuses the flat layout"
    return sharding.local_index(slot.shape, rank), sharding.replica_id(rank) == 0


def _factor_shape(shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
    out = list(shape)
    out[dim] = 1
    return tuple(out)


def _factor_numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape[:-2]) * (shape[-2] + shape[-1])


def _factor(param: Any, /, *, dim: int) -> torch.Tensor | None:
    """Zeros for the row (``dim=-1``) or column (``dim=-2``) factor of a leaf of two or more dims."""
    if not isinstance(param, ShardedTensor) or not param.dtype.is_floating_point or param.ndim < 2:
        return None
    return torch.zeros(_factor_shape(param.shape, dim), dtype=param.dtype, device=param.device)


def _vector_zeros(live: Any, /) -> Any:
    """Zero variances, sharded like the params, for the floating leaves of fewer than two dims.

    They get flat buffers of their own (per unit and dtype), holding only those leaves.
    """
    variance: dict[tuple[int, int], ShardedTensor] = {}
    for flat in flats_of(live):
        layout = flat.layout
        if layout.frozen or not layout.dtype.is_floating_point:
            continue
        slots: list[Slot] = []
        offset = 0
        for slot in layout.slots:
            if len(slot.shape) < 2:
                slots.append(
                    Slot(slot.index, slot.path, slot.shape, slot.sharding, slot.shard_shape, offset)
                )
                offset += slot.numel
        if not slots:
            continue
        own = FlatLayout(layout.unit, layout.dtype, layout.mesh, tuple(slots), offset)
        data = torch.zeros(offset, dtype=layout.dtype, device=flat.data.device)  # (numel,)
        shard = FlatShard(own, data, flat.rank)
        for slot in slots:
            variance[(id(flat), slot.index)] = ShardedTensor(shard, slot)
    return tree.tree_map(
        lambda p: (
            variance.get((id(p.flat), p.slot.index)) if isinstance(p, ShardedTensor) else None
        ),
        live,
    )
