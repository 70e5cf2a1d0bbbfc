"""Host (NumPy) arrays as tensors, ``ml_dtypes`` ones (bfloat16, float8) included."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

# ml_dtypes types, which torch.from_numpy does not know: viewed through an integer of their width
_VIEWED: dict[str, tuple[str, torch.dtype]] = {
    "bfloat16": ("uint16", torch.bfloat16),
    "float8_e4m3fn": ("uint8", torch.float8_e4m3fn),
    "float8_e5m2": ("uint8", torch.float8_e5m2),
}


def torch_dtype(dtype: np.dtype[Any], /) -> torch.dtype:
    """The torch dtype of a NumPy (or ``ml_dtypes``) dtype.

    Example:
        >>> torch_dtype(np.dtype("float32"))
        torch.float32
    """
    if dtype.name in _VIEWED:
        return _VIEWED[dtype.name][1]
    return torch.from_numpy(np.zeros((), dtype)).dtype


def tensor_from_numpy(array: np.ndarray[Any, Any], /) -> torch.Tensor:
    """A tensor sharing the memory of ``array`` (of a C-contiguous copy if it is strided).

    Example:
        >>> tensor_from_numpy(np.arange(3, dtype=np.int32))
        tensor([0, 1, 2], dtype=torch.int32)
    """
    array = np.ascontiguousarray(array)
    if array.dtype.name in _VIEWED:
        bits, dtype = _VIEWED[array.dtype.name]
        return torch.from_numpy(array.view(bits)).view(dtype)
    return torch.from_numpy(array)
