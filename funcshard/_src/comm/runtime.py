"""The distributed runtime: starting ``torch.distributed`` and asking who we are."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600.0
_collective_timeout_s: float | None = (
    float(os.environ["FUNCSHARD_COLLECTIVE_TIMEOUT_S"])
    if "FUNCSHARD_COLLECTIVE_TIMEOUT_S" in os.environ
    else None
)


class CollectiveError(RuntimeError):
    """A collective failed or timed out: a peer died, or the ranks are out of step."""


class DesyncError(RuntimeError):
    """Ranks disagree about what they run: another plan, tree, or sequence of collectives."""


def collective_timeout() -> float | None:
    """Seconds funcshard waits for a collective before it fails (``None``: the process group's timeout)."""
    return _collective_timeout_s


def set_collective_timeout(seconds: float | None, /) -> None:
    """Sets :func:`collective_timeout`; mutates process-wide state.

    Example:
        >>> set_collective_timeout(30.0); collective_timeout()
        30.0
        >>> set_collective_timeout(None)
    """
    global _collective_timeout_s
    if seconds is not None and seconds <= 0:
        raise ValueError(f"a collective timeout must be positive, got {seconds}")
    _collective_timeout_s = seconds


def debug_collectives() -> bool:
    """Whether ``FUNCSHARD_DEBUG=1``: every collective first checks that all ranks issue the same one."""
    return os.environ.get("FUNCSHARD_DEBUG", "") not in ("", "0")


def init(*, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Starts ``torch.distributed`` from torchrun's environment; alone, it does nothing.

    The backend is ``nccl`` where CUDA is available and ``gloo`` otherwise. On
    the CPU, when several ranks share the machine and ``OMP_NUM_THREADS`` is not
    set, each rank gets an equal share of the cores. Calling it again is a no-op.

    Args:
        backend: override the backend (``"gloo"``, ``"nccl"``).
        timeout_s: how long a collective may wait for its peers before it fails
            (the process group's timeout, and :func:`collective_timeout`).

    Example:
        >>> init()  # a single process without torchrun: nothing to start
        >>> world_size()
        1
    """
    if dist.is_initialized() or "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return
    set_collective_timeout(timeout_s)
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
