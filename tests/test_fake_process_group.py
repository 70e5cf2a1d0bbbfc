"""A W=8 full_shard step in one process, under torch's fake process group.

See [Note: the fake process group] in ``comm/channel.py``: every collective
completes at once and moves nothing, and the control channel is mirrored.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import funcshard as fs
from funcshard._src.comm import channel, runtime


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _block(p, h):
    return h + F.gelu(h @ p["w1"]) @ p["w2"]


def _loss_fn(params, tokens):
    h = params["embed"][tokens]
    for blk in params["blocks"]:
        h = fs.call(_block, blk, h)
    return (h @ params["head"]).square().mean()


@pytest.mark.usefixtures("fake_world")
def test_a_w8_full_shard_step_runs_in_one_process():
    gen = torch.Generator().manual_seed(0)
    params = {
        "embed": torch.randn(32, 16, generator=gen),
        "blocks": [
            {"w1": torch.randn(16, 24, generator=gen), "w2": torch.randn(24, 16, generator=gen)}
            for _ in range(3)
        ],
        "head": torch.randn(16, 8, generator=gen),
    }
    assert runtime.is_fake()
    assert fs.world_size() == 8
    assert fs.rank() == 3
    plan = fs.plan(params, fs.Mesh({"fsdp": 8}), units=["blocks/*"], strategy="full_shard")
    sparams = fs.shard(params, plan)  # the agreement on values: mirrored, so it passes
    ch = channel.existing_channel()
    assert ch is not None
    assert ch.mirrored
    opt = fs.optim.adamw(1e-3)
    state = opt.init(sparams)
    step = fs.value_and_grad(_loss_fn, plan)
    tokens = torch.randint(0, 32, (2, 5), generator=gen)
    for _ in range(2):
        _, grads = step(sparams, tokens)
        grads, _ = fs.optim.clip_by_global_norm(grads, 1.0)
        sparams, state = opt.update_(grads, state, sparams)
    # rank 3's shards of dim 0, ceil-div chunks: w1 (16, 24) -> rows 6..8
    assert grads["blocks"][0]["w1"].local.shape == (2, 24)
    assert sparams["blocks"][2]["w2"].local.shape == (3, 16)
    assert ch.out_of_step is None
    assert ch.seq > 0
    assert step.stats.peak_gathered_bytes > 0
