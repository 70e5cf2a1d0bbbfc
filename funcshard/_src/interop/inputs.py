"""Under mixed precision, a functionalized module's floating-point inputs compute in ``param_dtype``.

As FSDP2's ``MixedPrecisionPolicy(cast_forward_inputs=True)`` (its default) does at
every ``fully_shard``-ed module: in a step with ``MixedPrecision(param_dtype=...)``,
``apply`` casts the floating-point tensors among the module's arguments, and each
unit's call among the unit's, to ``param_dtype``. The cast is part of the graph,
so gradients flow back in the inputs' own dtype. Outside a step, or without a
``param_dtype``, the arguments pass unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from funcshard._src import tree
from funcshard._src.execute.run import current_run, step_run

__all__ = ["cast_inputs"]


def cast_inputs(
    args: tuple[Any, ...], kwargs: dict[str, Any], /
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with floating-point tensors in the step's ``param_dtype``.

    Example:
        >>> cast_inputs((torch.ones(1),), {})  # outside a step: unchanged
        ((tensor([1.]),), {})
    """
    run = current_run() or step_run()  # a recompute in backward casts as forward did
    dtype = None if run is None else run.param_dtype
    if dtype is None:
        return args, kwargs

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree.tree_map(cast, args), tree.tree_map(cast, kwargs)
