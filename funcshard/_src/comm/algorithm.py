"""Collective algorithms chosen by name: what ``reduce_scatter.py`` and ``all_gather.py`` share.

Each module lists its algorithms in a :class:`Choices` and reads its default from an
environment variable (which every rank agrees on before its first collective:
``preflight.py``); :func:`resolve` and :func:`fallback` are the one rule by which
``"auto"`` and ``"shm"`` become the algorithm that runs; the handles they return
wait on ``torch.distributed`` work with or without a timeout.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from funcshard._src.comm import runtime

Timeout = datetime.timedelta | None


def wait_work(work: Any, timeout: Timeout, /) -> None:
    """Waits for a ``torch.distributed`` work handle, with ``timeout`` when given."""
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout=timeout)


def check_known(algorithm: str, known: Sequence[str], what: str, /) -> None:
    """Refuses an ``algorithm`` that is not in ``known`` (``what``: "all-gather", ...).

    Example:
        >>> check_known("tree", ("auto", "ring"), "all-gather")
        Traceback (most recent call last):
        ...
        ValueError: all-gather algorithm 'tree' is unknown; use one of ['auto', 'ring']
    """
    if algorithm not in known:
        raise ValueError(f"{what} algorithm {algorithm!r} is unknown; use one of {list(known)}")


def from_env(env: str, known: Sequence[str], what: str, /) -> str:
    """The algorithm the environment variable ``env`` names, else ``"auto"``.

    Raises:
        ValueError: ``env`` names no algorithm of ``known``.

    Example:
        >>> from_env("FUNCSHARD_NOT_SET_ANYWHERE", ("auto", "ring"), "all-gather")
        'auto'
    """
    value = runtime.setting(env, "auto")  # [Note: settings held through a step] in comm/runtime.py
    if value not in known:
        article = "an" if what[0] in "aeiou" else "a"
        raise ValueError(
            f"{env}={value!r} is not {article} {what} algorithm; use one of {list(known)}"
        )
    return value


@dataclass(frozen=True)
class Choices:
    """One collective's algorithms, and the socket algorithms gloo runs where memory is not shared.

    Attributes:
        what: the collective, for messages (``"all-gather"``).
        known: every algorithm name, ``"auto"``, ``"native"`` and ``"shm"`` among them.
        ring: the pairwise exchange, chosen for two ranks and at least ``ring_min_bytes``.
        socket: the socket algorithm chosen otherwise.
        ring_min_bytes: bytes of the whole collective from which ``ring`` is chosen.
        shm_fallback: what ``"shm"`` runs where the ranks cannot share memory (``None``:
            what ``"auto"`` would).
    """

    what: str
    known: tuple[str, ...]
    ring: str
    socket: str
    ring_min_bytes: int
    shm_fallback: str | None = None


def resolve(
    choices: Choices, algorithm: str, backend: str, world_size: int, nbytes: int, shared: bool, /
) -> str:
    """The algorithm that runs for ``algorithm`` on ``backend`` (never ``"auto"``).

    Anything but gloo runs ``"native"``; on gloo, ``"auto"`` runs ``"shm"`` where
    ``shared`` (the transport is enabled and worth it at ``nbytes``), else
    :func:`fallback`'s choice; a named algorithm runs as itself.

    Raises:
        ValueError: ``algorithm`` is not one of ``choices.known``.

    Example:
        >>> c = Choices("all-gather", ("auto", "native", "ring", "shm"), "ring", "native", 8)
        >>> [resolve(c, "auto", "gloo", 2, n, False) for n in (4, 8)], resolve(c, "auto", "gloo", 2, 8, True)
        (['native', 'ring'], 'shm')
    """
    check_known(algorithm, choices.known, choices.what)
    if backend != "gloo":
        return "native"
    if algorithm != "auto":
        return algorithm
    return "shm" if shared else fallback(choices, "auto", world_size, nbytes)


def fallback(choices: Choices, algorithm: str, world_size: int, nbytes: int, /) -> str:
    """The socket algorithm that runs on gloo for ``algorithm`` where the ranks cannot share memory.

    ``"auto"`` (and ``"shm"`` without a ``shm_fallback`` of its own) runs ``ring``
    for two ranks and at least ``ring_min_bytes``, ``socket`` otherwise; any other
    algorithm runs as itself.

    Example:
        >>> c = Choices("all-gather", ("auto", "native", "ring", "shm"), "ring", "native", 8)
        >>> fallback(c, "auto", 2, 8), fallback(c, "auto", 4, 8), fallback(c, "ring", 4, 1)
        ('ring', 'native', 'ring')
    """
    if algorithm == "shm" and choices.shm_fallback is not None:
        return choices.shm_fallback
    if algorithm not in ("auto", "shm"):
        return algorithm
    return choices.ring if world_size == 2 and nbytes >= choices.ring_min_bytes else choices.socket
