"""Train one row of the conformance table sharded and against its reference, on every rank of a pool.

The reference is FSDP2's own parity pattern (``test_train_parity_*``): on every
rank a replicated copy of the module, made before ``functionalize``, runs its own
micro-batch with plain autograd; gradients are averaged over ranks with an
all-reduce (a trainable parameter no gradient reached gets zeros, as the sharded
step gives it) and ``torch.optim.SGD`` (momentum, weight decay) steps. The sharded
side is ``fs.interop.functionalize`` + ``fs.value_and_grad`` + ``fs.optim.sgd``
with the same hyperparameters. In float64 the two must agree to 1e-10 after three
steps on every parameter and buffer; in bf16 mixed precision the reference is
FSDP2 itself with the same policy. A row that funcshard refuses must raise its
error at the first step, on every rank.

SGD, not AdamW: AdamW divides by the root of the second moment, so rounding noise
in a direction whose gradient is zero (attention's key bias) becomes an update of
``lr * noise / eps``, and a comparison at 1e-10 would measure rounding, not the
sharding. AdamW against ``torch.optim.AdamW`` is covered at float32 tolerance in
``tests/interop``.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import funcshard as fs
from funcshard.interop import functionalize
from tests.conformance.catalog import ROWS, Row

LR, MOMENTUM, WEIGHT_DECAY, STEPS = 0.05, 0.9, 0.01, 3
VARIANTS = ("full_shard", "shard_grad_op", "remat", "bf16")
BF16 = fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def run_row(name: str, variant: str, steps: int = STEPS) -> dict[str, Any]:
    """On every rank: the row trained ``steps`` SGD steps sharded and by its reference.

    Returns ``{"error": message}`` where the sharded step raised, else the losses
    of both and the largest absolute difference of each parameter after the steps.
    Under ``full_shard`` it also holds ``fs.verify``'s verdict of the row (``"verify"``).
    """
    row = ROWS[name]
    with warnings.catch_warnings():
        for message in row.quiet:
            warnings.filterwarnings("ignore", message)
        result = _run(row, variant, steps)
        if variant == "full_shard":
            result["verify"] = _verify(row, variant)
        return result


def _run(row: Row, variant: str, steps: int) -> dict[str, Any]:
    dtype = torch.float32 if variant == "bf16" else torch.float64
    with default_dtype(dtype):
        torch.manual_seed(0)
        model = row.build()
    reference = copy.deepcopy(model)
    try:
        params, apply = functionalize(model, units=list(row.units), remat=variant == "remat")
    except ValueError as e:  # a parameter functionalize cannot own: refused before any step
        if row.refused is None:
            raise
        return {"error": _said(e), "step": 0}
    strategy, mesh = _placement(variant)
    plan = fs.plan(params, mesh, units=apply.units, frozen=apply.frozen, strategy=strategy)
    sparams = fs.shard(params, plan)
    del params
    opt = fs.optim.sgd(lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    state = opt.init(sparams)
    precision = BF16 if variant == "bf16" else None

    def loss_fn(p: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        return row.loss(apply(p, *args, **kwargs), args, kwargs)

    step = fs.value_and_grad(loss_fn, plan, mixed_precision=precision)
    train_reference = (
        _fsdp2(reference, row, apply.unit_paths)
        if variant == "bf16"
        else _replicated(reference, row)
    )
    losses, ref_losses = [], []
    for t in range(steps):
        with default_dtype(dtype):
            args, kwargs = row.batch(100 * t + fs.rank())
        try:
            with row.around():
                ref_losses.append(train_reference(args, kwargs))
        except RuntimeError as e:  # FSDP2 in bf16 fails in torch: funcshard must fail alike
            if variant != "bf16":
                raise
            return {
                "error": _sharded_error(step, sparams, args, kwargs),
                "step": t,
                "fsdp2": _said(e),
            }
        try:
            with row.around():
                loss, grads = step(sparams, args, kwargs)
        except Exception as e:  # a refusal: it must come at the first step
            return {"error": _said(e), "step": t}
        sparams, state = opt.update_(grads, state, sparams)
        losses.append(float(loss))
    got = apply.state_dict(fs.unshard(sparams))  # parameters and buffers, by the module's names
    expected = {k: _whole(v) for k, v in reference.state_dict().items()}
    diffs, scales = {}, {}
    for key, value in got.items():
        other = expected[key].to(value.dtype)
        if not value.numel():
            continue
        diffs[key] = float((value.double() - other.double()).abs().max())
        scales[key] = float(other.double().abs().max())
    return {
        "error": None,
        "losses": losses,
        "ref_losses": ref_losses,
        "diffs": diffs,
        "scales": scales,
    }


def verify_row(name: str, variant: str, steps: int = 2) -> dict[str, Any]:
    """On every rank: ``fs.verify`` of the row's configuration; its verdict and problems."""
    row = ROWS[name]
    with warnings.catch_warnings():
        for message in row.quiet:
            warnings.filterwarnings("ignore", message)
        return _verify(row, variant, steps)


def _verify(row: Row, variant: str, steps: int = 2) -> dict[str, Any]:
    dtype = torch.float32 if variant == "bf16" else torch.float64
    with default_dtype(dtype):
        torch.manual_seed(0)
        model = row.build()
        batch = row.batch(fs.rank())
    try:
        params, apply = functionalize(model, units=list(row.units), remat=variant == "remat")
    except ValueError as e:  # nothing to verify: functionalize refused the module
        if row.refused is None:
            raise
        return {"ok": False, "problems": [_said(e)]}
    strategy, mesh = _placement(variant)
    plan = fs.plan(params, mesh, units=apply.units, frozen=apply.frozen, strategy=strategy)

    def loss_fn(p: Any, b: Any) -> torch.Tensor:
        args, kwargs = b
        return row.loss(apply(p, *args, **kwargs), args, kwargs)

    with row.around():
        report = fs.verify(
            loss_fn,
            params,
            plan,
            batch,
            steps=steps,
            optimizer=fs.optim.sgd(lr=LR, momentum=MOMENTUM),
            mixed_precision=BF16 if variant == "bf16" else None,
        )
    return {"ok": report.ok, "problems": list(report.problems)}


def _placement(variant: str) -> tuple[Any, fs.Mesh]:
    """A variant's strategy and mesh: ``partial_reshard`` and ``hybrid_shard_optimizer`` on
    ``{node: 2, local: W/2}`` (their copies re-gathered, and the latter's gradients reduced
    first, over ``local``), else one axis of every rank."""
    world = fs.world_size()
    if variant in ("partial_reshard", "hybrid_shard_optimizer"):
        return variant, fs.Mesh({"node": 2, "local": world // 2})
    strategy = variant if variant in ("shard_grad_op", "shard_optimizer") else "full_shard"
    return strategy, fs.Mesh({"fsdp": world})


def _whole(value: torch.Tensor) -> torch.Tensor:
    full: Callable[[], torch.Tensor] | None = getattr(value, "full_tensor", None)  # DTensors
    return (value if full is None else full()).detach()


def _said(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _sharded_error(step: Any, sparams: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """What the sharded step raises on a batch FSDP2 failed on (``None`` if it trains)."""
    try:
        step(sparams, args, kwargs)
    except Exception as e:
        return _said(e)
    return "None"


def _replicated(model: nn.Module, row: Row) -> Any:
    """One step of the replicated reference: own batch, gradients averaged over ranks, SGD."""
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trained, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    world = dist.get_world_size()

    def step(args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
        opt.zero_grad(set_to_none=True)
        loss = row.loss(model(*args, **kwargs), args, kwargs)
        loss.backward()
        for p in trained:
            if p.grad is None:  # no gradient reached it: zero, as the sharded step has
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        return float(loss.detach())

    return step


def _fsdp2(model: nn.Module, row: Row, unit_paths: tuple[str, ...]) -> Any:
    """One step of FSDP2 (``fully_shard`` each unit, then the root) in bf16 mixed precision."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for path in unit_paths:
        fully_shard(model.get_submodule(path.replace("/", ".")), mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(trained, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)

    def step(args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
        opt.zero_grad(set_to_none=True)
        with warnings.catch_warnings():  # FSDP2's own advice on views the root returns
            warnings.filterwarnings("ignore", "FSDP2-wrapped module .* returned a view tensor")
            loss = row.loss(model(*args, **kwargs), args, kwargs)
        loss.backward()
        for p in trained:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        return float(loss.detach())

    return step


__all__ = ["STEPS", "VARIANTS", "Row", "run_row"]


def run_broadcast_buffers(name: str, steps: int = STEPS) -> dict[str, float]:
    """On every rank: the row trained with ``apply.broadcast_state()`` before each step, and by DDP.

    DDP(forward_sync_buffers=True, the newer broadcast_buffers) gives every rank rank 0's buffers before each
    forward; so does ``broadcast_state``. Returns the largest difference per tensor.
    """
    row = ROWS[name]
    with default_dtype(torch.float64):
        torch.manual_seed(0)
        model = row.build()
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model), forward_sync_buffers=True)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    params, apply = functionalize(model, units=list(row.units))
    plan = fs.plan(params, fs.Mesh({"fsdp": fs.world_size()}), units=apply.units)
    sparams = fs.shard(params, plan)
    opt = fs.optim.sgd(lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    state = opt.init(sparams)

    def loss_fn(p: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        return row.loss(apply(p, *args, **kwargs), args, kwargs)

    step = fs.value_and_grad(loss_fn, plan)
    for t in range(steps):
        with default_dtype(torch.float64):
            args, kwargs = row.batch(100 * t + fs.rank())
        ddp_opt.zero_grad()
        row.loss(ddp(*args, **kwargs), args, kwargs).backward()
        ddp_opt.step()
        apply.broadcast_state()
        _, grads = step(sparams, args, kwargs)
        sparams, state = opt.update_(grads, state, sparams)
    got = apply.state_dict(fs.unshard(sparams))
    expected = ddp.module.state_dict()
    return {k: float((v.double() - expected[k].double()).abs().max()) for k, v in got.items()}


@contextlib.contextmanager
def stale_module_code() -> Iterator[None]:
    """A sharded step as it was before placeholders and re-entry: the module keeps its own weights.

    In a step, module code outside apply's calls (a checkpoint's recompute, a
    backward hook, a read of another unit's parameter) then reads the module's
    initial weights, silently: the configurations ``fs.verify`` must catch. Its
    unsharded reference (outside a step) is left as it is.
    """
    from funcshard._src.execute.run import current_run
    from funcshard._src.interop import binding, module

    install, reentering = module.placeholders.install, binding.Binding.reentering

    def stale(self: Any, fn: Any) -> Any:
        return fn if current_run() is not None else reentering(self, fn)

    module.placeholders.install = lambda *args, **kwargs: None  # type: ignore[assignment]
    binding.Binding.reentering = stale  # type: ignore[method-assign]
    try:
        yield
    finally:
        module.placeholders.install = install  # type: ignore[assignment]
        binding.Binding.reentering = reentering  # type: ignore[method-assign]


def verify_stale(name: str) -> dict[str, Any]:
    """On every rank: ``fs.verify`` of the row with :func:`stale_module_code`."""
    with stale_module_code():  # three steps: stale weights differ from the second one on
        return verify_row(name, "full_shard", steps=3)
