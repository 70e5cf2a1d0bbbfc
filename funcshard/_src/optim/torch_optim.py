"""Any elementwise ``torch.optim`` optimizer, run on the flat shards."""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import torch

from funcshard._src import tree
from funcshard._src.optim.base import (
    LearningRate,
    Optimizer,
    floating_flats,
    learning_rate,
    zeros_like_tree,
)

# optimizers whose update of an element reads other elements of the same tensor
# (norms, factored moments, orthogonalization): on flat shards they would be wrong
_NOT_ELEMENTWISE = ("Adafactor", "LBFGS", "SparseAdam", "Muon")


@tree.register_namedtuple  # checkpoints name it in their tree structure
class TorchOptimState(NamedTuple):
    """``count`` updates; ``tensors[key]``: a per-element state, sharded like the params;
    ``scalars[key]``: a 0-d state (``step``), the same for every param and on every rank;
    ``started``: a 0-d bool, true once the state holds values (an update ran, or
    ``load_dcp`` filled it), which then reach torch; until then torch makes its own.
    Keys are in sorted order, so every rank flattens and saves the state alike."""

    count: torch.Tensor
    tensors: dict[str, Any]
    scalars: dict[str, torch.Tensor]
    started: torch.Tensor


def from_torch(optimizer_class: type[torch.optim.Optimizer], /, **options: Any) -> Optimizer:
    """Runs ``optimizer_class(params, **options)`` on the flat shards; ``update_`` writes in place.

    Each update hands the torch optimizer every trainable flat buffer as a
    parameter, its gradient buffer as ``.grad`` and its state from ``state``,
    and calls ``step()``. This is exact for optimizers whose update is
    elementwise (``SGD``, ``Adam``, ``AdamW``, ``RMSprop``, ``Adagrad``,
    ``Adadelta``, ``Adamax``, ``NAdam``, ``RAdam``, ``ASGD``, ``Rprop``): the
    padding stays zero and the result equals the optimizer on the full tensors.
    ``Adafactor``, ``LBFGS``, ``SparseAdam`` and ``Muon`` are refused, and so is any
    subclass of them (use ``fs.optim.adafactor`` for the first). State is a tree (checkpointed and
    resharded like any other): per-element entries sharded like the params,
    0-d entries (``step``) once, as they are the same for every parameter.

    Args:
        optimizer_class: a ``torch.optim.Optimizer`` subclass.
        **options: its constructor's options; ``lr`` may be a schedule ``lr(count)``.

    Raises:
        TypeError: not an optimizer class, or one that is not elementwise.
        ValueError: options the optimizer rejects (its own message).

    Example:
        >>> import funcshard as fs
        >>> p = {"w": torch.ones(2)}
        >>> sp = fs.shard(p, fs.plan(p, fs.Mesh({"x": 1})))
        >>> opt = from_torch(torch.optim.RMSprop, lr=0.01)
        >>> sp, state = opt.update_(sp, opt.init(sp), sp)  # grads = params
        >>> sp["w"].local, sorted(state.tensors)
        (tensor([0.9000, 0.9000]), ['square_avg'])
    """
    if not (
        isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
    ):
        raise TypeError(
            f"from_torch takes a torch.optim optimizer class (e.g. torch.optim.Adam), got "
            f"{optimizer_class!r}"
        )
    name = optimizer_class.__name__
    refused = next((c for c in optimizer_class.__mro__ if c.__name__ in _NOT_ELEMENTWISE), None)
    if refused is not None:  # a subclass updates as its base does: refused alike
        base = refused.__name__
        what = (
            f"torch.optim.{base}"
            if refused is optimizer_class
            else f"{optimizer_class.__qualname__} (a subclass of {refused.__module__}.{base})"
        )
        raise TypeError(
            f"from_torch: {what} reads whole tensors (norms or factored moments), so it would be "
            f"wrong on flat shards; "
            + ("use fs.optim.adafactor" if base == "Adafactor" else "use an elementwise optimizer")
        )
    lr: LearningRate | None = options.pop("lr", None)
    constant = {} if lr is None else {"lr": 0.0 if callable(lr) else lr}
    tensor_keys, scalar_keys = _probe(optimizer_class, {**options, **constant})

    def make(params: list[torch.Tensor], count: int) -> torch.optim.Optimizer:
        extra = {} if lr is None else {"lr": learning_rate(lr, count)}
        return cast(Any, optimizer_class)(params, **options, **extra)

    def init(sparams: Any, /) -> TorchOptimState:
        tensors = {key: zeros_like_tree(sparams) for key in tensor_keys}
        scalars = {key: torch.zeros((), dtype=dtype) for key, dtype in scalar_keys.items()}
        count = torch.zeros((), dtype=torch.int64)
        return TorchOptimState(count, tensors, scalars, torch.zeros((), dtype=torch.bool))

    def update_(grads: Any, state: TorchOptimState, sparams: Any, /) -> tuple[Any, TorchOptimState]:
        count = int(state.count)
        keys = list(tensor_keys)
        flats = floating_flats(
            sparams,
            grads,
            *(state.tensors[k] for k in keys),
            names=["params", "grads", *(f"state.tensors[{k!r}]" for k in keys)],
        )
        params, g, per_key = flats[0], flats[1], dict(zip(keys, flats[2:]))
        if not params:  # a mask that leaves no leaf here
            _advance_(state)
            return sparams, state
        optimizer = make(params, count)
        # state that holds values reaches torch, whatever the count (torch's SGD keeps no
        # step: a loaded momentum_buffer comes with count 0); a fresh one does not, as
        # torch's first update differs from one on zeros (SGD's dampening, Adagrad's
        # initial_accumulator_value, Rprop's step_size)
        started = bool(state.started)
        for i, (p, grad) in enumerate(zip(params, g)):
            p.grad = grad.clone() if grad.data_ptr() == p.data_ptr() else grad  # grads = params
            if started:
                mine: dict[str, Any] = {k: per_key[k][i] for k in keys}
                mine.update({k: state.scalars[k].clone() for k in scalar_keys})
                optimizer.state[p] = mine
        optimizer.step()
        for i, p in enumerate(params):
            theirs = optimizer.state[p]
            for k in keys:
                if theirs[k] is not per_key[k][i]:
                    per_key[k][i].copy_(theirs[k])
            p.grad = None
        for k in scalar_keys:
            values = {float(optimizer.state[p][k]) for p in params}
            if len(values) > 1:
                raise RuntimeError(
                    f"from_torch: torch.optim.{name} keeps a different {k!r} per parameter "
                    f"({sorted(values)[:4]}), which funcshard keeps once; write it as an fs.optim "
                    f"optimizer"
                )
            state.scalars[k].copy_(optimizer.state[params[0]][k])
        _advance_(state)
        return sparams, state

    return Optimizer(init, update_)


def _advance_(state: TorchOptimState) -> None:
    """Counts one update and marks the state started; mutates ``state``."""
    state.count.add_(1)
    state.started.fill_(True)


def _probe(
    optimizer_class: type[torch.optim.Optimizer], options: dict[str, Any]
) -> tuple[tuple[str, ...], dict[str, torch.dtype]]:
    """The keys of the optimizer's per-element and 0-d state, from one step on a scratch tensor,
    each sorted: a set's order would differ between ranks (PYTHONHASHSEED)."""
    scratch = torch.zeros(2)
    scratch.grad = torch.zeros(2)
    try:
        optimizer = cast(Any, optimizer_class)([scratch], **options)
        optimizer.step()
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"from_torch: torch.optim.{optimizer_class.__name__}: {e}") from e
    tensors: set[str] = set()
    scalars: dict[str, torch.dtype] = {}
    for key, value in optimizer.state[scratch].items():
        if isinstance(value, torch.Tensor) and value.shape == scratch.shape:
            tensors.add(key)
        elif isinstance(value, torch.Tensor) and value.ndim == 0:
            scalars[key] = value.dtype
        else:
            raise TypeError(
                f"from_torch: torch.optim.{optimizer_class.__name__} keeps state {key!r} of type "
                f"{type(value).__name__}, which funcshard cannot shard; write it as an fs.optim "
                f"optimizer"
            )
    return tuple(sorted(tensors)), dict(sorted(scalars.items()))
