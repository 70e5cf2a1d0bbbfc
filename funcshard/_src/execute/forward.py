"""``fs.forward``: evaluation over sharded params, with no gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from funcshard._src.execute.value_and_grad import Step
from funcshard._src.plan.plan import Plan
from funcshard._src.plan.precision import FULL_PRECISION, MixedPrecision


def forward(
    fn: Callable[..., Any],
    plan: Plan,
    /,
    *,
    mixed_precision: MixedPrecision | None = None,
    prefetch: int = 1,
    bucket_bytes: int | None = None,
) -> Callable[..., Any]:
    """An evaluation ``evaluate(sparams, *args, **kwargs) -> fn(params, *args, **kwargs)``, no gradients.

    For validation loss, metrics and generation over sharded params: the step's
    forward (:meth:`Step.forward`) with each unit gathered once just before its
    ``fs.call`` and freed right after, under ``torch.no_grad``. Gathered
    parameters alive at once are at most the root unit plus ``1 + prefetch`` units
    (or buckets of units, see ``bucket_bytes``);
    no activations are kept and nothing is gathered again. Every rank calls it
    (collective), with its own inputs.

    Args:
        fn: ``fn(params, *args, **kwargs)``, a pure function like a step's ``loss_fn``
            (it may return anything: logits, a loss, a tuple).
        plan: the plan the params were sharded with.
        mixed_precision: compute dtypes, as for a step.
        prefetch: units whose all-gather starts ahead of use.
        bucket_bytes: small consecutive units gathered together, as for
            :func:`funcshard.value_and_grad`.

    Returns:
        ``evaluate(sparams, *args, **kwargs)``, returning what ``fn`` returns.

    Example:
        >>> import torch, funcshard as fs
        >>> params = {"w": torch.ones(3)}
        >>> plan = fs.plan(params, fs.Mesh({"fsdp": 1}))
        >>> evaluate = fs.forward(lambda p, x: (p["w"] * x).sum(), plan)
        >>> evaluate(fs.shard(params, plan), torch.arange(3.0))
        tensor(3.)
    """
    step = Step(
        fn,
        plan,
        has_aux=False,
        mixed_precision=mixed_precision or FULL_PRECISION,
        prefetch=prefetch,
        bucket_bytes=bucket_bytes,
    )
    return step.forward
