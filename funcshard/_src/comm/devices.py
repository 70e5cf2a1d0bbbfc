"""Where shards and batches live: the device a backend's collectives can carry.

[Note: devices and backends]
A collective carries tensors of the device its backend serves: NCCL moves CUDA
tensors of the rank's own GPU, gloo (as funcshard runs it) CPU tensors. A
shard or a batch elsewhere would fail deep inside torch at the first
collective, or hang one rank while the others wait. So under NCCL shards go to
``cuda:LOCAL_RANK`` by default (:func:`default_device`, ``fs.device()``), and
:func:`check_tensors` refuses, before the first collective, a shard or batch
on a device the backend cannot carry, naming the leaf and the fix. Outside a
distributed run, and under torch's ``fake`` process group (which moves no
bytes), any device goes.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
import torch.distributed as dist

from funcshard._src.comm import runtime

__all__ = ["backend", "check_device", "check_tensors", "default_device", "device"]


def backend() -> str | None:
    """The default process group's backend (``"gloo"``, ``"nccl"``, ...); ``None`` outside a distributed run."""
    return str(dist.get_backend()) if runtime.is_distributed() else None


def default_device(name: str | None = None, /) -> torch.device:
    """The device of this rank's shards and batches under backend ``name`` (default: the running one).

    ``cuda:LOCAL_RANK`` under NCCL (torchrun sets ``LOCAL_RANK``), else the CPU.

    Example:
        >>> default_device("gloo"), default_device("nccl")
        (device(type='cpu'), device(type='cuda', index=0))
    """
    name = backend() if name is None else name
    if name == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def device() -> torch.device:
    """The device this rank's shards and batches belong on: ``cuda:LOCAL_RANK`` under NCCL, else the CPU.

    :func:`funcshard.shard` puts shards there by default under NCCL; put batches
    there too (``tokens.to(fs.device())``). Call it after :func:`funcshard.init`.

    Example:
        >>> import funcshard as fs
        >>> fs.device()  # one process, no process group: the CPU
        device(type='cpu')
    """
    return default_device()


def _fix(name: str) -> str:
    if name == "nccl":
        return (
            f"under NCCL, shards and batches go to this rank's GPU: fs.shard(..., device=fs.device()) "
            f"(the default) and batch.to(fs.device()) ({default_device('nccl')})"
        )
    return (
        f"under {name}, shards and batches stay on the CPU: fs.shard(..., device='cpu') and "
        f"batch.cpu(); for GPUs start with fs.init(backend='nccl')"
    )


def carries(name: str | None, where: torch.device, /) -> bool:
    """Whether backend ``name``'s collectives carry tensors on ``where`` (any backend carries meta).

    Example:
        >>> carries("nccl", torch.device("cpu")), carries("gloo", torch.device("cpu"))
        (False, True)
    """
    if name is None or name == "fake" or where.type == "meta":
        return True
    if name == "nccl":
        return where == default_device("nccl")
    if name == "gloo":
        return where.type == "cpu"
    return True  # another backend (mpi, ucc, a plug-in): it knows its own devices


def check_device(where: torch.device, what: str, /) -> None:
    """Refuses ``where`` if the running backend cannot carry it; ``what`` names it ("fs.shard: device='cuda:1'").

    Raises:
        ValueError: the message names ``what``, the device, the backend and the fix.

    Example:
        >>> check_device(torch.device("cpu"), "fs.shard: device='cpu'")  # no process group: any device
    """
    name = backend()
    if not carries(name, where):
        raise ValueError(
            f"{what}: {where} cannot take part in {name} collectives; {_fix(str(name))}"
        )


def check_tensors(named: Iterable[tuple[str, torch.Tensor]], what: str, /) -> None:
    """Refuses the first ``(path, tensor)`` whose device the running backend cannot carry.

    Called before the first collective of a step or evaluation, on every shard
    and every tensor of the batch (see [Note: devices and backends]).

    Raises:
        ValueError: the message names ``what`` ("the batch", "the params"), the
            leaf's path, its device, the backend and the fix.

    Example:
        >>> check_tensors([("tokens", torch.zeros(2))], "the batch")  # no process group: any device
    """
    name = backend()
    if name is None or name == "fake":
        return
    for path, tensor in named:
        if not carries(name, tensor.device):
            raise ValueError(
                f"{what}: {path or '<root>'} is on {tensor.device}, which {name} collectives "
                f"cannot carry (this rank's device is {default_device(name)}); {_fix(name)}"
            )
