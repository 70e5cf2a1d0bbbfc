"""The distributed runtime: who we are, on which device, how long a collective may wait, and the settings a step holds.

[Note: settings held through a step]
funcshard's environment variables (``FUNCSHARD_*``: the transport, the
algorithms, the debug check, the collective timeout) are read through
:func:`setting`. A step or evaluation reads them once, when it starts
(:func:`held_settings`), and every collective inside it sees that snapshot:
a step issues a few collectives per unit, and reading the environment at each
cost more host time than issuing them (``python -m bench.fake_pg``). Outside a
step every read is fresh. So a variable set between two steps (as a test that
sets one for one call does) takes effect at the next step, on every rank
alike, and one changed inside a step (from a hook) only at the next.

**Devices.** Shards and batches live on a device the backend's collectives can
carry.

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

import contextlib
import datetime
import math
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600.0
TIMEOUT_ENV = "FUNCSHARD_COLLECTIVE_TIMEOUT_S"
DEBUG_ENV = "FUNCSHARD_DEBUG"

PREFIX = "FUNCSHARD_"

Timeout = datetime.timedelta | None

_UNSET: Any = object()
_held: dict[str, str] | None = None  # the snapshot of a running step: held_settings
_held_depth = 0
_explicit_timeout_s: float | None = _UNSET  # set_collective_timeout; wins over everything
_init_timeout_s: float | None = None  # fs.init(timeout_s=...)


class CollectiveError(RuntimeError):
    """A collective failed or timed out: a peer died, or the ranks are out of step."""


class DesyncError(RuntimeError):
    """Ranks disagree about what they run: another plan, tree, or sequence of collectives."""


def setting(name: str, default: str = "", /) -> str:
    """The environment variable ``name`` (a ``FUNCSHARD_*``), as held by the running step if one is.

    See [Note: settings held through a step].

    Example:
        >>> setting("FUNCSHARD_NOT_SET_ANYWHERE", "auto")
        'auto'
    """
    held = _held
    if held is not None:
        return held.get(name, default)
    return os.environ.get(name, default)


@contextlib.contextmanager
def held_settings() -> Iterator[None]:
    """Holds the ``FUNCSHARD_*`` environment as it is now until the block ends; mutates process-wide state.

    Nested blocks keep the outermost snapshot. See [Note: settings held through a step].

    Example:
        >>> import os
        >>> with held_settings():
        ...     os.environ["FUNCSHARD_EXAMPLE"] = "1"
        ...     print(repr(setting("FUNCSHARD_EXAMPLE")))
        ''
        >>> setting("FUNCSHARD_EXAMPLE")
        '1'
        >>> del os.environ["FUNCSHARD_EXAMPLE"]
    """
    global _held, _held_depth
    if _held_depth == 0:
        _held = {k: v for k, v in os.environ.items() if k.startswith(PREFIX)}
    _held_depth += 1
    try:
        yield
    finally:
        _held_depth -= 1
        if _held_depth == 0:
            _held = None


def held() -> dict[str, str] | None:
    """The running step's snapshot of the ``FUNCSHARD_*`` environment; ``None`` outside a step."""
    return _held


def collective_timeout() -> float | None:
    """Seconds funcshard waits for a collective before it fails (``None``: the process group's timeout).

    The first that is set wins: :func:`set_collective_timeout`, the environment
    variable ``FUNCSHARD_COLLECTIVE_TIMEOUT_S``, ``fs.init(timeout_s=...)``.

    Raises:
        ValueError: ``FUNCSHARD_COLLECTIVE_TIMEOUT_S`` is not a positive number of seconds.
    """
    if _explicit_timeout_s is not _UNSET:
        return _explicit_timeout_s
    env = setting(TIMEOUT_ENV).strip()
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
    that never block the host] in ``collectives.py``).

    Example:
        >>> set_collective_timeout(30.0)
        >>> wait_timeout_s("gloo"), wait_timeout_s("nccl"), wait_timeout_s("fake")
        (30.0, None, None)
        >>> set_collective_timeout(None)
    """
    return collective_timeout() if backend == "gloo" else None


def wait_work(work: Any, timeout: Timeout, /) -> None:
    """Waits for a ``torch.distributed`` work handle, with ``timeout`` when given.

    Example:
        >>> class Work:
        ...     def wait(self, **kwargs):
        ...         print(kwargs)
        >>> wait_work(Work(), None)
        {}
    """
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout=timeout)


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
    return setting(DEBUG_ENV) not in ("", "0")


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


def backend() -> str | None:
    """The default process group's backend (``"gloo"``, ``"nccl"``, ...); ``None`` outside a distributed run."""
    return str(dist.get_backend()) if is_distributed() else None


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
