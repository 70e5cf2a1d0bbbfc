"""Shards, batches and the backend agree on a device, or the step refuses before any collective.

See [Note: devices and backends] in ``comm/runtime.py``. There is no GPU here:
the backend funcshard reads (``runtime.backend``) is faked, and a CUDA device is
only named, never allocated on.
"""

from __future__ import annotations

import pytest
import torch

import funcshard as fs
from funcshard._src.comm import runtime
from funcshard._src.execute.value_and_grad import check_devices
from funcshard._src.shard.shard import shard_for_rank


@pytest.fixture
def nccl(monkeypatch):
    monkeypatch.setattr(runtime, "backend", lambda: "nccl")
    monkeypatch.setenv("LOCAL_RANK", "3")


def _setup():
    params = {"blocks": [{"w": torch.ones(4, 2)}], "head": torch.ones(2)}
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=["blocks/*"])
    step = fs.value_and_grad(
        lambda p, x: fs.call(lambda q, x: x @ q["w"], p["blocks"][0], x).sum(), plan
    )
    return params, plan, step


def test_the_device_follows_the_backend(nccl):
    assert fs.device() == torch.device("cuda", 3)
    assert runtime.default_device("gloo") == torch.device("cpu")
    assert runtime.carries("nccl", torch.device("cuda", 3))
    assert not runtime.carries("nccl", torch.device("cuda", 0))  # another rank's GPU
    assert not runtime.carries("gloo", torch.device("cuda", 0))
    assert runtime.carries("fake", torch.device("cuda", 0))
    assert runtime.carries(None, torch.device("cuda", 0))


def test_shards_on_the_cpu_under_nccl_are_refused(nccl):
    params, plan, _ = _setup()
    with pytest.raises(
        ValueError,
        match=r"fs.shard: device='cpu': cpu cannot take part in nccl collectives; under NCCL, "
        r"shards and batches go to this rank's GPU: fs.shard\(..., device=fs.device\(\)\) "
        r"\(the default\) and batch.to\(fs.device\(\)\) \(cuda:3\)",
    ):
        fs.shard(params, plan, device="cpu")


def test_cuda_shards_under_gloo_are_refused(monkeypatch):
    monkeypatch.setattr(runtime, "backend", lambda: "gloo")
    with pytest.raises(
        ValueError,
        match=r"fs.shard: device='cuda:0': cuda:0 cannot take part in gloo collectives; under "
        r"gloo, shards and batches stay on the CPU: .* fs.init\(backend='nccl'\)",
    ):
        runtime.check_device(torch.device("cuda", 0), "fs.shard: device='cuda:0'")


def test_a_step_refuses_cpu_shards_under_nccl_before_any_collective(nccl):
    params, plan, step = _setup()
    sparams = shard_for_rank(params, plan, 0)  # no check: shards on the CPU
    with pytest.raises(
        ValueError,
        match=r"the params: head \(unit '<root>'\) is on cpu, which nccl collectives cannot carry "
        r"\(this rank's device is cuda:3\); under NCCL",
    ):
        step(sparams, torch.ones(3, 4))


def test_batch_tensors_the_backend_cannot_carry_are_named(nccl):
    batches = [((torch.ones(2),), {}), ((), {"mask": {"m": torch.ones(2)}})]
    with pytest.raises(ValueError, match=r"micro-batch 0: loss_fn's argument 0 is on cpu"):
        check_devices({}, batches)
    with pytest.raises(ValueError, match=r"the batch: loss_fn's keyword argument mask/m is on cpu"):
        check_devices({}, batches[1:])


def test_init_under_nccl_binds_the_local_gpu_and_gives_the_group_its_timeout(monkeypatch):
    """fs.init(backend="nccl") passes device_id=cuda:LOCAL_RANK and timeout_s to
    init_process_group (torch.distributed faked: no GPU here)."""
    import datetime

    import torch.distributed as dist

    from funcshard._src.comm import lifecycle, runtime

    calls: list[tuple[tuple, dict]] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(((d,), {})))
    monkeypatch.setattr(lifecycle.atexit, "register", lambda fn: None)
    monkeypatch.setattr(runtime, "_init_timeout_s", None)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    for name, value in {"WORLD_SIZE": "4", "RANK": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    fs.init(backend="nccl", timeout_s=30)
    assert calls == [
        ((torch.device("cuda", 1),), {}),
        (
            ("nccl",),
            {"timeout": datetime.timedelta(seconds=30), "device_id": torch.device("cuda", 1)},
        ),
    ]


def test_interop_puts_shards_and_buffers_where_the_backend_carries_them(nccl):
    from funcshard._src.interop import safetensors_io, weights

    # apply.materialize / materialize_state / load_pretrained and load_safetensors default
    # to fs.device(), as fs.shard does; an explicit device is kept
    assert weights._device(None) == torch.device("cuda", 3)
    assert safetensors_io._target(None) == torch.device("cuda", 3)
    assert weights._device("cpu") == safetensors_io._target("cpu") == torch.device("cpu")
