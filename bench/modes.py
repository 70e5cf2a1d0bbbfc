"""The benchmarked modes: how each builds its model and optimizer, runs a step and reports its state.

Every mode starts from the same parameter tensors, trains with AdamW
(lr 1e-3, weight decay 0.1, the fused kernel everywhere: ``torch.optim.AdamW(
fused=True)`` for PyTorch's modes, as funcshard's default) and sees the same
batches; a step is forward, backward and the optimizer update.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import funcshard as fs
from bench.comm import Counter
from bench.model import GPT, Block, Config, loss_fn

LR, WEIGHT_DECAY = 1e-3, 0.1


@dataclass
class Trainer:
    """One mode, built on one rank."""

    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # returns this rank's loss
    state_bytes: Callable[
        [], dict[str, int]
    ]  # parameters, gradients, optimizer state held by this rank
    comm_bytes: Callable[[], int]  # bytes this rank sent in the last step
    expected_comm_bytes: int | None = (
        None  # what the cost model predicts per step, where there is one
    )
    notes: list[str] = field(default_factory=list)


MODES: dict[str, str] = {
    "funcshard/full_shard": "funcshard, full_shard (ZeRO-3)",
    "funcshard/shard_grad_op": "funcshard, shard_grad_op (ZeRO-2)",
    "funcshard/no_shard": "funcshard, no_shard (DDP-like)",
    "funcshard/hybrid_shard": "funcshard, hybrid_shard (2 x W/2)",
    "fsdp2": "PyTorch FSDP2 fully_shard (each block, then the root)",
    "fsdp2/no_reshard": "PyTorch FSDP2, reshard_after_forward=False",
    "fsdp1": "PyTorch FSDP1, transformer auto-wrap",
    "ddp": "PyTorch DDP",
    "single": "one process, all ranks' batches",
}


def build(mode: str, cfg: Config, params: Any, device: torch.device) -> Trainer:
    """Builds ``mode`` on this rank from the full ``params`` (which it may consume)."""
    if mode.startswith("funcshard/"):
        return _funcshard(mode.split("/", 1)[1], cfg, params, device)
    return _torch(mode, cfg, params, device)


def _funcshard(strategy: Any, cfg: Config, params: Any, device: torch.device) -> Trainer:
    world = fs.world_size()
    mesh = (
        fs.Mesh({"dp": 2, "fsdp": world // 2})
        if strategy == "hybrid_shard"
        else fs.Mesh({"fsdp": world})
    )
    plan = fs.plan(params, mesh, units=["blocks/*"], strategy=strategy)
    sparams = fs.shard(params, plan, device=device)
    opt = fs.optim.adamw(lr=LR, weight_decay=WEIGHT_DECAY)
    state = opt.init(sparams)
    # each call's gradients are done with once the update ran: reuse their buffers
    step = fs.value_and_grad(lambda p, x, y: loss_fn(p, x, y, cfg.heads), plan, donate_grads=True)
    held: dict[str, Any] = {"params": sparams, "state": state, "grads": None}

    def run(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        step.ledger.reset()
        loss, grads = step(held["params"], tokens, targets)
        held["params"], held["state"] = opt.update_(grads, held["state"], held["params"])
        held["grads"] = grads
        return loss

    def state_bytes() -> dict[str, int]:
        return {
            "params": _flat_bytes(held["params"]),
            "grads": _flat_bytes(held["grads"]),
            "optimizer": _flat_bytes(held["state"].mu) + _flat_bytes(held["state"].nu),
        }

    return Trainer(
        run, state_bytes, lambda: step.ledger.total(), sum(fs.cost.estimate(plan).comm.values())
    )


def _torch(mode: str, cfg: Config, params: Any, device: torch.device) -> Trainer:
    model = GPT(params, cfg.heads).to(device)
    notes: list[str] = []
    world = dist.get_world_size() if dist.is_initialized() else 1
    if mode in ("fsdp2", "fsdp2/no_reshard"):
        from torch.distributed.fsdp import fully_shard

        reshard = mode == "fsdp2"
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
    elif mode == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
        model = FullyShardedDataParallel(model, auto_wrap_policy=policy, device_id=device)
    elif mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
        notes.append(
            "DDP all-reduces from C++; its bytes are 2 (W-1)/W of the gradient bytes, computed"
        )
    elif mode != "single":
        raise ValueError(f"unknown mode {mode!r}; modes: {sorted(MODES)}")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    counter = Counter()
    grad_bytes = {"value": 0}
    param_bytes = sum(_local_bytes(p) for p in model.parameters())

    def run(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        counter.bytes = 0
        with counter.counting():
            loss = model(tokens, targets)
            loss.backward()
            grad_bytes["value"] = sum(
                _local_bytes(p.grad) for p in model.parameters() if p.grad is not None
            )
            opt.step()
            opt.zero_grad(set_to_none=True)
        if mode == "ddp":
            counter.bytes = 2 * param_bytes * (world - 1) // world
        return loss.detach()

    def state_bytes() -> dict[str, int]:
        optimizer = sum(
            _local_bytes(v)
            for s in opt.state.values()
            for k, v in s.items()
            if k in ("exp_avg", "exp_avg_sq")
        )
        return {
            "params": sum(_local_bytes(p) for p in model.parameters()),
            "grads": grad_bytes["value"],
            "optimizer": optimizer,
        }

    return Trainer(run, state_bytes, lambda: counter.bytes, notes=notes)


def _local_bytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _flat_bytes(tree: Any) -> int:
    return fs.testing.held_bytes(tree) if tree is not None else 0
