"""The benchmarked modes: how each builds its model and optimizer, runs a step and reports its state.

Every mode starts from the same parameter tensors, trains with AdamW
(lr 1e-3, weight decay 0.1, the fused kernel everywhere: ``torch.optim.AdamW(
fused=True)`` for PyTorch's modes, as funcshard's default) and sees the same
batches; a step is forward, backward and the optimizer update.

A mode is one :class:`Mode` in :data:`MODES`: its description, its builder, and
how it runs (one process per rank in a process group, or one process alone).
A new mode (say ``funcshard/compiled``) is one more entry there; the runner,
the worker and the report read everything else from it.

``floor`` is one rank's work alone: one process with the per-rank thread count
(``--threads``, default 1), this rank's batch (the global batch / W), no
process group and no communication, the plain ``nn.Module`` GPT and
``torch.optim.AdamW(fused=True)``. No data-parallel mode can beat it per step;
the report gives every mode's median step as a multiple of it. ``plain`` is the
same computation under another name, the plain-PyTorch reference that
funcshard's and FSDP2's per-unit overhead is measured against at W=1 (the
``deep`` size). ``single`` trains every rank's batch in one process: the loss
reference.
"""

from __future__ import annotations

import functools
import os
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
    units: int | None = None  # communication units (funcshard units, fully_shard calls)
    notes: list[str] = field(default_factory=list)


Builder = Callable[[Config, Any, torch.device], Trainer]


@dataclass(frozen=True)
class Mode:
    """How one benchmarked mode is built and run.

    Attributes:
        description: one line for the report.
        build: ``build(cfg, params, device)`` on each rank, from the full ``params``
            (which it may consume); the process group, if any, is initialized.
        distributed: one process per rank in a process group of ``--world-size``
            ranks; ``False``: one process alone, no process group.
        batches: for a process alone, how many ranks' batches one step trains on
            (``None``: all W, as ``single``).
        forkable: whether its ranks may fork from ``--tiny``'s preloaded server.
    """

    description: str
    build: Builder
    distributed: bool = True
    batches: int | None = 1
    forkable: bool = True

    def processes(self, world: int) -> int:
        return world if self.distributed else 1

    def batches_per_step(self, world: int) -> int:
        """How many ranks' batches each process trains on per step."""
        if self.distributed:
            return 1
        return world if self.batches is None else self.batches

    def tokens_per_step(self, world: int, cfg: Config) -> int:
        """Tokens all of this mode's processes train on in one step."""
        return self.processes(world) * self.batches_per_step(world) * cfg.batch * cfg.seq


def build(mode: str, cfg: Config, params: Any, device: torch.device) -> Trainer:
    """Builds ``mode`` on this rank from the full ``params`` (which it may consume)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; modes: {sorted(MODES)}")
    return MODES[mode].build(cfg, params, device)


def _funcshard(
    strategy: Any,
    cfg: Config,
    params: Any,
    device: torch.device,
    *,
    compiled: bool = False,
    layout: Any = "auto",
    micro_batches: int = 1,
    quantize: fs.Quantized | None = None,
) -> Trainer:
    """funcshard with ``strategy``; with ``micro_batches`` > 1 the rank's batch is split into
    that many micro-batches along its sequences, one optimizer step over them
    (``step.accumulate``, the same tokens per step)."""
    world = fs.world_size()
    mesh = _mesh_for(strategy, world)
    # the planner's default placement; FUNCSHARD_BENCH_DEFAULT=largest_dim times the other one
    chosen = os.environ.get("FUNCSHARD_BENCH_DEFAULT", "dim_0")
    if chosen not in ("dim_0", "largest_dim"):
        raise ValueError(f"FUNCSHARD_BENCH_DEFAULT must be dim_0 or largest_dim, got {chosen!r}")
    default = "largest_dim" if chosen == "largest_dim" else "dim_0"
    plan = fs.plan(
        params, mesh, units=["blocks/*"], strategy=strategy, default=default, layout=layout
    )
    sparams = fs.shard(params, plan, device=device)
    opt = fs.optim.adamw(lr=LR, weight_decay=WEIGHT_DECAY)
    state = opt.init(sparams)

    def loss(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_fn(p, x, y, cfg.heads)

    # sharded strategies do not donate: each step's gradients live from their unit's
    # reduction to the update, as FSDP2's do (set_to_none), instead of across the next
    # step's forward. no_shard donates them to the next step, as DDP keeps its gradient
    # buckets from step to step: the same memory, and no fresh pages to fault in each step
    step = fs.value_and_grad(
        torch.compile(loss) if compiled else loss,
        plan,
        donate_grads=strategy == "no_shard",
        quantize=quantize,
    )
    held: dict[str, Any] = {"params": sparams, "state": state, "grad_bytes": 0}

    def run(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        step.ledger.reset()
        if micro_batches > 1:
            pieces = list(zip(tokens.chunk(micro_batches), targets.chunk(micro_batches)))
            loss, grads = step.accumulate(held["params"], pieces)
        else:
            loss, grads = step(held["params"], tokens, targets)
        held["params"], held["state"] = opt.update_(grads, held["state"], held["params"])
        held["grad_bytes"] = _flat_bytes(grads)
        del grads
        return loss

    def state_bytes() -> dict[str, int]:
        return {
            "params": _flat_bytes(held["params"]),
            "grads": held["grad_bytes"],
            "optimizer": _flat_bytes(held["state"].mu) + _flat_bytes(held["state"].nu),
        }

    cost = fs.cost.CostModel(micro_batches=micro_batches, quantize=quantize)
    comm = fs.cost.estimate(plan, cost).comm
    # what layout="auto" picked, as plan.explain() says it
    notes = [n for n in plan.notes if n.startswith("layout=")]
    if quantize is not None:
        exact = fs.cost.estimate(plan, fs.cost.CostModel(micro_batches=micro_batches)).comm
        notes.append(
            f"{quantize.weight_format or 'exact'} gathers and {quantize.gradient_format or 'exact'} "
            f"reductions, blocks of {quantize.block}: "
            f"{sum(comm.values()) / sum(exact.values()):.3f} x "
            f"the bytes of the same step unquantized"
        )
    if len(mesh.axis_names) > 1:  # where the bytes go: across the first axis, or inside the last
        by_axes = ", ".join(
            f"{op} over {'+'.join(axes)} {n / 2**20:.2f} MiB"
            for (op, axes), n in sorted(comm.items())
        )
        notes.append(f"{mesh!r}, sent per step and rank (the cost model, = the ledger): {by_axes}")
    return Trainer(
        run,
        state_bytes,
        lambda: step.ledger.total(),
        sum(comm.values()),
        units=len(plan.units),
        notes=notes,
    )


def _mesh_for(strategy: Any, world: int) -> fs.Mesh:
    """The bench's mesh for ``strategy``: two replicas (hybrid), two "nodes" (partial copies), or one axis."""
    if strategy in ("hybrid_shard", "hybrid_shard_optimizer"):
        return fs.Mesh({"dp": 2, "fsdp": world // 2})
    if strategy == "partial_reshard":
        return fs.Mesh({"node": 2, "local": world // 2})
    return fs.Mesh({"fsdp": world})


def _torch(wrap: str | None, cfg: Config, params: Any, device: torch.device) -> Trainer:
    """PyTorch's modes: the GPT module wrapped by ``wrap`` (``None``: not wrapped)."""
    model = GPT(params, cfg.heads).to(device)
    notes: list[str] = []
    units = None
    world = dist.get_world_size() if dist.is_initialized() else 1
    if wrap in ("fsdp2", "fsdp2/no_reshard"):
        from torch.distributed.fsdp import fully_shard

        reshard = wrap == "fsdp2"
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        units = len(model.blocks) + 1
    elif wrap == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
        model = FullyShardedDataParallel(model, auto_wrap_policy=policy, device_id=device)
        units = cfg.layers + 1
    elif wrap == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
        notes.append(
            "DDP all-reduces from C++; its bytes are 2 (W-1)/W of the gradient bytes, computed"
        )
    elif wrap is not None:
        raise ValueError(f"unknown wrapping {wrap!r}")
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
        if wrap == "ddp":
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

    return Trainer(run, state_bytes, lambda: counter.bytes, units=units, notes=notes)


_plain = functools.partial(_torch, None)
MODES: dict[str, Mode] = {
    "funcshard/full_shard": Mode(
        "funcshard, full_shard (ZeRO-3), the layout the planner picks (layout='auto')",
        functools.partial(_funcshard, "full_shard"),
    ),
    "funcshard/leaf": Mode(
        "funcshard, full_shard, every unit in the leaf layout (each leaf's PartitionSpec chunk)",
        functools.partial(_funcshard, "full_shard", layout="leaf"),
    ),
    "funcshard/compiled": Mode(
        "funcshard, full_shard, torch.compile(loss_fn) with Inductor",
        functools.partial(_funcshard, "full_shard", compiled=True),
    ),
    "funcshard/flat": Mode(
        "funcshard, full_shard, flat layout (FSDP1 / ZeRO style)",
        functools.partial(_funcshard, "full_shard", layout="flat"),
    ),
    "funcshard/shard_grad_op": Mode(
        "funcshard, shard_grad_op (ZeRO-2)", functools.partial(_funcshard, "shard_grad_op")
    ),
    # two micro-batches of one sequence each: the levers of per-step communication
    "funcshard/shard_optimizer": Mode(
        "funcshard, shard_optimizer (ZeRO-1), the rank's batch as 2 micro-batches",
        functools.partial(_funcshard, "shard_optimizer", micro_batches=2),
    ),
    "funcshard/shard_grad_op/2mb": Mode(
        "funcshard, shard_grad_op (ZeRO-2), the rank's batch as 2 micro-batches",
        functools.partial(_funcshard, "shard_grad_op", micro_batches=2),
    ),
    "funcshard/quantized": Mode(
        "funcshard, full_shard, int8 all-gathers and reductions per block of 256 "
        "(fs.Quantized(): ZeRO++'s qwZ and qgZ)",
        functools.partial(_funcshard, "full_shard", quantize=fs.Quantized()),
    ),
    "funcshard/quantized_int4": Mode(
        "funcshard, full_shard, int8 all-gathers and int4 reductions per block of 256 "
        "(fs.Quantized(gradients='int4'): ZeRO++'s qgZ format)",
        functools.partial(_funcshard, "full_shard", quantize=fs.Quantized(gradients="int4")),
    ),
    "funcshard/quantized_fp8": Mode(
        "funcshard, full_shard, fp8 (e4m3) all-gathers and int8 reductions per block of 256 "
        "(fs.Quantized(weights='fp8'))",
        functools.partial(_funcshard, "full_shard", quantize=fs.Quantized(weights="fp8")),
    ),
    "funcshard/no_shard": Mode(
        "funcshard, no_shard (DDP-like)", functools.partial(_funcshard, "no_shard")
    ),
    "funcshard/hybrid_shard": Mode(
        "funcshard, hybrid_shard (2 x W/2)", functools.partial(_funcshard, "hybrid_shard")
    ),
    # partial copies ([Note: partial copies] in funcshard/_src/plan/strategy.py)
    "funcshard/partial_reshard": Mode(
        "funcshard, partial_reshard (hpZ) on {node: 2, local: W/2}: backward re-gathers "
        "over local only",
        functools.partial(_funcshard, "partial_reshard"),
    ),
    "funcshard/hybrid_shard_optimizer": Mode(
        "funcshard, hybrid_shard_optimizer (HFSDP) on {dp: 2, fsdp: W/2}, the rank's batch "
        "as 2 micro-batches",
        functools.partial(_funcshard, "hybrid_shard_optimizer", micro_batches=2),
    ),
    "funcshard/hybrid_shard/2mb": Mode(
        "funcshard, hybrid_shard (2 x W/2), the rank's batch as 2 micro-batches",
        functools.partial(_funcshard, "hybrid_shard", micro_batches=2),
    ),
    "fsdp2": Mode(
        "PyTorch FSDP2 fully_shard (each block, then the root)",
        functools.partial(_torch, "fsdp2"),
    ),
    "fsdp2/no_reshard": Mode(
        "PyTorch FSDP2, reshard_after_forward=False",
        functools.partial(_torch, "fsdp2/no_reshard"),
    ),
    "fsdp1": Mode("PyTorch FSDP1, transformer auto-wrap", functools.partial(_torch, "fsdp1")),
    # DDP's ranks forked from the server hang in about half of the runs (its reducer's
    # threads and gloo after fork): they start as fresh interpreters even with --tiny
    "ddp": Mode("PyTorch DDP", functools.partial(_torch, "ddp"), forkable=False),
    "floor": Mode(
        "one rank's work alone: its batch, one process, no communication, plain PyTorch",
        _plain,
        distributed=False,
    ),
    "plain": Mode(
        "plain PyTorch, not distributed (floor's computation): the per-unit reference",
        _plain,
        distributed=False,
    ),
    "single": Mode(
        "one process, all ranks' batches (the loss reference)",
        _plain,
        distributed=False,
        batches=None,
    ),
}


def _local_bytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _flat_bytes(tree: Any) -> int:
    return fs.testing.held_bytes(tree) if tree is not None else 0
