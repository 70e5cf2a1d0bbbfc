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
    a file can never reach any other attribute.

    Example:
        >>> dtype_of("float32"), dtype_of("load")
        (torch.float32, None)
    """
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    return dtype if isinstance(dtype, torch.dtype) else None
