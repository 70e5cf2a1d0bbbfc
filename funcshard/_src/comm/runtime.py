"""The distributed runtime: starting ``torch.distributed`` and asking who we are."""

from __future__ import annotations

import datetime
import math
import os
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600.0
TIMEOUT_ENV = "FUNCSHARD_COLLECTIVE_TIMEOUT_S"

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
    return os.environ.get("FUNCSHARD_DEBUG", "") not in ("", "0")


def init(*, backend: str | None = None, timeout_s: float | None = None) -> None:
    """Starts ``torch.distributed`` from torchrun's environment; alone, it does nothing.

    The backend is ``nccl`` where CUDA is available and ``gloo`` otherwise. On
    the CPU, when several ranks share the machine and ``OMP_NUM_THREADS`` is not
    set, each rank gets an equal share of the cores. Calling it again is a no-op.

    Args:
        backend: override the backend (``"gloo"``, ``"nccl"``).
        timeout_s: how long a collective may wait for its peers before it fails
            (the process group's timeout, and :func:`collective_timeout` unless
            ``FUNCSHARD_COLLECTIVE_TIMEOUT_S`` or :func:`set_collective_timeout` says
            otherwise); default 600 s.

    Raises:
        ValueError: ``timeout_s`` is not a positive, finite number of seconds.

    Example:
        >>> init()  # a single process without torchrun: nothing to start
        >>> world_size()
        1
    """
    global _init_timeout_s
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else check_timeout(timeout_s, what="timeout")
    if dist.is_initialized() or "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return
    _init_timeout_s = timeout_s
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    elif "OMP_NUM_THREADS" not in os.environ:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    timeout = datetime.timedelta(seconds=timeout_s)
    store = _attempt_store(timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)


def _attempt_store(timeout: datetime.timedelta) -> dist.Store | None:
    """After a torchrun restart, a store whose keys are this attempt's alone (else ``None``).

    torchrun keeps its rendezvous store across restarts, and torch 2.13 no longer
    prefixes worker keys by attempt, so restarted ranks could read the addresses
    their dead predecessors published and fail to connect ("Connection refused").
    Keys under ``funcshard/attempt_<n>/`` cannot be stale.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=not agent_hosts and os.environ["RANK"] == "0",
        timeout=timeout,
        multi_tenant=not agent_hosts,
    )
    return dist.PrefixStore(f"funcshard/attempt_{attempt}/", store)


def is_distributed() -> bool:
    """Whether ``torch.distributed`` is initialized."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank (0 outside a distributed run)."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """The number of ranks (1 outside a distributed run)."""
    return dist.get_world_size() if is_distributed() else 1
