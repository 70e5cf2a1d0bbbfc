"""Starting ``torch.distributed`` from torchrun's environment, and stopping it at exit."""

from __future__ import annotations

import atexit
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from funcshard._src.comm import channel, runtime


def init(*, backend: str | None = None, timeout_s: float | None = None) -> None:
    """Starts ``torch.distributed`` from torchrun's environment; alone, it does nothing.

    The backend is ``nccl`` where CUDA is available and ``gloo`` otherwise. On
    NCCL each rank uses ``cuda:LOCAL_RANK`` (passed as ``device_id``): the device
    :func:`funcshard.device` names, where :func:`funcshard.shard` puts shards. On
    the CPU, when several ranks share the machine and ``OMP_NUM_THREADS`` is not
    set, each rank gets an equal share of the cores. Calling it again is a no-op.

    Args:
        backend: override the backend (``"gloo"``, ``"nccl"``).
        timeout_s: how long a collective may wait for its peers before it fails
            (the process group's timeout, and the collective timeout unless
            ``FUNCSHARD_COLLECTIVE_TIMEOUT_S`` or ``fs.set_collective_timeout`` says
            otherwise); default 600 s. The process group is destroyed at exit.

    Raises:
        ValueError: ``timeout_s`` is not a positive, finite number of seconds.

    Example:
        >>> import funcshard as fs
        >>> fs.init()  # a single process without torchrun: nothing to start
        >>> fs.world_size()
        1
    """
    timeout_s = (
        runtime.DEFAULT_TIMEOUT_S
        if timeout_s is None
        else runtime.check_timeout(timeout_s, what="timeout")
    )
    if dist.is_initialized() or "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return
    runtime.set_init_timeout(timeout_s)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    extra: dict[str, Any] = {}
    if backend == "nccl":
        # the rank's own GPU: NCCL binds its communicator to it at once (no guessing at the
        # first collective), and it is where shards go by default (runtime.default_device)
        device = runtime.default_device("nccl")
        torch.cuda.set_device(device)
        extra["device_id"] = device
    elif "OMP_NUM_THREADS" not in os.environ:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    # the process group's timeout: on NCCL its watchdog is what ends a collective that never
    # completes ([Note: waits that never block the host] in comm/collectives.py)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = _attempt_store(timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout, **extra)
    else:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=size, timeout=timeout, **extra
        )
    atexit.register(_destroy_at_exit)


def _destroy_at_exit() -> None:
    """Destroys the process group ``init`` made, before the interpreter shuts down.

    Left to interpreter shutdown, gloo's worker threads can still hold finished
    work whose tensors need the GIL to be freed, and a rank aborts with
    "terminate called without an active exception" after its work is done;
    torchrun reports that as a failed job. A process that is out of step keeps
    its group: destroying waits for collectives in flight, whose peers may be gone.
    """
    if not dist.is_initialized():
        return
    ch = channel.existing_channel()
    if ch is None or ch.out_of_step is None:
        dist.destroy_process_group()


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
