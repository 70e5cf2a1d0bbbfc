"""Failures surface instead of hanging: killed workers, diverged ranks, non-finite gradients.

Each test names what it breaks; the pool restarts its workers after a body fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import funcshard as fs
from funcshard.testing import assert_trees_close
from tests.models import Model
from tests.pool import WorkerError

MODEL = Model(kind="mlp", width=6, layers=2)
ROOT = Path(__file__).resolve().parents[1]


def _torchrun(directory: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", "1", str(ROOT / "tests" / "fault_train.py"), str(directory), "8", *extra,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=300, check=False
    )


def test_a_killed_worker_restarts_from_the_latest_checkpoint(tmp_path):
    """torchrun --max-restarts=1; rank 1 SIGKILLs itself after step 5: the job resumes from step 4 and
    ends with the same parameters as an undisturbed run."""
    undisturbed = _torchrun(tmp_path / "calm")
    assert undisturbed.returncode == 0, undisturbed.stderr[-3000:]
    disturbed = _torchrun(tmp_path / "killed", "--kill-at", "5")
    assert disturbed.returncode == 0, disturbed.stderr[-3000:]
    assert "exitcode: -9" in disturbed.stderr  # rank 1 was killed ...
    assert (
        "CollectiveError" in disturbed.stderr
    )  # ... and rank 0's collective said so instead of hanging
    calm = fs.checkpoint.load_full(tmp_path / "calm" / "final")
    killed = fs.checkpoint.load_full(tmp_path / "killed" / "final")
    assert_trees_close(killed, calm, rtol=0, atol=0)
    assert sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir()) == [
        "step0006",
        "step0008",
    ]


def _plan_for_rank() -> None:
    units = ["blocks/*"] if fs.rank() == 0 else ["blocks"]  # rank 1 diverged in its configuration
    params = MODEL.init(0)
    plan = fs.plan(params, fs.Mesh({"fsdp": 2}), units=units)
    fs.value_and_grad(MODEL.loss_fn if fs.rank() == 0 else _whole_blocks_loss, plan)(
        fs.shard(params, plan), *MODEL.batch_for(0)
    )


def _whole_blocks_loss(params, tokens, targets):
    return Model(kind="mlp", width=6, layers=2, grouping="all_blocks").loss_fn(
        params, tokens, targets
    )


def test_ranks_with_different_plans_fail_before_the_first_collective(pools):
    with pytest.raises(
        WorkerError,
        match=r"(?s)--- rank 0 ---.*DesyncError: fs.shard: ranks passed different plans or params: rank 1: plan fingerprint [0-9a-f]{16} \(rank 0: [0-9a-f]{16}\).*--- rank 1 ---.*DesyncError",
    ):
        pools.run(2, _plan_for_rank)


def _peer_stops_early() -> None:
    fs.set_collective_timeout(3)
    try:
        params = MODEL.init(0)
        plan = fs.plan(params, fs.Mesh({"fsdp": 2}), units=MODEL.units)

        def loss_fn(p, tokens, targets):
            if fs.rank() == 1:
                raise RuntimeError("rank 1 gives up")  # after the root's gather, before any unit
            return MODEL.loss_fn(p, tokens, targets)

        fs.value_and_grad(loss_fn, plan)(fs.shard(params, plan), *MODEL.batch_for(0))
    finally:
        fs.set_collective_timeout(None)


def test_a_peer_that_stops_surfaces_as_an_error_naming_the_unit_collective_and_rank(pools):
    with pytest.raises(
        WorkerError,
        match=r"(?s)--- rank 0 ---.*CollectiveError: all_gather of unit 'blocks/1' over mesh axes \['fsdp'\] on rank 0 failed: .*A peer rank died or is running other collectives.*--- rank 1 ---.*rank 1 gives up",
    ):
        pools.run(2, _peer_stops_early)


def _different_collectives() -> None:
    from funcshard._src.comm import collectives, groups

    os.environ["FUNCSHARD_DEBUG"] = "1"
    try:
        bound = groups.bind(fs.Mesh({"fsdp": 2}))
        if fs.rank() == 0:
            collectives.all_gather(torch.ones(3), bound, ("fsdp",), tag="blocks/0").wait()
        else:
            collectives.reduce_scatter(torch.ones(2, 5), bound, ("fsdp",), tag="blocks/1").wait()
    finally:
        del os.environ["FUNCSHARD_DEBUG"]


def test_debug_mode_compares_every_collective(pools):
    with pytest.raises(
        WorkerError,
        match=r"(?s)DesyncError: ranks issue different collectives at all_gather of unit 'blocks/0'.*rank 0: \('all_gather', 'blocks/0', \(3,\), 'torch.float32'\); rank 1: \('reduce_scatter', 'blocks/1', \(2, 5\), 'torch.float32'\)",
    ):
        pools.run(2, _different_collectives)


def _nonfinite_on_one_rank() -> tuple[bool, int, bool]:
    params = {"w": torch.ones(4), "b": torch.ones(3)}
    plan = fs.plan(params, fs.Mesh({"fsdp": 2}))
    sparams = fs.shard(params, plan)
    grads = fs.shard({"w": torch.ones(4), "b": torch.ones(3)}, plan)
    if fs.rank() == 1:
        grads["b"].local[0] = float("nan")  # only rank 1 holds the bad element
    finite = fs.optim.all_finite(grads)
    opt = fs.optim.skip_nonfinite(fs.optim.sgd(lr=0.5))
    sparams, state = opt.update(grads, opt.init(sparams), sparams)
    unchanged = bool(torch.equal(fs.unshard(sparams)["w"], params["w"]))
    return finite, int(state.skipped), unchanged


def test_nonfinite_gradients_on_any_rank_skip_the_step_everywhere(pools):
    assert pools.run(2, _nonfinite_on_one_rank) == [(False, 1, True)] * 2
