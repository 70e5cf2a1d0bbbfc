"""Activation checkpoints in module code: their recompute runs under the binding of the call it redoes.

[Note: activation checkpoints under apply]
A module that checkpoints its own layers (``torch.utils.checkpoint.checkpoint`` in
its forward, ``checkpoint_sequential``, ``checkpoint_wrapper`` /
``apply_activation_checkpointing``, a selective checkpoint's ``context_fn``, the
composable ``torch.distributed._composable.checkpoint``) recomputes them in
backward, after apply returned. While apply runs, :func:`intercepted` replaces the
two names every one of them reaches at call time,
``torch.utils.checkpoint._checkpoint_without_reentrant_generator`` and
``CheckpointFunction`` (and the composable checkpoint's copy of the first):

- a non-reentrant checkpoint taken under a binding recomputes a function wrapped
  by :meth:`Binding.reentering`: in backward it runs with the same tensors bound
  to the module's names as in forward, the units it calls replaying their calls
  ([Note: recomputes in backward] in ``execute/replay.py``), so it saves what forward saved;
- a reentrant checkpoint (``use_reentrant=True``, HF's default) becomes a
  non-reentrant one of the same function: the reentrant kind differentiates its
  recompute in a nested backward, which would reach the root unit's gather node
  twice. Its semantics stay: with no input that requires grad, the function runs
  without grad (nothing inside it gets a gradient) and the same warning is given.

Outside any binding both names do exactly what torch's do. They are replaced for
the duration of an apply (or a re-entered recompute) and restored after, counted
across threads under a lock.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from funcshard._src.interop.binding import current_binding

__all__ = ["intercepted"]

_NON_REENTRANT = "_checkpoint_without_reentrant_generator"
_REENTRANT = "CheckpointFunction"
_COMPOSABLE = "torch.distributed._composable.checkpoint_activation"

_ORIGINAL_GENERATOR = getattr(torch_checkpoint, _NON_REENTRANT)
_ORIGINAL_FUNCTION: Any = getattr(torch_checkpoint, _REENTRANT)

_lock = threading.Lock()
_depth = 0
_restore: list[tuple[types.ModuleType, str, Any]] = []


def _generator(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Iterator[None]:
    """``_checkpoint_without_reentrant_generator``, recomputing ``fn`` under the current binding."""
    binding = current_binding()
    if binding is not None:
        fn = binding.reentering(_intercepting(fn))
    return (yield from _ORIGINAL_GENERATOR(fn, *args, **kwargs))


class _ReentrantAsNonReentrant:
    """Stands for ``CheckpointFunction`` under apply: a non-reentrant checkpoint instead."""

    @staticmethod
    def apply(function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
        if current_binding() is None:
            return _ORIGINAL_FUNCTION.apply(function, preserve_rng_state, *args)
        torch_checkpoint.check_backward_validity(args)  # the reentrant kind's warning
        if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            with torch.no_grad():  # as the reentrant kind: its outputs need no grad
                return function(*args)
        return torch_checkpoint.checkpoint(
            function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state
        )


@contextlib.contextmanager
def intercepted() -> Iterator[None]:
    """Checkpoints taken while the block runs recompute under their binding; see the Note above."""
    global _depth
    with _lock:
        if _depth == 0:
            _install()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _uninstall()


def _intercepting(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, with checkpoints it takes intercepted too (nested ones, in its recompute)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        with intercepted():
            return fn(*args, **kwargs)

    return run


def _install() -> None:
    targets: list[tuple[types.ModuleType, str, Any]] = [
        (torch_checkpoint, _NON_REENTRANT, _generator),
        (torch_checkpoint, _REENTRANT, _ReentrantAsNonReentrant),
    ]
    composable = sys.modules.get(_COMPOSABLE)
    if composable is not None and getattr(composable, _NON_REENTRANT, None) is _ORIGINAL_GENERATOR:
        targets.append((composable, _NON_REENTRANT, _generator))
    for module, name, value in targets:
        _restore.append((module, name, getattr(module, name)))
        setattr(module, name, value)


def _uninstall() -> None:
    while _restore:
        module, name, value = _restore.pop()
        setattr(module, name, value)
