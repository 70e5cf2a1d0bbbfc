"""Mixed precision: the dtypes a unit is gathered and computed in, and reduced in."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from funcshard._src.dtypes import dtype_name


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes for compute and communication; master parameters and optimizer state keep theirs.

    Only floating-point leaves are cast. ``None`` means "the dtype it already has":
    ``reduce_dtype=None`` reduces in ``param_dtype``, as FSDP does.

    Args:
        param_dtype: gather (all-gather) and compute in this dtype.
        reduce_dtype: reduce-scatter and all-reduce gradients in this dtype.
        output_dtype: cast the floating-point outputs of every ``fs.call`` to this dtype.

    Example:
        >>> mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        >>> mp.compute_dtype(torch.float32), mp.gradient_dtype(torch.float32), mp.compute_dtype(torch.int64)
        (torch.bfloat16, torch.float32, torch.int64)
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value: object = getattr(self, name)
            if value is not None and not (
                isinstance(value, torch.dtype) and value.is_floating_point
            ):
                raise TypeError(
                    f"MixedPrecision.{name} must be a floating torch.dtype or None, got {value!r}"
                )

    def compute_dtype(self, stored: torch.dtype, /) -> torch.dtype:
        """The dtype a leaf stored as ``stored`` is gathered and computed in."""
        return (
            self.param_dtype
            if self.param_dtype is not None and stored.is_floating_point
            else stored
        )

    def gradient_dtype(self, stored: torch.dtype, /) -> torch.dtype:
        """The dtype gradients of a leaf stored as ``stored`` are reduced in."""
        if self.reduce_dtype is not None and stored.is_floating_point:
            return self.reduce_dtype
        return self.compute_dtype(stored)


FULL_PRECISION = MixedPrecision()


def describe_precision(mp: MixedPrecision | None, /) -> str:
    """How a cost model's mixed precision reads in an estimate's assumptions.

    Example:
        >>> describe_precision(MixedPrecision(param_dtype=torch.bfloat16))
        'compute bfloat16, reduce stored'
    """
    if mp is None or mp == FULL_PRECISION:
        return "none (compute and reduce in the stored dtypes)"

    def name(dtype: torch.dtype | None) -> str:
        return "stored" if dtype is None else dtype_name(dtype)

    return f"compute {name(mp.param_dtype)}, reduce {name(mp.reduce_dtype)}"
