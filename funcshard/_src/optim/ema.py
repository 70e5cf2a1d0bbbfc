"""An exponential moving average of the params, kept sharded like them (for evaluation)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from funcshard._src import tree
from funcshard._src.optim.base import Optimizer, check_hyperparameter, floating_flats
from funcshard._src.shard.sharded import ShardedTensor, map_flats, trainable


@tree.register_namedtuple  # checkpoints name it in their tree structure
class EmaState(NamedTuple):
    """``count`` averages taken; ``params``: the average, sharded like the params (``None`` where frozen)."""

    count: torch.Tensor
    params: Any


def ema(decay: float, /) -> Optimizer:
    """A chain element that averages the params in place after the optimizer: ``avg = decay * avg + (1 - decay) * p``.

    Put it after the optimizer in :func:`funcshard.optim.chain`; it reads the
    params the optimizer just wrote and leaves them as they are. The average
    starts as a copy of the params at ``init`` and moves after every update, as
    timm's ``ModelEmaV2`` does (``torch._foreach_lerp_``, the op of
    ``torch.optim.swa_utils.get_ema_multi_avg_fn``). It is sharded like the params (1/N of them per
    rank) and checkpointed with the optimizer state; :func:`ema_params` gives a
    params tree of it for ``fs.forward``, ``fs.unshard`` or an export.

    Example:
        >>> import funcshard as fs
        >>> p = {"w": torch.ones(2)}
        >>> sp = fs.shard(p, fs.plan(p, fs.Mesh({"x": 1})))
        >>> opt = fs.optim.chain(fs.optim.sgd(lr=0.5), ema(0.9))
        >>> sp, state = opt.update_(sp, opt.init(sp), sp)  # grads = params: w becomes 0.5
        >>> ema_params(state, sp)["w"].local
        tensor([0.9500, 0.9500])
    """
    check_hyperparameter("ema: decay", decay, low=0.0, high=1.0)

    def init(sparams: Any, /) -> EmaState:
        average = map_flats(lambda flat: flat.with_data(flat.data.clone()), trainable(sparams))
        return EmaState(torch.zeros((), dtype=torch.int64), average)

    def update_(grads: Any, state: EmaState, sparams: Any, /) -> tuple[Any, EmaState]:
        params, average = floating_flats(
            sparams, state.params, names=["params", "ema state.params"]
        )
        if not params:  # a mask that leaves no leaf here
            state.count.add_(1)
            return sparams, state
        with torch.no_grad():
            torch._foreach_lerp_(average, params, 1 - decay)
        state.count.add_(1)
        return sparams, state

    return Optimizer(init, update_)


def ema_params(state: Any, sparams: Any, /) -> Any:
    """The averaged params kept by the :func:`ema` element in ``state``, as a params tree like ``sparams``.

    Frozen leaves (which are not averaged) come from ``sparams``. The result
    shares the average's buffers: do not pass it to an optimizer.

    Raises:
        ValueError: ``state`` holds no :class:`EmaState` (an optimizer without ``ema``).

    Example:
        >>> import funcshard as fs
        >>> p = {"w": torch.ones(2)}
        >>> sp = fs.shard(p, fs.plan(p, fs.Mesh({"x": 1})))
        >>> opt = fs.optim.chain(fs.optim.adamw(1e-3), ema(0.999))
        >>> ema_params(opt.init(sp), sp)["w"].local
        tensor([1., 1.])
    """
    found = _find(state)
    if found is None:
        raise ValueError(
            "ema_params: this optimizer state has no moving average; chain fs.optim.ema(decay) "
            "after the optimizer, e.g. fs.optim.chain(fs.optim.adamw(...), fs.optim.ema(0.999))"
        )
    averaged = {
        leaf.path: leaf for leaf in tree.leaves(found.params) if isinstance(leaf, ShardedTensor)
    }
    # a masked average covers some leaves of a flat buffer: those buffers are copied and
    # the averaged leaves written into the copy, so that every buffer has the params' layout
    partial = {
        id(leaf.flat)
        for leaf in tree.leaves(sparams)
        if isinstance(leaf, ShardedTensor)
        and leaf.path in averaged
        and averaged[leaf.path].flat.layout != leaf.flat.layout
    }
    copies: dict[int, Any] = {}

    def leaf_fn(leaf: Any) -> Any:
        if not isinstance(leaf, ShardedTensor) or leaf.frozen:
            return leaf
        avg = averaged.get(leaf.path)
        if id(leaf.flat) not in partial:
            return leaf if avg is None else avg
        flat = copies.get(id(leaf.flat))
        if flat is None:
            flat = copies[id(leaf.flat)] = leaf.flat.with_data(leaf.flat.data.clone())
        out = ShardedTensor(flat, leaf.slot)
        if avg is not None:
            out.padded.copy_(avg.padded)
        return out

    return tree.tree_map(leaf_fn, sparams)


def _find(state: Any) -> EmaState | None:
    if isinstance(state, EmaState):
        return state
    children: Any = state.values() if isinstance(state, dict) else state
    if not isinstance(children, (tuple, type({}.values()))):
        return None
    for child in children:
        found = _find(child)
        if found is not None:
            return found
    return None
