"""``fs.verify``: a few steps of a configuration, sharded and unsharded on the same ranks, compared per leaf."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from funcshard._src import tree
from funcshard._src.comm import channel, groups, runtime
from funcshard._src.comm.runtime import CollectiveError, DesyncError
from funcshard._src.dtypes import dtype_name
from funcshard._src.execute.value_and_grad import value_and_grad
from funcshard._src.optim.base import Optimizer
from funcshard._src.optim.sgd import sgd
from funcshard._src.plan.cost import estimate
from funcshard._src.plan.cost_model import CostModel
from funcshard._src.plan.plan import Plan
from funcshard._src.plan.precision import FULL_PRECISION, MixedPrecision
from funcshard._src.shard.flat import piece_indices
from funcshard._src.shard.shard import check_params, shard
from funcshard._src.shard.sharded import ShardedTensor, flats_of, held_bytes
from funcshard._src.verify.batches import gather_batches
from funcshard._src.verify.reference import Reference, fingerprint
from funcshard._src.verify.report import VerifyReport
from funcshard._src.verify.summary import summarize

DEFAULT_LR = 1e-2  # plain SGD: small enough to stay stable, large enough that params move
FP32_TOLERANCE = (1e-4, 1e-7)  # (rtol, atol): sums in another order, over a few steps
LOW_PRECISION_TOLERANCE = (2e-2, 1e-4)  # bf16/fp16 compute or reduction: ~3 significant digits


def verify(
    loss_fn: Callable[..., Any],
    params: Any,
    plan: Plan,
    batch: Any,
    /,
    *,
    steps: int = 2,
    optimizer: Optimizer | None = None,
    mixed_precision: MixedPrecision | None = None,
    prefetch: int = 1,
    has_aux: bool = False,
    cost: CostModel | None = None,
    rtol: float | None = None,
    atol: float | None = None,
) -> VerifyReport:
    """Trains ``steps`` steps sharded and unsharded on the same ranks and compares them, per leaf.

    The first thing to run on a new model or plan. Every rank runs the sharded
    step (:func:`funcshard.value_and_grad` on ``plan``) on its own ``batch``, and
    an unsharded reference on the whole ``params``: ``torch.func`` gradients of the
    mean loss over every rank's batch, which is what the sharded gradients must
    equal. Both train with ``optimizer``. The report gives, per leaf, the largest
    gradient and parameter difference, the losses, the bytes a rank holds and
    sends against :func:`funcshard.cost.estimate`, and a verdict (``report.ok``)
    with ``report.problems``, each naming the leaf and a fix. An exception in the
    step (a unit leaf used outside :func:`funcshard.call`) is a problem, not a
    crash; so are ranks that compute different references (a ``loss_fn`` that
    depends on the rank). The reference holds the whole model on every rank:
    verify a scaled-down configuration (fewer layers, the same rules and units).
    In a distributed run ``params``, ``batch``, the shards and the reference go
    to :func:`funcshard.device` (this rank's GPU under NCCL, the CPU under gloo).
    Collective: every rank calls it, and every rank gets the same report.

    Args:
        loss_fn: ``loss_fn(params, batch)`` returning a scalar loss (``(loss, aux)``
            with ``has_aux``); deterministic, as in training without dropout.
        params: the whole params pytree that ``plan`` was made for, equal on every rank.
        plan: the plan to verify (its mesh's size is the world size).
        batch: this rank's batch (any pytree of tensors and numbers).
        steps: optimizer steps to run and compare (at least 1).
        optimizer: default ``fs.optim.sgd(lr=1e-2)``; any optimizer that updates
            each element on its own (SGD, AdamW).
        mixed_precision: as for :func:`funcshard.value_and_grad`; the reference
            computes in ``param_dtype`` too.
        prefetch: as for :func:`funcshard.value_and_grad`.
        has_aux: ``loss_fn`` returns ``(loss, aux)``.
        cost: the cost model to compare memory and bytes sent with; default: SGD
            (the default optimizer), ``mixed_precision`` and ``prefetch``. With an
            ``optimizer`` and no ``cost``, optimizer state is not compared.
        rtol: relative tolerance (to the leaf's largest reference value); default
            1e-4, or 2e-2 where a float leaf computes or reduces in 16 bits.
        atol: absolute tolerance; default 1e-7, or 1e-4 in 16 bits.

    Returns:
        A :class:`VerifyReport`; ``print(report)`` shows its tables.

    Raises:
        ValueError: ``steps < 1``, a negative tolerance, ``params`` that do not fit
            ``plan``, or a mesh whose size is not the world size.
        TypeError: ``loss_fn`` is not callable, or a leaf of ``params`` is no tensor.

    Example:
        >>> import torch, funcshard as fs
        >>> params = {"layer": {"w": torch.ones(4, 2)}, "b": torch.zeros(2)}
        >>> plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=["layer"])
        >>> def loss_fn(p, x):
        ...     h = fs.call(lambda q, x: x @ q["w"], p["layer"], x)
        ...     return (h + p["b"]).square().mean()
        >>> report = fs.verify(loss_fn, params, plan, torch.ones(3, 4))
        >>> report.ok, report.table().splitlines()[0]
        (True, 'fs.verify: PASS: 2 step(s) on 1 rank(s), fp32, rtol 1e-04, atol 1e-07')
        >>> wrong = fs.verify(lambda p, x: (x @ p["layer"]["w"]).mean(), params, plan, torch.ones(3, 4))
        >>> wrong.ok, wrong.problems[0]  # doctest: +ELLIPSIS
        (False, "layer/w: ... on a sharded leaf of unit 'layer'. Inside loss_fn, use unit leaves through fs.call...")
    """
    if not callable(loss_fn):
        raise TypeError(f"fs.verify: loss_fn must be callable, got a {type(loss_fn).__name__}")
    if not isinstance(plan, Plan):
        raise TypeError(
            f"fs.verify: plan must be an fs.Plan (from fs.plan), got {type(plan).__name__}"
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(
            f"fs.verify: steps must be a whole number >= 1 (optimizer steps to compare), got {steps!r}"
        )
    try:
        check_params(params, plan)
    except (ValueError, TypeError) as e:
        raise type(e)(f"fs.verify: {e}") from None
    mp = mixed_precision or FULL_PRECISION
    low = any(
        mp.compute_dtype(leaf.dtype).itemsize < 4 or mp.gradient_dtype(leaf.dtype).itemsize < 4
        for leaf in plan.leaves
        if leaf.dtype.is_floating_point
    )
    default_rtol, default_atol = LOW_PRECISION_TOLERANCE if low else FP32_TOLERANCE
    rtol = _tolerance("rtol", default_rtol if rtol is None else rtol)
    atol = _tolerance("atol", default_atol if atol is None else atol)
    model = cost or CostModel(optimizer="sgd", mixed_precision=mixed_precision, prefetch=prefetch)
    bound = groups.bind(plan.mesh)
    if runtime.backend() is not None:  # shards and batches where the backend carries them
        params, batch = (
            _onto(params, runtime.default_device()),
            _onto(batch, runtime.default_device()),
        )
    records = _measure(
        loss_fn,
        params,
        plan,
        batch,
        steps,
        optimizer or sgd(lr=DEFAULT_LR),
        mixed_precision=mp,
        prefetch=prefetch,
        has_aux=has_aux,
        rank=bound.rank,
    )
    try:
        everyone = channel.all_gather_json(records, "fs.verify: every rank's measurements")
    except (CollectiveError, DesyncError) as e:  # out of step after a failure on some ranks only
        records["problems"].append(
            f"the ranks fell out of step ({e}); the report holds this rank's measurements only"
        )
        everyone = [records]
    return summarize(
        everyone,
        plan,
        estimate(plan, model),
        optimizer_estimated=cost is not None or optimizer is None,
        precision=_precision(plan, mp),
        rtol=rtol,
        atol=atol,
    )


def _measure(
    loss_fn: Callable[..., Any],
    params: Any,
    plan: Plan,
    batch: Any,
    steps: int,
    optimizer: Optimizer,
    *,
    mixed_precision: MixedPrecision,
    prefetch: int,
    has_aux: bool,
    rank: int,
) -> dict[str, Any]:
    """This rank's record for :func:`summarize`; collective (shard, the batches, the steps)."""
    n = len(plan.leaves)
    record: dict[str, Any] = {
        "problems": [],
        "losses": [],
        "grad": [None] * n,
        "param": [None] * n,
        "fingerprint": [None] * n,
        "held": None,
        "sent": [],
        "peak": None,
    }
    problems: list[str] = record["problems"]
    try:
        sparams = shard(params, plan)  # the ranks agree that they passed equal params
        batches = gather_batches(batch, plan.mesh, device=_device(sparams))
    except DesyncError as e:  # on every rank alike: they stay in step
        problems.append(f"{e} [fs.verify: before the first step]")
        return record
    step = value_and_grad(
        loss_fn, plan, has_aux=has_aux, mixed_precision=mixed_precision, prefetch=prefetch
    )
    state = optimizer.init(sparams)
    reference: Reference | None = None
    try:
        reference = Reference(
            loss_fn, params, plan, optimizer, mixed_precision=mixed_precision, has_aux=has_aux
        )
    except Exception as e:
        problems.append(f"the unsharded reference could not start: {_said(e)}")
    prints = [[0.0] * 6 for _ in range(n)]
    for t in range(steps):
        step.ledger.reset()
        ref_loss, ref_grads, ref_problem = None, None, None
        if reference is not None:  # first: it changes no state, so the step sees what it saw
            try:
                ref_loss, ref_grads = reference.value_and_grad(batches)
            except Exception as e:  # only this rank's: the reference issues no collective
                ref_problem = f"the unsharded reference raised at step {t}: {_said(e)}"
                reference = None
        try:
            out, grads = step(sparams, batch)
        except Exception as e:  # a step that fails alike on every rank leaves them in step
            problems.append(f"{e} [the sharded step raised {type(e).__name__} at step {t}]")
            problems.extend([ref_problem] if ref_problem else [])
            break
        problems.extend([ref_problem] if ref_problem else [])
        loss = out[0] if has_aux else out
        record["sent"].append(
            {f"{op}:{','.join(axes)}": b for (op, axes), b in step.ledger.bytes_by_key.items()}
        )
        record["peak"] = max(record["peak"] or 0, step.stats.peak_gathered_bytes)
        if record["held"] is None:
            record["held"] = [held_bytes(sparams), held_bytes(grads), held_bytes(state)]
        if ref_grads is not None:
            _compare(grads, ref_grads, record["grad"], rank, plan, grads=True)
            _add(prints, ref_grads, 0)
        try:
            sparams, state = optimizer.update_(grads, state, sparams)
        except Exception as e:
            problems.append(f"the optimizer raised at step {t}: {_said(e)}")
            break
        if reference is not None and ref_grads is not None:
            try:
                reference.update_(ref_grads)
            except Exception as e:
                problems.append(
                    f"the optimizer raised on the unsharded reference at step {t}: {_said(e)}"
                )
                reference = None
            else:
                _compare(sparams, reference.params(), record["param"], rank, plan, grads=False)
        record["losses"].append(
            [float(loss.detach().float()), None if ref_loss is None else float(ref_loss)]
        )
    if reference is not None:
        _add(prints, reference.params(), 3)
        record["fingerprint"] = prints
    return record


def _compare(
    sharded: Any, full: list[torch.Tensor], into: list[Any], rank: int, plan: Plan, *, grads: bool
) -> None:
    """Folds this rank's largest ``|sharded - full|`` per leaf into ``into`` (``[diff, scale]``).

    ``sharded`` is a tree of sharded leaves (``None`` at frozen gradients); ``full``
    and ``into`` follow ``plan.leaves``. Gradients of integer leaves (zeros) are not compared.
    """
    by_path = {x.path: x for x in tree.leaves(sharded) if isinstance(x, ShardedTensor)}
    for i, (planned, whole) in enumerate(zip(plan.leaves, full)):
        leaf = by_path.get(planned.path)
        if leaf is None or (grads and not planned.trained):
            continue
        mine = torch.cat(  # what rank holds of the leaf: one box, or a flat range's boxes
            [whole[index].reshape(-1) for index in piece_indices(leaf.slot, rank)]
            or [whole.new_empty(0)]
        )
        local = leaf.local.reshape(-1)
        diff = float((local.double() - mine.double()).abs().max()) if local.numel() else 0.0
        scale = float(whole.double().abs().max()) if whole.numel() else 0.0
        before = into[i]
        if before is None:
            into[i] = [diff, scale]
        else:
            into[i] = [diff if math.isnan(diff) else max(before[0], diff), max(before[1], scale)]


def _said(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _add(prints: list[list[float]], leaves: list[torch.Tensor], at: int) -> None:
    for row, leaf in zip(prints, leaves):
        for k, v in enumerate(fingerprint(leaf)):
            row[at + k] += v


def _onto(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor leaf on ``device`` (a leaf already there stays itself)."""
    return tree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, value)


def _device(sparams: Any) -> torch.device | None:
    flats = flats_of(sparams)
    return flats[0].data.device if flats else None


def _tolerance(name: str, value: object) -> float:
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not (math.isfinite(value) and value >= 0)
    ):
        raise ValueError(f"fs.verify: {name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _precision(plan: Plan, mp: MixedPrecision) -> str:
    if mp == FULL_PRECISION:
        stored = sorted({dtype_name(x.dtype) for x in plan.leaves if x.dtype.is_floating_point})
        return "fp32" if stored in ([], ["float32"]) else "stored dtypes " + ", ".join(stored)
    parts = [
        f"{name} {dtype_name(dtype)}"
        for name, dtype in (
            ("param_dtype", mp.param_dtype),
            ("reduce_dtype", mp.reduce_dtype),
            ("output_dtype", mp.output_dtype),
        )
        if dtype is not None
    ]
    return "mixed precision: " + ", ".join(parts)
