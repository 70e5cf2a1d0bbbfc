"""A training step reads no tensor scalar back to the host: forward, backward, clip and the optimizer.

Each read of a tensor's value by the host (``float(t)``, ``int(t)``, ``.item()``,
``bool(t)``) runs ``aten._local_scalar_dense``, which on a GPU waits for the device.
A dispatch mode counts them; a failure names the source line that read.
"""

from __future__ import annotations

import traceback
from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import funcshard as fs


class HostReads(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense`` calls, by the funcshard line that made them."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            frames = [f for f in traceback.extract_stack() if "funcshard/" in f.filename]
            self.sites[" <- ".join(f"{f.filename}:{f.lineno}" for f in frames[-2:][::-1])] += 1
        return func(*args, **(kwargs or {}))


def _params() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(16, 8, generator=gen),
        "blocks": [
            {"w": torch.randn(8, 8, generator=gen) * 0.3, "b": torch.zeros(8)} for _ in range(2)
        ],
        "head": torch.randn(8, 16, generator=gen),
    }


def _block(p: Any, h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h @ p["w"] + p["b"])


def _loss(p: Any, batch: torch.Tensor) -> torch.Tensor:
    h = p["embed"][batch]
    for blk in p["blocks"]:
        h = fs.call(_block, blk, h)
    return (h @ p["head"]).logsumexp(-1).mean()


OPTIMIZERS = {
    "fused adamw, scheduled": lambda: fs.optim.adamw(
        fs.optim.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10), mask=fs.optim.decay_mask_default
    ),
    "foreach adamw": lambda: fs.optim.adamw(1e-2, fused=False),
    # the non-finite check and the skip stay on the device: fused AdamW's found_inf
    "guarded adamw": lambda: fs.optim.chain(
        fs.optim.skip_nonfinite(), fs.optim.adamw(1e-2, weight_decay=0.1)
    ),
    "wrapped adamw": lambda: fs.optim.skip_nonfinite(fs.optim.adamw(1e-2)),
    "lion": lambda: fs.optim.lion(1e-3),
    "sgd": lambda: fs.optim.sgd(1e-2, momentum=0.9),
}


def _steps(mesh: dict[str, int], name: str, steps: int = 3) -> list[dict[str, int]]:
    """Reads per step of value_and_grad + chain(clip, optimizer) + MetricLogger.log, at ``mesh``."""
    params = _params()
    plan = fs.plan(params, fs.Mesh(mesh), units=["blocks/*"])
    sparams = fs.shard(params, plan)
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(0.5), OPTIMIZERS[name]())
    state = opt.init(sparams)
    step = fs.value_and_grad(_loss, plan)
    logger = fs.MetricLogger(every=steps)
    gen = torch.Generator().manual_seed(1 + fs.rank())
    reads: list[dict[str, int]] = []
    for i in range(steps):
        batch = torch.randint(0, 16, (4, 3), generator=gen)
        with HostReads() as counter:
            loss, grads = step(sparams, batch)
            sparams, state = opt.update_(grads, state, sparams)
            if i < steps - 1:  # the last step emits: that one reads, by design
                logger.log(i, {"loss": loss, "norm": state[0].norm})
        reads.append(dict(counter.sites))
    return reads


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_step_at_one_rank_reads_nothing_back(name):
    """Forward, backward, clip, the optimizer and logging: 0 host reads in every step at W=1.

    A failure names each line that read a tensor's value, e.g. an update count read
    with int() (see [Note: update counts on the device] in optim/base.py).
    """
    assert _steps({"fsdp": 1}, name) == [{}, {}, {}]


def _update_only(mesh: dict[str, int], clip_on_device: bool = False) -> list[dict[str, int]]:
    from funcshard._src.optim import clip

    params = _params()
    plan = fs.plan(params, fs.Mesh(mesh), units=["blocks/*"])
    sparams = fs.shard(params, plan)
    opt = fs.optim.adamw(fs.optim.cosine_decay_schedule(1e-2, 10))
    before = clip._reduce_on_device
    if clip_on_device:  # the accelerator's path, here on gloo
        clip._reduce_on_device = lambda device: True
        opt = fs.optim.chain(fs.optim.clip_by_global_norm(0.5), opt)
    state = opt.init(sparams)
    step = fs.value_and_grad(_loss, plan)
    gen = torch.Generator().manual_seed(1 + fs.rank())
    reads = []
    try:
        for _ in range(2):
            batch = torch.randint(0, 16, (4, 3), generator=gen)
            with HostReads() as counter:
                _, grads = step(sparams, batch)
                sparams, state = opt.update_(grads, state, sparams)
            reads.append(dict(counter.sites))
    finally:
        clip._reduce_on_device = before
    return reads


def test_a_step_at_two_ranks_reads_nothing_back_in_forward_backward_and_adamw(pools):
    """W=2 (gloo): from the second step, the executor's collectives and AdamW read no tensor value.

    The first step of a group probes the CPU shared-memory transport once (comm/arena.py,
    CPU tensors, cached per group); clipping over several ranks sums through the host
    agreement (clip.py).
    """
    for reads in pools.run(2, _update_only, {"fsdp": 2}):
        assert reads[1:] == [{}]


def test_clipping_at_two_ranks_on_an_accelerator_reads_nothing_back(pools):
    """With the sums all-reduced as on an accelerator, clip adds no read at W=2 either."""
    for reads in pools.run(2, _update_only, {"fsdp": 2}, True):
        assert reads[1:] == [{}]


def test_the_update_count_is_read_once_after_it_is_written_elsewhere():
    """A count loaded into the state (written in place) is read again, and the schedule follows it."""
    params = {"w": torch.ones(3)}
    plan = fs.plan(params, fs.Mesh({"x": 1}))
    sparams = fs.shard(params, plan)
    seen: list[int] = []
    opt = fs.optim.sgd(lambda count: seen.append(count) or 0.1)
    state = opt.init(sparams)
    sparams, state = opt.update_(sparams, state, sparams)
    state.count.fill_(41)  # as a checkpoint's load does
    with HostReads() as counter:
        sparams, state = opt.update_(sparams, state, sparams)
    assert sum(counter.sites.values()) == 1
    with HostReads() as counter:
        sparams, state = opt.update_(sparams, state, sparams)
    assert sum(counter.sites.values()) == 0
    other = opt.init(sparams)  # a second state of the same optimizer: its own count
    sparams, other = opt.update_(sparams, other, sparams)
    sparams, state = opt.update_(sparams, state, sparams)
    assert seen == [0, 41, 42, 0, 43]
    assert int(state.count) == 44
    assert int(other.count) == 1


def test_metric_logger_reads_only_when_it_emits():
    logger = fs.MetricLogger(every=3)
    values = [torch.tensor(0.1), torch.tensor(0.2, dtype=torch.float64), 0.3]
    with HostReads() as counter:
        assert logger.log(0, {"loss": values[0]}) is None
        assert logger.log(1, {"loss": values[1]}) is None
    assert sum(counter.sites.values()) == 0
    values[0].fill_(100.0)  # logged values are not aliased
    means = logger.log(2, {"loss": values[2]})
    assert means == {"loss": (0.0 + float(torch.tensor(0.1)) + 0.2 + 0.3) / 3}
