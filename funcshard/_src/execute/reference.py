"""Plain references: a scope in which module code runs as plain PyTorch, for an unsharded reference.

[Note: plain references]
``fs.verify`` and ``fs.testing.reference_value_and_grad`` compute what the model
computes unsharded, to compare a sharded step with. Inside :func:`plain`,
``fs.call`` is a plain call (as anywhere outside a step) and a functionalized
module's ``apply`` runs the module's own ``__call__`` with every leaf bound to
the module's names and no units: no routes, no ``fs.call``, no replays (the
activation checkpoints and backward hooks it takes re-enter that call's binding,
as in any apply). Each call runs on copies of the module's buffers as they were,
so a reference changes no state (batch-norm statistics) and, run before a step,
sees the state that step sees. So the reference shares none of the unit machinery
of the sharded step it checks, and a difference between the two shows a defect.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

__all__ = ["in_plain", "plain"]

_PLAIN: ContextVar[bool] = ContextVar("funcshard_plain", default=False)


@contextlib.contextmanager
def plain() -> Iterator[None]:
    """Module code in the block runs as plain PyTorch (see the Note above).

    Example:
        >>> with plain():
        ...     in_plain()
        True
        >>> in_plain()
        False
    """
    token = _PLAIN.set(True)
    try:
        yield
    finally:
        _PLAIN.reset(token)


def in_plain() -> bool:
    """Whether code runs inside :func:`plain`."""
    return _PLAIN.get()
