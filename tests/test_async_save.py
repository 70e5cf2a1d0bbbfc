"""Asynchronous saves: the same checkpoints as blocking ones, written while training runs.

References: a run that saves with blocking ``fs.checkpoint.save`` (its checkpoints
loaded whole, and a resume from them), against the same run saving with
``fs.checkpoint.AsyncCheckpointer`` at the same steps; ``fs.cost.estimate`` for the
staging bytes. A failure localises to the staging copy (checkpoints differ), the
store exchange (errors not on every rank) or the commit (a kill that loses one).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import funcshard as fs
from funcshard._src.checkpoint import commit
from funcshard.checkpoint import CheckpointError
from tests.models import Model

MODEL = Model(kind="transformer", width=6, hidden=10, layers=2)
ROOT = Path(__file__).resolve().parent.parent


def _train(directory: str, steps: int, mode: str, resume: bool = False) -> Any:
    """Trains ``steps`` steps, saving every 2 steps (``mode``: "sync" or "async"); resumes if asked."""
    fs.seed(0)
    plan = fs.plan(MODEL.init(0), fs.Mesh({"fsdp": fs.world_size()}), units=MODEL.units)
    sparams = fs.shard(MODEL.init(0), plan)
    opt = fs.optim.adamw(lr=0.05)
    state = {"params": sparams, "opt": opt.init(sparams), "step": 0}
    if resume and (last := fs.checkpoint.latest(directory, run=mode)) is not None:
        state = fs.checkpoint.load(last, like=state)
    step = fs.value_and_grad(MODEL.loss_fn, plan)
    saver = fs.checkpoint.AsyncCheckpointer()
    try:
        while (n := state["step"]) < steps:
            noise = torch.rand(1)  # the RNG states the checkpoints carry decide the run
            _, grads = step(state["params"], *MODEL.batch_for(100 * n + fs.rank()))
            state["params"], state["opt"] = opt.update_(grads, state["opt"], state["params"])
            state["params"]["embed"]["tokens"].local.mul_(1 + 1e-3 * float(noise))
            state["step"] = n + 1
            if state["step"] % 2 == 0:
                path, kw = f"{directory}/step-{n + 1}", {"step": n + 1, "keep": 2, "run": mode}
                if mode == "sync":
                    fs.checkpoint.save(path, state, **kw)
                else:
                    saver.save(path, state, **kw)  # returns once staged; the next steps run
        saver.close()
    finally:
        saver._pending = None  # a failed body must not leave a thread the next body waits on
    return fs.unshard({"params": state["params"], "opt": state["opt"]})


def test_async_saves_write_what_blocking_saves_do_and_resume_bit_exactly(pools, tmp_path):
    sync_dir, async_dir = str(tmp_path / "sync"), str(tmp_path / "async")
    blocking = pools.run(2, _train, sync_dir, 6, "sync")[0]
    for x, y in zip(
        fs.tree.leaves(pools.run(2, _train, async_dir, 6, "async")[0]), fs.tree.leaves(blocking)
    ):
        assert torch.equal(x, y)  # saving in the background changed nothing of the run
    names = sorted(p.name for p in Path(async_dir).iterdir())
    assert names == sorted(p.name for p in Path(sync_dir).iterdir()) == ["step-4", "step-6"]
    for name in names:  # every leaf and every rank's RNG state, bit for bit
        a = fs.checkpoint.load_full(f"{async_dir}/{name}")
        b = fs.checkpoint.load_full(f"{sync_dir}/{name}")
        for x, y in zip(fs.tree.leaves(a), fs.tree.leaves(b)):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    # resume at 4 from each (its step-6 moved away) and run to 8: the same parameters
    for directory in (sync_dir, async_dir):
        os.rename(f"{directory}/step-6", f"{directory}/../{Path(directory).name}-step-6")
    resumed = [
        pools.run(2, _train, d, 8, m, True)[0]
        for d, m in ((sync_dir, "sync"), (async_dir, "async"))
    ]
    uninterrupted = pools.run(2, _train, str(tmp_path / "straight"), 8, "async")[0]
    for run in resumed:
        for x, y in zip(fs.tree.leaves(run), fs.tree.leaves(uninterrupted)):
            assert torch.equal(x, y)


def _staging_and_estimate(directory: str) -> tuple[int, int, bool, bool]:
    params = {"w": torch.randn(8, 4), "b": torch.randn(8)}
    plan = fs.plan(params, fs.Mesh({"fsdp": fs.world_size()}))
    sparams = fs.shard(params, plan)
    opt = fs.optim.adamw(lr=0.1)
    state = {"params": sparams, "opt": opt.init(sparams)}
    with fs.checkpoint.AsyncCheckpointer() as saver:
        first = saver.save(f"{directory}/a", state, rng=False)
        buffers = [t.data_ptr() for t in saver._staging.views.values()]
        second = saver.save(f"{directory}/b", state, rng=False)  # waits for the first
        waited = first.done()
        reused = buffers == [t.data_ptr() for t in saver._staging.views.values()]
        second.result()
        staged = saver.staging_bytes
    model = fs.cost.CostModel(optimizer="adamw", async_checkpoint=True)
    return staged, fs.cost.estimate(plan, model).checkpoint_staging, waited, reused


def test_staging_buffers_are_counted_by_the_estimate_and_reused(pools, tmp_path):
    results = pools.run(2, _staging_and_estimate, str(tmp_path))
    for rank, (staged, estimated, waited, reused) in enumerate(results):
        assert waited
        assert reused
        # rank 0 also writes the optimizer's count (a plain tensor): exactly the estimate
        assert staged == estimated if rank == 0 else staged == estimated - 8


def _fail_on_rank_1(directory: str) -> list[str]:
    import funcshard._src.checkpoint.save as saving

    state = {
        "w": fs.shard({"w": torch.ones(4)}, fs.plan({"w": torch.ones(4)}, fs.Mesh({"fsdp": 2})))
    }
    write = saving.write_chunks

    def full_disk(*a: Any) -> Any:
        raise OSError(28, "No space left on device")

    seen: list[str] = []
    saver = fs.checkpoint.AsyncCheckpointer()
    fs.checkpoint.save(f"{directory}/step-1", state, step=1, run="disk")
    if fs.rank() == 1:
        saving.write_chunks = full_disk
    try:
        saver.save(f"{directory}/step-2", state, step=2, keep=1, run="disk")  # returns: staged
    finally:
        saving.write_chunks = write
    try:
        saver.save(f"{directory}/step-3", state, step=3, keep=1, run="disk")
    except CheckpointError as e:
        seen.append(str(e))
    seen.append(str(fs.checkpoint.latest(directory, run="disk")))
    handle = saver.save(f"{directory}/step-3", state, step=3, keep=1, run="disk")  # it goes on
    seen.append(handle.result().name)
    return seen


def test_an_error_in_the_background_surfaces_on_every_rank_at_the_next_call(pools, tmp_path):
    for error, latest, after in pools.run(2, _fail_on_rank_1, str(tmp_path)):
        assert "step-2 failed, nothing was committed: rank 1: OSError: [Errno 28] No space" in error
        assert latest.endswith("step-1")
        assert after == "step-3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3"]


def test_a_failed_handle_raises_once_and_the_checkpointer_goes_on(tmp_path, monkeypatch):
    import funcshard._src.checkpoint.save as saving

    monkeypatch.setattr(commit, "_current_run", None)
    state = {"w": torch.ones(3)}
    with fs.checkpoint.AsyncCheckpointer() as saver:
        with monkeypatch.context() as patched:
            patched.setattr(saving, "write_manifest", _raise_disk_full)
            handle = saver.save(tmp_path / "a", state)
            with pytest.raises(CheckpointError, match=r"a failed on rank 0: OSError: disk full"):
                handle.result()
        assert saver.save(tmp_path / "b", state).result() == tmp_path / "b"  # reported: no raise
    assert fs.checkpoint.latest(tmp_path) == tmp_path / "b"


def _raise_disk_full(*_: Any) -> None:
    raise OSError("disk full")


@pytest.mark.parametrize("point", ["write_chunks", "write_manifest"])
def test_a_sigkill_in_the_middle_of_an_async_write_leaves_the_previous_checkpoint(tmp_path, point):
    """The child saves step-1, then step-2 asynchronously and stops in the middle of writing it
    (after its data files, or after the manifest before the rename); it is killed there."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.async_kill", str(tmp_path), point],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert child.stdout is not None
    line = child.stdout.readline()  # blocks until the child is in the middle of the write
    assert line.strip() == "writing", line
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    staging, committed = sorted(p.name for p in tmp_path.iterdir())
    assert staging.startswith(".step-2.tmp-")
    assert committed == "step-1"
    assert fs.checkpoint.latest(tmp_path, run="killed") == tmp_path / "step-1"
    assert torch.equal(fs.checkpoint.load_full(tmp_path / "step-1")["w"], torch.arange(4.0))
    fs.checkpoint.save(tmp_path / "step-3", {"w": torch.zeros(4)}, step=3, keep=1, run="killed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-3"]  # the interrupted one too


def test_staging_packs_chunks_into_batches_and_reuses_them():
    """[Note: staging in batches] in ``checkpoint/staging.py``: on the CPU, plain memory; 64-byte aligned views."""
    from funcshard._src.checkpoint.staging import Staging

    staging = Staging(batch_bytes=256)
    views = {
        "a": torch.arange(25.0),
        "b": torch.ones(3, 2, dtype=torch.float64),
        "c": torch.arange(40),
    }
    out = staging.stage(views)
    # a: 100 bytes -> 128, b: 48 -> 64 share one batch; c: 320 bytes is a batch of its own
    assert staging.batches == 2
    assert staging.held_bytes == 192 + 320
    assert staging.chunk_bytes == 100 + 48 + 320
    assert all(torch.equal(out[k], v) for k, v in views.items())
    assert all(out[k].data_ptr() % 64 == 0 for k in out)
    pointers = [t.data_ptr() for t in out.values()]
    views["a"].add_(1)
    again = staging.stage(views)
    assert [t.data_ptr() for t in again.values()] == pointers  # the same buffers, new values
    assert torch.equal(again["a"], torch.arange(25.0) + 1)
    staging.stage({"a": torch.zeros(3)})
    assert staging.batches == 1
    assert staging.chunk_bytes == 12
