"""The distributed runtime: who we are, and how long a collective may wait."""

from __future__ import annotations

import math
import os
from typing import Any

import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600.0
TIMEOUT_ENV = "FUNCSHARD_COLLECTIVE_TIMEOUT_S"
DEBUG_ENV = "FUNCSHARD_DEBUG"

_UNSET: Any = object()
_explicit_timeout_s: float | None = _UNSET  # set_collective_timeout; wins over everything
_init_timeout_s: float | None = None  # fs.init(timeout_s=...)


class CollectiveError(RuntimeError):
    """A collective failed or timed out: a peer died, or the ranks are out of step."""


class DesyncError(RuntimeError):
    """Ranks disagree about what they run: another plan, tree, or sequence of collectives."""


def collective_timeout() -> float | None:
    """Seconds funcshard waits for a collective before it fails (``None``: the process group's timeout).

    The first that is set wins: :func:`set_collective_timeout`, the environment
    variable ``FUNCSHARD_COLLECTIVE_TIMEOUT_S``, ``fs.init(timeout_s=...)``.

    Raises:
        ValueError: ``FUNCSHARD_COLLECTIVE_TIMEOUT_S`` is not a positive number of seconds.
    """
    if _explicit_timeout_s is not _UNSET:
        return _explicit_timeout_s
    env = os.environ.get(TIMEOUT_ENV, "").strip()
    if env:
        try:
            return check_timeout(float(env), what=TIMEOUT_ENV)
        except ValueError:
            raise ValueError(
                f"{TIMEOUT_ENV}={env!r}: give a positive number of seconds, e.g. {TIMEOUT_ENV}=300"
            ) from None
    return _init_timeout_s


def wait_timeout_s(backend: str | None, /) -> float | None:
    """Seconds a host wait for a collective on ``backend`` may last (``None``: no timeout is passed).

    The one rule every wait on ``torch.distributed`` work follows: gloo's waits get
    :func:`collective_timeout`, so that a peer that never joins raises funcshard's
    error naming the collective; every other backend's get none (see [Note: waits
    that never block the host] in ``pending.py``).

    Example:
        >>> set_collective_timeout(30.0)
        >>> wait_timeout_s("gloo"), wait_timeout_s("nccl"), wait_timeout_s("fake")
        (30.0, None, None)
        >>> set_collective_timeout(None)
    """
    return collective_timeout() if backend == "gloo" else None


def wait_limit_s() -> float:
    """Seconds a wait that funcshard runs itself may last: :func:`collective_timeout`, else ``DEFAULT_TIMEOUT_S``.

    Example:
        >>> wait_limit_s() > 0
        True
    """
    return collective_timeout() or DEFAULT_TIMEOUT_S


def set_collective_timeout(seconds: float | None, /) -> None:
    """Sets :func:`collective_timeout` for this process (``None``: the process group's); mutates process-wide state.

    Raises:
        ValueError: ``seconds`` is not a positive, finite number.

    Example:
        >>> set_collective_timeout(30.0); collective_timeout()
        30.0
        >>> set_collective_timeout(None)
    """
    global _explicit_timeout_s
    _explicit_timeout_s = None if seconds is None else check_timeout(seconds, what="timeout")


def set_init_timeout(seconds: float, /) -> None:
    """Records ``fs.init``'s timeout as the default of :func:`collective_timeout`; mutates process-wide state."""
    global _init_timeout_s
    _init_timeout_s = seconds


def check_timeout(seconds: object, /, *, what: str) -> float:
    """``seconds`` as a float if it is a positive, finite number of seconds.

    Raises:
        ValueError: anything else; the message names ``what``.
    """
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise ValueError(f"a collective {what} must be a number of seconds, got {seconds!r}")
    value = float(seconds)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"a collective {what} must be a positive, finite number of seconds, got {seconds!r}; "
            f"pass None to wait as long as the process group allows"
        )
    return value


def debug_collectives() -> bool:
    """Whether ``FUNCSHARD_DEBUG=1``: every collective first checks that all ranks issue the same one."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def is_distributed() -> bool:
    """Whether ``torch.distributed`` is initialized."""
    return dist.is_available() and dist.is_initialized()


def is_fake() -> bool:
    """Whether the default process group is torch's ``fake`` one (every rank in this process).

    See [Note: the fake process group] in ``channel.py``.
    """
    return is_distributed() and dist.get_backend() == "fake"


def rank() -> int:
    """This process's global rank (0 outside a distributed run)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """The number of ranks (1 outside a distributed run)."""
    return dist.get_world_size() if is_distributed() else 1
