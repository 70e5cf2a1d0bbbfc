"""Large gathered storages on transparent huge pages, where Linux offers them on request.

[Note: huge pages for gathered storage]
A unit's gathered storage is given back when the unit is freed and allocated again
at its next gather ([Note: persistent gathered storage] in ``unit_state.py``). An
allocation as large as a root unit's embeddings (tens to hundreds of MiB) is a
fresh mapping under glibc, whose every 4 KiB page the gather then faults in: on
the benchmark machine 163 MiB took 69 ms to fill fresh against 27 ms warm. Linux
set to give transparent huge pages on request (``madvise`` in
``/sys/kernel/mm/transparent_hugepage/enabled``, the common default) faults such a
range in 2 MiB at a time when asked (``MADV_HUGEPAGE``): 36 ms. The storage is
written whole by its gather, so huge pages hold no byte more than it uses, and
they go back with it. Only CPU storages of at least ``MIN_BYTES`` are advised;
where the call is missing or refused nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Any

import torch

MIN_BYTES = 8 << 20
_HUGE = 2 << 20
_MADV_HUGEPAGE = 14


def _bind() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    call.restype = ctypes.c_int
    return call


_MADVISE = _bind()


def advise(storage: torch.Tensor, /) -> bool:
    """Asks for huge pages under the whole 2 MiB pages of ``storage``'s memory; whether it was asked.

    Call it before the memory is first written. A refusal (no THP, another OS)
    changes nothing.

    Example:
        >>> advise(torch.empty(4))  # too small to ask
        False
    """
    nbytes = storage.numel() * storage.element_size()
    if _MADVISE is None or storage.device.type != "cpu" or nbytes < MIN_BYTES:
        return False
    start = storage.data_ptr()
    lo = -(-start // _HUGE) * _HUGE
    hi = (start + nbytes) // _HUGE * _HUGE
    return hi > lo and _MADVISE(lo, hi - lo, _MADV_HUGEPAGE) == 0
