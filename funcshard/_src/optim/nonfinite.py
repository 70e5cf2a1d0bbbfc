"""Non-finite gradients: detect NaN/Inf across every shard with one agreement, and skip such steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from funcshard._src import tree
from funcshard._src.comm import channel, collectives, groups, runtime, settle
from funcshard._src.optim.base import (
    InitFn,
    Optimizer,
    Transform,
    can_skip_on_device,
    device_of,
    skip_flag,
    skipping_when,
    skips_on_device,
)
from funcshard._src.shard.sharded import flats_of


def all_finite(grads: Any, /) -> bool:
    """Whether every element of ``grads`` on every rank is finite; collective (one agreement).

    Reads the answer back to the host; :func:`nonfinite_flag` keeps it on the device.

    Example:
        >>> import funcshard as fs
        >>> g = {"w": torch.tensor([1.0, float("nan")])}
        >>> all_finite(fs.shard(g, fs.plan(g, fs.Mesh({"x": 1}))))
        False
    """
    return not bool(nonfinite_flag(grads))


def nonfinite_flag(grads: Any, /) -> torch.Tensor:
    """1.0 if some element of ``grads`` on some rank is NaN or Inf, else 0.0: a 0-d float32 on their device.

    Collective. Nothing is read back to the host on one rank, nor over several
    ranks on an accelerator (the ranks agree on the operation on the host and
    all-reduce the flag on the device); on the CPU the flags travel in the
    agreement. The flag is what the fused optimizers take as ``found_inf``.

    Example:
        >>> import funcshard as fs
        >>> g = {"w": torch.tensor([1.0, float("inf")])}
        >>> nonfinite_flag(fs.shard(g, fs.plan(g, fs.Mesh({"x": 1}))))
        tensor(1.)
    """
    flats = [f for f in flats_of(grads) if f.layout.dtype.is_floating_point]
    if not flats:
        return torch.zeros((), dtype=torch.float32)
    bad = torch.zeros((), dtype=torch.float32, device=flats[0].held()[0].device)
    for flat in flats:  # one reduction per flat buffer (per leaf where held as leaves)
        for t in flat.held():
            bad += (~torch.isfinite(t)).any().float()
    bound = groups.bind(flats[0].layout.mesh)
    if runtime.world_size() > 1:
        with settle.operation("all_finite"):
            if bad.device.type != "cpu":  # as clip_by_global_norm: no read back
                bad = collectives.sum_over_mesh(bad.reshape(1), bound, "all_finite").reshape(())
            else:
                (total,) = channel.sum_over_ranks([float(bad)], "all_finite")
                bad = torch.tensor(total, dtype=torch.float32)
    return (bad > 0).float()


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
    flag_: Callable[[Any, Any], tuple[torch.Tensor, Any]] | None = None
    """``flag_(grads, state) -> (skip, state)``: the decision as a device flag (1.0: stop),
    for parts that can skip on the device (see [Note: skipping on the device] in ``base.py``)."""

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
    itself in ``state.skipped``. Collective: one agreement per update. Where
    every part it guards can skip on the device (clipping, and ``adamw`` fused
    with a constant learning rate and no mask on its decay), the decision stays
    on the device: no host read (see [Note: skipping on the device] in
    ``base.py``); otherwise it reads one flag per update.

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
            return SkipState(None, torch.zeros((), dtype=torch.int64, device=device_of(sparams)))

        def check_(grads: Any, state: SkipState, /) -> tuple[bool, SkipState]:
            if all_finite(grads):
                return True, state
            state.skipped.add_(1)
            return False, state

        def flag_(grads: Any, state: SkipState, /) -> tuple[torch.Tensor, SkipState]:
            return _flag_and_count_(grads, state.skipped), state

        return Guard(init_guard, check_, flag_)
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"skip_nonfinite wraps an fs.optim optimizer (e.g. fs.optim.adamw(...)), got "
            f"{type(optimizer).__name__}"
        )

    def init(sparams: Any, /) -> SkipState:
        skipped = torch.zeros((), dtype=torch.int64, device=device_of(sparams))
        return SkipState(optimizer.init(sparams), skipped)

    def update_(grads: Any, state: SkipState, sparams: Any, /) -> tuple[Any, SkipState]:
        if skips_on_device(optimizer):  # See [Note: skipping on the device] (base.py)
            with skipping_when(_flag_and_count_(grads, state.skipped)):
                sparams, inner = optimizer.update_(grads, state.inner, sparams)
            return sparams, SkipState(inner, state.skipped)
        if not all_finite(grads):
            state.skipped.add_(1)
            return sparams, state
        sparams, inner = optimizer.update_(grads, state.inner, sparams)
        return sparams, SkipState(inner, state.skipped)

    if skips_on_device(optimizer):
        can_skip_on_device(update_)  # it honours an outer flag too

    # a guarded transform writes into the gradients as the transform does
    return (Transform if isinstance(optimizer, Transform) else Optimizer)(init, update_)


def _flag_and_count_(grads: Any, skipped: torch.Tensor, /) -> torch.Tensor:
    """This update's skip flag (an outer one's, or NaN/Inf in ``grads``); counts a skip this guard makes in ``skipped``, on the device."""
    found = nonfinite_flag(grads)
    outer = skip_flag()
    if outer is None:
        skipped.add_(found.to(skipped.device, skipped.dtype))
        return found
    # an update an outer guard skips is not this guard's to count
    skipped.add_((found * (1 - outer)).to(skipped.device, skipped.dtype))
    return torch.maximum(found, outer)
