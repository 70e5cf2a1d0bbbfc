"""Activation checkpoints around fs.call: the recompute replays the call with the gathered leaves.

See [Note: recomputes in backward] in funcshard/_src/execute/replay.py. The
reference is the same loss_fn without checkpoints, sharded the same way: a
checkpoint changes where activations come from, never the values, the bytes a
step sends or the gathered peak. A failure names the checkpoint kind, the
strategy and the leaf.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.utils.checkpoint as checkpoint_utils

import funcshard as fs
from funcshard._src.execute.replay import hold
from funcshard._src.execute.run import step_run

KINDS = ["none", "non-reentrant", "reentrant", "spanning", "spanning-reentrant"]


def init_params() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64) / shape[0] ** 0.5

    return {
        "embed": w(8, 6),
        "blocks": [{"w1": w(6, 12), "w2": w(12, 6)} for _ in range(3)],
        "head": w(6, 8),
    }


def block(p: Any, h: torch.Tensor) -> torch.Tensor:
    return h + torch.tanh(h @ p["w1"]) @ p["w2"]


def loss_fn(kind: str) -> Any:
    """The loss, its blocks under checkpoints of ``kind`` (spanning: two units and a root op in one)."""

    def run(params: Any, tokens: torch.Tensor) -> torch.Tensor:
        h = params["embed"][tokens]
        blocks = params["blocks"]
        if kind.startswith("spanning"):

            def two(h: torch.Tensor) -> torch.Tensor:
                return (
                    fs.call(block, blocks[1], fs.call(block, blocks[0], h)) * params["head"][:, 0]
                )

            h = checkpoint_utils.checkpoint(two, h, use_reentrant=kind.endswith("reentrant"))
            h = fs.call(block, blocks[2], h)
        else:
            for i, blk in enumerate(blocks):
                if kind == "none":
                    h = fs.call(block, blk, h)
                else:
                    h = checkpoint_utils.checkpoint(
                        lambda h, blk=blk: fs.call(block, blk, h),
                        h,
                        use_reentrant=kind == "reentrant",
                    )
                if i == 1:
                    h = h * params["head"][:, 0]
        return (h @ params["head"]).square().mean()

    return run


def _step(kind: str, strategy: Any) -> dict[str, Any]:
    params = init_params()
    plan = fs.plan(
        params, fs.Mesh({"fsdp": fs.world_size()}), units=["blocks/*"], strategy=strategy
    )
    step = fs.value_and_grad(loss_fn(kind), plan)
    tokens = torch.randint(0, 8, (2, 5), generator=torch.Generator().manual_seed(fs.rank()))
    loss, grads = step(fs.shard(params, plan), tokens)
    return {
        "loss": float(loss),
        "grads": fs.unshard(grads),
        "sent": dict(step.ledger.bytes_by_key),
        "peak": step.stats.peak_gathered_bytes,
    }


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op"])
@pytest.mark.parametrize("kind", KINDS[1:])
def test_a_checkpoint_around_fs_call_equals_the_step_without_it(
    pools: Any, kind: str, strategy: str
):
    """Gradients equal; the bytes sent and the gathered peak are those of the step without it."""
    base = pools.run(2, _step, "none", strategy)
    got = pools.run(2, _step, kind, strategy)
    for rank, (a, b) in enumerate(zip(got, base)):
        paths = fs.tree.leaf_paths(a["grads"])
        for path, x, y in zip(paths, fs.tree.leaves(a["grads"]), fs.tree.leaves(b["grads"])):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-12, msg=f"rank {rank}: {path}")
        assert a["sent"] == b["sent"], f"rank {rank}"
        assert a["peak"] == b["peak"], f"rank {rank}"


def _held_after_the_step() -> str:
    params = init_params()
    plan = fs.plan(params, fs.Mesh({"fsdp": fs.world_size()}), units=["blocks/*"])
    seen: list[Any] = []

    def loss(p: Any, tokens: torch.Tensor) -> torch.Tensor:
        seen.append(step_run())
        return loss_fn("none")(p, tokens)

    step = fs.value_and_grad(loss, plan)
    step(fs.shard(params, plan), torch.zeros(2, 5, dtype=torch.long))
    run = seen[0]
    try:
        hold(run, run.calls[0].unit)
    except RuntimeError as e:
        return str(e)
    return "held"


def test_a_recompute_after_the_units_gradients_were_reduced_is_refused(pools: Any):
    for message in pools.run(2, _held_after_the_step):
        assert "ran again in backward" in message
        assert "after its gradients were reduced" in message
