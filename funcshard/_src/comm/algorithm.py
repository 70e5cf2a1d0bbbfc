"""Collective algorithms chosen by name: what ``reduce_scatter.py`` and ``all_gather.py`` share.

Each module lists its algorithms, resolves ``"auto"`` by backend and size, and
reads its default from an environment variable (which every rank agrees on before
its first collective: ``preflight.py``); the handles they return wait on
``torch.distributed`` work with or without a timeout.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from typing import Any

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
    value = os.environ.get(env, "auto")
    if value not in known:
        article = "an" if what[0] in "aeiou" else "a"
        raise ValueError(
            f"{env}={value!r} is not {article} {what} algorithm; use one of {list(known)}"
        )
    return value
