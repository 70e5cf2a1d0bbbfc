"""One run of one mode on one rank, in a fresh process: allocator, build, warm up, time, report."""

from __future__ import annotations

import datetime
import gc
import json
import os
import resource
import time
from typing import Any

import torch
import torch.distributed as dist

from bench import allocator as malloc
from bench import model as gpt
from bench.modes import MODES, build


def main(
    mode: str,
    cfg_json: dict[str, int],
    world: int,
    rank: int,
    store: str,
    spec: dict[str, Any],
    allocator: str,
    out: str,
) -> None:
    """Runs ``mode`` under ``allocator``; writes this rank's figures as JSON to ``out``."""
    import faulthandler

    set_by = malloc.apply(allocator)
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(spec["threads"])
    cfg = gpt.Config(**cfg_json)
    backend = spec["backend"]
    kind = MODES[mode]
    ranks = kind.processes(world)
    if kind.distributed:  # a process group even of one rank: --world-size 1
        dist.init_process_group(
            backend,
            store=dist.FileStore(store, ranks),  # pyright: ignore[reportPrivateImportUsage]
            rank=rank,
            world_size=ranks,
            timeout=datetime.timedelta(seconds=spec["timeout_s"]),
        )
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    trainer = build(mode, cfg, gpt.init_params(cfg), device)
    per_batch = kind.batches_per_step(world)  # single: one process trains every rank's batch
    times: list[float] = []
    cpu: list[tuple[float, float]] = []  # (user, system) seconds of this process per timed step
    losses: list[float] = []
    comm: list[int] = []
    for i in range(spec["warmup"] + spec["steps"]):
        tokens, targets = (t.to(device) for t in gpt.batch(cfg, i, rank, ranks=per_batch))
        _sync(device)
        before = os.times()
        start = time.perf_counter()
        loss = trainer.step(tokens, targets)
        _sync(device)
        elapsed = time.perf_counter() - start
        after = os.times()
        losses.append(_mean_over_ranks(loss))
        comm.append(trainer.comm_bytes())
        if i >= spec["warmup"]:
            times.append(elapsed)
            cpu.append((after.user - before.user, after.system - before.system))
    result = {
        "mode": mode,
        "rank": rank,
        "world_size": ranks,
        "malloc": allocator,
        "malloc_set_by": set_by,
        "units": trainer.units,
        "step_times_s": times,
        "step_cpu_s": cpu,
        "losses": losses,
        "comm_bytes_per_step": comm[-1],
        "expected_comm_bytes_per_step": trainer.expected_comm_bytes,
        "state_bytes": trainer.state_bytes(),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_cuda_mib": torch.cuda.max_memory_allocated() / 2**20
        if device.type == "cuda"
        else None,
        "notes": trainer.notes,
        "pid": os.getpid(),
    }
    with open(out, "w") as f:
        json.dump(result, f)
    # DDP's reducer holds the process group and threads of its own: freed after the group,
    # at interpreter exit, it aborted the process in about one run in six
    del trainer
    gc.collect()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized():
        dist.barrier()


def _mean_over_ranks(loss: torch.Tensor) -> float:
    value = loss.detach().float().reshape(1).clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value)
