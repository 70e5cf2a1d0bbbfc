"""Helpers for testing sharded training against a single-process, unsharded reference."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from funcshard._src import tree
from funcshard._src.execute.reference import plain
from funcshard._src.shard.sharded import held_bytes as held_bytes

__all__ = ["assert_trees_close", "held_bytes", "reference_value_and_grad"]


def reference_value_and_grad(
    loss_fn: Callable[..., Any], params: Any, batches: Sequence[tuple[Any, ...]], /
) -> tuple[torch.Tensor, Any]:
    """The unsharded reference: mean loss and mean gradients over ``batches``, in one process.

    ``loss_fn`` is the same pure function a sharded step runs: ``fs.call`` is a
    plain call, and a functionalized module runs as plain PyTorch with the leaves
    bound to its names (see [Note: plain references] in
    ``funcshard/_src/execute/reference.py``). Gradients by autograd, so models with
    activation checkpoints or hooks have a reference too. With one batch per rank,
    this is what :func:`funcshard.value_and_grad` must return as the mean over ranks.

    Args:
        loss_fn: ``loss_fn(params, *batch)`` returning a scalar loss.
        params: the full params pytree.
        batches: one argument tuple per rank (or micro-batch).

    Returns:
        ``(mean loss, mean grads)``, the grads a pytree like ``params``.

    Example:
        >>> params = {"w": torch.tensor([1.0, 2.0])}
        >>> loss, grads = reference_value_and_grad(lambda p, x: (p["w"] * x).sum(), params, [(torch.ones(2),), (3 * torch.ones(2),)])
        >>> loss, grads["w"]
        (tensor(6.), tensor([2., 2.]))
    """
    if not batches:
        raise ValueError("reference_value_and_grad: give at least one batch")

    leaves, treedef = tree.flatten(params)
    diff = [x.detach().clone().requires_grad_() if x.is_floating_point() else x for x in leaves]
    trained = any(x.requires_grad for x in diff)
    with plain(), torch.enable_grad():
        p = tree.unflatten(treedef, diff)
        loss = torch.stack([loss_fn(p, *batch).reshape(()) for batch in batches]).mean()
        if trained:  # backward(), not autograd.grad: a reentrant checkpoint allows only that
            loss.backward()
    out = [x.grad if x.requires_grad and x.grad is not None else torch.zeros_like(x) for x in diff]
    return loss.detach(), tree.unflatten(treedef, out)


def assert_trees_close(
    actual: Any, expected: Any, /, *, rtol: float = 1e-5, atol: float = 1e-6
) -> None:
    """Asserts two pytrees have the same structure and close leaves; the error names the path.

    Raises:
        AssertionError: a structure, shape, dtype or value mismatch, naming the first leaf path
            that differs and its largest absolute difference.

    Example:
        >>> assert_trees_close({"a": torch.ones(2)}, {"a": torch.ones(2) + 1e-8})
        >>> assert_trees_close({"a": torch.ones(2)}, {"a": torch.zeros(2)})
        Traceback (most recent call last):
        ...
        AssertionError: a: values differ (largest difference 1, rtol 1e-05, atol 1e-06)
    """
    paths_a, leaves_a, def_a = tree.flatten_with_paths(actual)
    _, leaves_b, def_b = tree.flatten_with_paths(expected)
    if def_a != def_b:
        raise AssertionError(f"tree structures differ: {def_a} vs {def_b}")
    for path, a, b in zip(paths_a, leaves_a, leaves_b):
        where = path or "<root>"
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            if a != b:
                raise AssertionError(f"{where}: {a!r} != {b!r}")
            continue
        if a.shape != b.shape:
            raise AssertionError(f"{where}: shape {tuple(a.shape)} != {tuple(b.shape)}")
        if a.dtype != b.dtype:
            raise AssertionError(f"{where}: dtype {a.dtype} != {b.dtype}")
        if not torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True):
            diff = (a.double() - b.double()).abs().max().item()
            raise AssertionError(
                f"{where}: values differ (largest difference {diff:.3g}, rtol {rtol}, atol {atol})"
            )
