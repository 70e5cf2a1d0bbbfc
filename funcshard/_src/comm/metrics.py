"""Metrics over every rank: the mean of a per-rank number (a loss, a count), and a logging hook."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from funcshard._src import tree
from funcshard._src.comm import channel, runtime, settle

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
        number = _as_float(leaf)
        if number is None:
            raise ValueError(
                f"mean_over_ranks: {path or '<root>'} is {_describe(leaf)}; pass numbers or "
                f"one-element tensors (a metric per rank), e.g. float(loss)"
            )
        numbers.append(number)
    world = runtime.world_size()
    what = f"mean_over_ranks of {len(numbers)} value(s) {paths[:4]}"
    totals: list[float] = []
    with settle.operation("mean_over_ranks"):
        for start in range(0, max(1, len(numbers)), _PER_AGREEMENT):
            totals += channel.sum_over_ranks(numbers[start : start + _PER_AGREEMENT], what)
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


class MetricLogger:
    """Averages per-rank metrics over ranks and steps, and hands them to callbacks on rank 0.

    A logging hook for a training loop: call :meth:`log` every step on every
    rank. Between emits it only sums locally, on the metrics' device: a tensor
    is read (``float()``, a host sync on a GPU) only on the steps that emit. Every ``every`` steps it averages
    each metric over those steps and over every rank (one agreement, as
    :func:`mean_over_ranks`), calls each ``callback(step, means)`` on rank 0
    (print, ``wandb.log``, a TensorBoard writer) and appends ``{"step": step,
    ...}`` as a JSON line to ``jsonl`` (rank 0). Collective on the steps that
    emit: every rank logs the same steps and names.

    Args:
        *callbacks: functions ``(step, means)`` run on rank 0 at every emit.
        every: emit every this many calls (>= 1).
        jsonl: a file rank 0 appends one JSON object per emit to.

    Example:
        >>> import funcshard as fs, torch
        >>> logger = fs.MetricLogger(lambda step, m: print(step, m), every=2)
        >>> logger.log(1, {"loss": torch.tensor(3.0)})
        >>> logger.log(2, {"loss": torch.tensor(1.0), "tokens": 512})
        2 {'loss': 2.0, 'tokens': 512.0}
        {'loss': 2.0, 'tokens': 512.0}
    """

    def __init__(
        self,
        *callbacks: Callable[[int, dict[str, float]], object],
        every: int = 1,
        jsonl: str | os.PathLike[str] | None = None,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"MetricLogger: every must be an integer >= 1, got {every!r}")
        for i, callback in enumerate(callbacks):
            if not callable(callback):
                raise TypeError(
                    f"MetricLogger: callback {i} is a {type(callback).__name__}; pass functions "
                    f"(step, metrics) -> None"
                )
        self.callbacks = callbacks
        self.every = every
        self.jsonl = None if jsonl is None else Path(jsonl)
        self._sums: dict[str, float | torch.Tensor] = {}  # float64, on the metric's device
        self._counts: dict[str, int] = {}
        self._calls = 0

    def log(self, step: int, metrics: Mapping[str, Any], /) -> dict[str, float] | None:
        """Adds this step's ``metrics``; on an emit step returns the means (on every rank), else ``None``.

        Raises:
            ValueError: a metric that is not a number or a one-element tensor.
            DesyncError: on an emit step, ranks that logged other names.
        """
        for name, value in metrics.items():
            number = _number(name, value)
            self._sums[name] = self._sums.get(name, 0.0) + number  # a new tensor: no alias
            self._counts[name] = self._counts.get(name, 0) + 1
        self._calls += 1
        if self._calls % self.every:
            return None
        return self.flush(step)

    def flush(self, step: int, /) -> dict[str, float] | None:
        """Emits what was logged since the last emit now (e.g. at the end of a run); collective."""
        if not self._sums:
            return None
        # float64 sums in call order, read once: the same values as adding floats
        window = {name: float(self._sums[name]) / self._counts[name] for name in sorted(self._sums)}
        self._sums.clear()
        self._counts.clear()
        means: dict[str, float] = mean_over_ranks(window)
        if runtime.rank() == 0:
            for callback in self.callbacks:
                callback(step, dict(means))
            if self.jsonl is not None:
                with self.jsonl.open("a") as f:
                    f.write(json.dumps({"step": step, **means}) + "\n")
        return means


def _number(name: str, value: Any) -> float | torch.Tensor:
    """``value`` as a float, or as a 0-d float64 tensor on its device (not read: no host sync)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return value.detach().reshape(()).to(torch.float64)
    number = _as_float(value)
    if number is None:
        raise ValueError(
            f"MetricLogger: metric {name!r} is {_describe(value)}; log numbers or one-element "
            f"tensors, e.g. float(loss)"
        )
    return number


def _as_float(value: Any) -> float | None:
    """A number or one-element real tensor as a float; ``None`` for anything else."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return float(value.detach().reshape(()))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None
