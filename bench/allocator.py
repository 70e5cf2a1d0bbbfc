"""The allocator a run's ranks use: glibc's default, or a fixed mmap threshold.

``default`` is what a user's training job gets: glibc's malloc with its dynamic
mmap threshold, which rises as large blocks are freed, so freed memory may
stay in the heap and peak RSS depends on the order of frees. The headline step
times come from it. ``mmap`` sets ``MALLOC_MMAP_THRESHOLD_=65536``: every block
of 64 KiB or more is its own mapping, returned to the system when freed, so
peak RSS is reproducible from run to run (and step times pay for the page
faults). ``--malloc both`` runs every mode under each.

A spawned rank gets the setting from its environment, as the threshold must be
set when glibc starts; the variable is removed from the environment of a
``default`` run. A rank forked from ``--tiny``'s server (which always starts
without it) sets the same threshold with ``mallopt``, which is what glibc does
with the variable.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

ENV = "MALLOC_MMAP_THRESHOLD_"
MMAP_THRESHOLD = 65536
ALLOCATORS = ("default", "mmap")
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def passes(choice: str) -> tuple[str, ...]:
    """The allocators ``--malloc choice`` runs every mode under, in order.

    >>> passes("both"), passes("mmap")
    (('default', 'mmap'), ('mmap',))
    """
    if choice == "both":
        return ALLOCATORS
    if choice not in ALLOCATORS:
        raise ValueError(f"--malloc {choice!r}: choose from {[*ALLOCATORS, 'both']}")
    return (choice,)


@contextlib.contextmanager
def environment(allocator: str) -> Iterator[None]:
    """Sets (``mmap``) or removes (``default``) the variable in ``os.environ`` while active.

    Processes started inside inherit it; the previous value comes back after.
    """
    before = os.environ.get(ENV)
    if allocator == "mmap":
        os.environ[ENV] = str(MMAP_THRESHOLD)
    else:
        os.environ.pop(ENV, None)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before


def apply(allocator: str) -> str | None:
    """In a rank: makes this process use ``allocator``; returns how it is set.

    Returns:
        ``"environment"`` (the process started with the variable), ``"mallopt"``
        (a forked rank set it now) or ``None`` (``default``: glibc's own).

    Raises:
        RuntimeError: a ``default`` rank inherited the variable, or ``mallopt`` failed.
    """
    value = os.environ.get(ENV)
    if allocator == "default":
        if value is not None:
            raise RuntimeError(f"a default-allocator rank inherited {ENV}={value}; unset it")
        return None
    if value == str(MMAP_THRESHOLD):
        return "environment"
    if not ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        raise RuntimeError(f"mallopt(M_MMAP_THRESHOLD, {MMAP_THRESHOLD}) failed: is this glibc?")
    os.environ[ENV] = str(MMAP_THRESHOLD)  # what this rank's own children would inherit
    return "mallopt"
