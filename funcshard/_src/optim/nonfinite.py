"""Non-finite gradients: detect NaN/Inf across every shard with one agreement, and skip such steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from funcshard._src import tree
from funcshard._src.comm import agree, groups, settle
from funcshard._src.optim.base import InitFn, Optimizer, Transform
from funcshard._src.shard.sharded import flats_of


def all_finite(grads: Any, /) -> bool:
    """Whether every element of ``grads`` on every rank is finite; collective (one agreement).

    Example:
        >>> import funcshard as fs
        >>> g = {"w": torch.tensor([1.0, float("nan")])}
        >>> all_finite(fs.shard(g, fs.plan(g, fs.Mesh({"x": 1}))))
        False
    """
    flats = [f for f in flats_of(grads) if f.layout.dtype.is_floating_point]
    if not flats:
        return True
    bad = torch.zeros((), dtype=torch.float32, device=flats[0].held()[0].device)
    for flat in flats:  # one reduction per flat buffer (per leaf where held as leaves)
        for t in flat.held():
            bad += (~torch.isfinite(t)).any().float()
    groups.bind(flats[0].layout.mesh)
    with settle.operation("all_finite"):
        (total,) = agree.sum_over_ranks([float(bad)], "all_finite")
    return total == 0


@tree.register_namedtuple  # checkpoints name it in their tree structure
class SkipState(NamedTuple):
    """The wrapped optimizer's state and how many updates were skipped."""

    inner: Any
    skipped: torch.Tensor


class Guard(NamedTuple):
    """A chain element that may stop an update: ``check_(grads, state) -> (go_on, state)``.

    :func:`funcshard.optim.chain` calls ``check_``; when it returns ``False``,
    the elements after the guard do not run for this update. A guard is not an
    optimizer on its own: wrap one (``skip_nonfinite(adamw(...))``) for that.
    """

    init: InitFn
    check_: Callable[[Any, Any], tuple[bool, Any]]

    @property
    def update_(self) -> Any:
        """Refused: a guard only gates the rest of a chain."""
        raise TypeError(
            "skip_nonfinite() without an optimizer is a chain element; use "
            "fs.optim.chain(fs.optim.skip_nonfinite(), fs.optim.adamw(...)) or "
            "fs.optim.skip_nonfinite(fs.optim.adamw(...))"
        )


def skip_nonfinite(optimizer: Optimizer | None = None, /) -> Any:
    """Skips (in place, as it updates) every update whose gradients hold NaN or Inf on any rank.

    ``skip_nonfinite(opt)`` wraps an optimizer; ``skip_nonfinite()`` is a
    :class:`Guard` for :func:`funcshard.optim.chain` that stops the elements
    after it (``chain(skip_nonfinite(), clip_by_global_norm(1.0), adamw(...))``).
    A skipped update leaves params and the inner state as they were and counts
    itself in ``state.skipped``. Collective: one agreement per update.

    Example:
        >>> import funcshard as fs
        >>> p = {"w": torch.ones(2)}
        >>> sp = fs.shard(p, fs.plan(p, fs.Mesh({"x": 1})))
        >>> opt = skip_nonfinite(fs.optim.sgd(lr=0.1))
        >>> bad = fs.shard({"w": torch.tensor([float("inf"), 0.0])}, fs.plan(p, fs.Mesh({"x": 1})))
        >>> sp, state = opt.update_(bad, opt.init(sp), sp)
        >>> int(state.skipped), sp["w"].local
        (1, tensor([1., 1.]))
    """
    if optimizer is None:

        def init_guard(sparams: Any, /) -> SkipState:
            return SkipState(None, torch.zeros((), dtype=torch.int64))

        def check_(grads: Any, state: SkipState, /) -> tuple[bool, SkipState]:
            if all_finite(grads):
                return True, state
            state.skipped.add_(1)
            return False, state

        return Guard(init_guard, check_)
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"skip_nonfinite wraps an fs.optim optimizer (e.g. fs.optim.adamw(...)), got "
            f"{type(optimizer).__name__}"
        )

    def init(sparams: Any, /) -> SkipState:
        return SkipState(optimizer.init(sparams), torch.zeros((), dtype=torch.int64))

    def update_(grads: Any, state: SkipState, sparams: Any, /) -> tuple[Any, SkipState]:
        if not all_finite(grads):
            state.skipped.add_(1)
            return sparams, state
        sparams, inner = optimizer.update_(grads, state.inner, sparams)
        return sparams, SkipState(inner, state.skipped)

    # a guarded transform writes into the gradients as the transform does
    return (Transform if isinstance(optimizer, Transform) else Optimizer)(init, update_)
