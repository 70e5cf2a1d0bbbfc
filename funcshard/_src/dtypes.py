"""Dtypes by name, as plans, manifests and reports write them: ``torch.bfloat16`` is ``"bfloat16"``."""

from __future__ import annotations

import torch


def dtype_name(dtype: torch.dtype, /) -> str:
    """The name a file or report gives ``dtype``.

    Example:
        >>> dtype_name(torch.bfloat16)
        'bfloat16'
    """
    return str(dtype).removeprefix("torch.")


def dtype_of(name: object, /) -> torch.dtype | None:
    """The ``torch.dtype`` called ``name``, or ``None`` if ``name`` is no dtype's name.

    Only attribute names of ``torch`` that are dtypes count, so a name read from
    a file can never reach any other attribute; they are looked up in ``vars(torch)``,
    never through ``getattr``, which would import the lazy submodules it names.

    Example:
        >>> dtype_of("float32"), dtype_of("load")
        (torch.float32, None)
    """
    dtype = vars(torch).get(name) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) else None


MAX_ELEMENTS = 1 << 50  # elements of one tensor a file may declare (8 PiB of float64)
_INTEGERS = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_INTEGERS += (torch.uint16, torch.uint32, torch.uint64)


def plain_dtype(dtype: torch.dtype, /) -> bool:
    """Whether a file may declare ``dtype``: not quantized, no sub-byte or bits type.

    Example:
        >>> plain_dtype(torch.bfloat16), plain_dtype(torch.quint4x2), plain_dtype(torch.bits8)
        (True, False, False)
    """
    return (dtype.is_floating_point or dtype.is_complex or dtype in _INTEGERS) and (
        dtype.itemsize >= 1 and "bits" not in str(dtype) and "float4" not in str(dtype)
    )
