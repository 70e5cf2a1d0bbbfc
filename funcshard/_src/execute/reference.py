"""Plain references: a scope in which module code runs as plain PyTorch, for an unsharded reference.

[Note: plain references]
``fs.verify`` and ``fs.testing.reference_value_and_grad`` compute what the model
computes unsharded, to compare a sharded step with. Inside :func:`plain`,
``fs.call`` is a plain call (as anywhere outside a step) and a functionalized
module's ``apply`` runs the module's own ``__call__`` with every leaf bound to the
module's names, and keeps them bound until the scope ends, after the reference's
backward: no unit routes, no re-entered bindings, nothing of funcshard's between
the module and autograd (a checkpoint's recompute and a hook read the bound
leaves as they would read the module's parameters). So the reference shares no
defect of the machinery that the sharded step runs, and a difference between the
two shows one. Each call runs on copies of the module's buffers as they were, so
a reference changes no state (batch-norm statistics) and, run before a step, sees
the state that step sees.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

__all__ = ["plain", "plain_scope"]

_PLAIN: ContextVar[contextlib.ExitStack | None] = ContextVar("funcshard_plain", default=None)


@contextlib.contextmanager
def plain() -> Iterator[None]:
    """Module code in the block runs as plain PyTorch; what it binds stays bound to the block's end.

    Example:
        >>> with plain():
        ...     plain_scope() is not None
        True
        >>> plain_scope() is None
        True
    """
    with contextlib.ExitStack() as stack:
        token = _PLAIN.set(stack)
        try:
            yield
        finally:
            _PLAIN.reset(token)


def plain_scope() -> contextlib.ExitStack | None:
    """The stack that holds a plain reference's bindings until its end, inside :func:`plain`."""
    return _PLAIN.get()
