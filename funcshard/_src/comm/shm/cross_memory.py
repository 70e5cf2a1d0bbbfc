"""Reading a peer process's memory with one copy: Linux's ``process_vm_readv`` (cross-memory attach).

[Note: shards read in place]
An all-gather through shared memory (``shm/__init__.py``) copies the rank's shard into a
region, and each peer copies it out again: two copies of every shard, on top of
the copy of the rank's own row into its gathered storage. Where the kernel lets
ranks read each other's memory (``process_vm_readv``, which MPI libraries use for
large messages on one host), a peer instead reads the shard straight from the
owner's tensor into its own storage: one copy, made by the kernel, and no region.

That is safe only while the owner neither frees nor writes the tensor, so:

- only collectives whose caller declares its input *stable* publish it this way:
  the executor's gathers of a unit's shard (or of its cast copy), which nothing
  writes during an evaluation; staging buffers from a pool never are;
- the arena keeps a reference to each tensor published so until every peer's
  read mark passes it (``regions.py``, [Note: read marks]), so it is not freed;
- an evaluation returns to the caller, who may then update the shards in place
  (an optimizer step), only once every peer has read what it published
  (``Arena.settle``). In training this is already so when the step's last
  reduction is in, since every peer gathered each unit before reducing it; an
  evaluation alone may wait for a slower peer to finish its last gather.

The ranks agree on it with the shared-memory probe (``regions.py``): each reads
its peers' probe pages this way, and all use it only if all can and their read
marks are shared live (x86). Containers or hosts whose ptrace policy forbids the
call (Yama's ``ptrace_scope`` 1 between sibling processes, a seccomp filter) keep
the regions. ``FUNCSHARD_SHM_READV=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from typing import Any

import torch

from funcshard._src.comm.runtime import CollectiveError

ENV = "FUNCSHARD_SHM_READV"


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _bind() -> Any:
    """libc's ``process_vm_readv``, or ``None`` where there is none."""
    if not hasattr(os, "memfd_create"):  # Linux only
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        call = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    vec = ctypes.POINTER(_IoVec)
    call.argtypes = [ctypes.c_int, vec, ctypes.c_ulong, vec, ctypes.c_ulong, ctypes.c_ulong]
    call.restype = ctypes.c_ssize_t
    return call


_READV = _bind()


def offered() -> bool:
    """Whether this rank offers to read its peers' memory: the call exists and ``FUNCSHARD_SHM_READV`` is not ``0``.

    Example:
        >>> isinstance(offered(), bool)
        True
    """
    return _READV is not None and os.environ.get(ENV, "1").strip() != "0"


def read(pid: int, address: int, targets: list[tuple[int, torch.Tensor]], /) -> None:
    """Copies process ``pid``'s bytes at ``address + offset`` into each ``(offset, target)``; mutates the targets.

    Each target is a contiguous CPU tensor; the bytes it receives are its size.

    Raises:
        CollectiveError: the read failed or came back short (the peer exited, or
            the ranks are out of step).
    """
    if _READV is None:
        raise CollectiveError("process_vm_readv is not available on this host")
    n = len(targets)
    local, remote = (_IoVec * n)(), (_IoVec * n)()
    total = 0
    for i, (offset, target) in enumerate(targets):
        nbytes = target.numel() * target.element_size()
        local[i].base, local[i].len = target.data_ptr(), nbytes
        remote[i].base, remote[i].len = address + offset, nbytes
        total += nbytes
    done = _READV(pid, local, n, remote, n, 0) if total else 0
    if done != total:
        code = ctypes.get_errno() if done < 0 else 0
        why = errno.errorcode.get(code, str(code)) if code else f"{done} of {total} bytes"
        raise CollectiveError(
            f"reading rank process {pid}'s shard failed ({why}): the peer exited or the "
            f"ranks are out of step"
        )


def probe(pid: int, address: int, expected: int, /) -> bool:
    """Whether this rank can read ``pid``'s int64 at ``address`` and finds ``expected`` there."""
    got = torch.zeros(1, dtype=torch.int64)
    try:
        read(pid, address, [(0, got)])
    except CollectiveError:
        return False
    return int(got[0]) == expected
