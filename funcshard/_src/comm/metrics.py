"""Metrics over every rank: the mean of a per-rank number (a loss, a count), for logs."""

from __future__ import annotations

from typing import Any

import torch

from funcshard._src import tree
from funcshard._src.comm import agree, runtime, settle

_PER_AGREEMENT = 4  # floats that one agreement carries


def mean_over_ranks(value: Any, /) -> Any:
    """The mean over every rank of a per-rank metric: a number, a 0-d tensor, or a tree of them.

    For logs: each rank's loss is of its own batch, so rank 0's alone reads as
    noise. Every leaf is averaged in float64, in rank order, so every rank gets
    the same result; a number comes back as a float, a tensor as a 0-d tensor of
    its dtype on its device. One process (no ``fs.init``): the value itself.
    Collective: every rank calls it with a tree of the same structure, else
    :class:`DesyncError` on every rank.

    Args:
        value: a Python number, a one-element tensor, or a pytree of them (a dict of metrics).

    Returns:
        ``value``'s structure with the means.

    Raises:
        ValueError: a leaf that is neither a number nor a one-element tensor (the
            message names its path).
        DesyncError: the ranks called it with different trees, or called other operations.

    Example:
        >>> import funcshard as fs, torch
        >>> fs.mean_over_ranks({"loss": torch.tensor(2.5), "tokens": 512})
        {'loss': tensor(2.5000), 'tokens': 512.0}
    """
    paths, leaves, treedef = tree.flatten_with_paths(value)
    numbers: list[float] = []
    for path, leaf in zip(paths, leaves):
        if isinstance(leaf, torch.Tensor) and leaf.numel() == 1 and not leaf.is_complex():
            numbers.append(float(leaf.detach().reshape(())))
        elif isinstance(leaf, (int, float)) and not isinstance(leaf, bool):
            numbers.append(float(leaf))
        else:
            raise ValueError(
                f"mean_over_ranks: {path or '<root>'} is {_describe(leaf)}; pass numbers or "
                f"one-element tensors (a metric per rank), e.g. float(loss)"
            )
    world = runtime.world_size()
    what = f"mean_over_ranks of {len(numbers)} value(s) {paths[:4]}"
    totals: list[float] = []
    with settle.operation("mean_over_ranks"):
        for start in range(0, max(1, len(numbers)), _PER_AGREEMENT):
            totals += agree.sum_over_ranks(numbers[start : start + _PER_AGREEMENT], what)
    means = [t / world for t in totals]
    return tree.unflatten(treedef, [_like(leaf, m) for leaf, m in zip(leaves, means)])


def _like(leaf: Any, mean: float) -> Any:
    """``mean`` as a float, or as a 0-d tensor on ``leaf``'s device (of its dtype if floating)."""
    if not isinstance(leaf, torch.Tensor):
        return mean
    dtype = leaf.dtype if leaf.is_floating_point() else torch.get_default_dtype()
    return torch.tensor(mean, dtype=dtype, device=leaf.device)


def _describe(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        return f"a tensor of shape {list(leaf.shape)}"
    return f"a {type(leaf).__name__}"
