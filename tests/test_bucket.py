"""Buckets: small consecutive units share collectives, and training is unchanged.

Reference: ``funcshard/_src/execute/param_group.py``. Every bucket size trains like one
device (also drawn in tests/test_value_and_grad.py); these cases add a unit called
twice in a step (a bucket flushed early), micro-batches kept unsharded, every
strategy, the ledger against the cost model, and the count of collectives.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import funcshard as fs
from funcshard._src.comm import collectives
from funcshard.testing import assert_trees_close, reference_value_and_grad
from tests.models import Model

MODEL = Model(kind="mlp", width=6, layers=6)


ORDERS = {
    "tied": [0, 1, 2, 3, 4, 1, 5],  # block 1 again after block 4: a round flushed early
    # block 0 again while blocks 2-5 still wait on the first gather, never to be called
    "partial": [0, 1, 0],
}


def _tied_loss(params: Any, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """MODEL's loss with the blocks called in ``ORDERS[params order]``: one unit used twice."""
    h = params["embed"]["tokens"][tokens]
    for i in ORDERS[_ORDER[0]]:
        h = fs.call(MODEL._block, params["blocks"][i], h)
    logits = h @ params["head"]["w"] * params["head"]["temp"]
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten())


_ORDER = ["tied"]


def _train(
    mesh: dict[str, int],
    strategy: Any,
    bucket_bytes: int | None,
    tied: bool,
    micro: int,
    order: str = "tied",
) -> dict[str, Any]:
    _ORDER[0] = order
    params = MODEL.init(0)
    plan = fs.plan(params, fs.Mesh(mesh), units=MODEL.units, strategy=strategy)
    loss_fn = _tied_loss if tied else MODEL.loss_fn
    step = fs.value_and_grad(loss_fn, plan, bucket_bytes=bucket_bytes)
    sparams = fs.shard(params, plan)
    gathers = {"n": 0}
    original, pieces = collectives.all_gather, collectives.all_gather_pieces

    def counted(call: Any) -> Any:
        def counting(*args: Any, **kwargs: Any) -> Any:
            gathers["n"] += 1
            return call(*args, **kwargs)

        return counting

    # this worker's module: counts the unit gathers
    collectives.all_gather, collectives.all_gather_pieces = counted(original), counted(pieces)
    try:
        for t in range(2):
            gathers["n"] = 0
            step.ledger.reset()
            batches = [MODEL.batch_for(100 * t + 10 * fs.rank() + m) for m in range(micro)]
            if micro == 1:
                _, grads = step(sparams, *batches[0])
            else:
                _, grads = step.accumulate(sparams, batches, mode="unsharded")
    finally:
        collectives.all_gather, collectives.all_gather_pieces = original, pieces
    units = step._runtimes()
    return {
        "grads": fs.unshard(grads),
        "ledger": step.ledger.total(),
        "expected": sum(fs.cost.estimate(plan).comm.values()),
        "gathers": gathers["n"],
        # a unit's gathers when not bucketed: one per part; a part gathered leaf by leaf
        # writes all its leaves in one (collectives.all_gather_pieces)
        "per_gather": {u.name: sum(not p.aliased for p in u.parts) for u in units},
        "buckets": sum(len(m) > 1 for m in step._members),
    }


def _reference(mesh: dict[str, int], tied: bool, micro: int, order: str = "tied") -> Any:
    _ORDER[0] = order
    world = 1
    for n in mesh.values():
        world *= n
    loss_fn = _tied_loss if tied else MODEL.loss_fn
    batches = [MODEL.batch_for(100 + 10 * r + m) for r in range(world) for m in range(micro)]
    return reference_value_and_grad(loss_fn, MODEL.init(0), batches)[1]


CASES = [
    ({"fsdp": 2}, "full_shard"),
    ({"fsdp": 2}, "shard_grad_op"),
    ({"fsdp": 2}, "no_shard"),
    ({"dp": 2, "fsdp": 2}, "hybrid_shard"),
]


@pytest.mark.parametrize(("mesh", "strategy"), CASES, ids=[s for _, s in CASES])
@pytest.mark.parametrize("bucket_bytes", [0, 400, None], ids=["none", "pairs", "default"])
def test_every_bucket_size_trains_like_one_device_and_counts_its_bytes(
    pools, mesh, strategy, bucket_bytes
):
    world = 4 if "dp" in mesh else 2
    expected = _reference(mesh, tied=False, micro=1)
    for r in pools.run(world, _train, mesh, strategy, bucket_bytes, False, 1):
        assert_trees_close(r["grads"], expected, rtol=1e-5, atol=1e-6)
        assert r["ledger"] == r["expected"]  # bytes are the cost model's for any bucket size
        assert (r["buckets"] > 0) == (bucket_bytes != 0)


def test_buckets_issue_fewer_gathers(pools):
    """full_shard W=2, six blocks: one gather per bucket instead of one per unit, twice a step."""
    (one, *_) = pools.run(2, _train, {"fsdp": 2}, "full_shard", 0, False, 1)
    (pairs, *_) = pools.run(2, _train, {"fsdp": 2}, "full_shard", 400, False, 1)
    (every, *_) = pools.run(2, _train, {"fsdp": 2}, "full_shard", None, False, 1)
    per = one["per_gather"]
    blocks = [per[f"blocks/{i}"] for i in range(6)]
    assert blocks == [blocks[0]] * 6
    # the root unit once, each block in forward and backward
    assert one["gathers"] == per["<root>"] + 2 * sum(blocks)
    assert every["buckets"] == 1
    assert every["gathers"] == per["<root>"] + 2
    assert per["<root>"] + 2 < pairs["gathers"] < one["gathers"]


@pytest.mark.parametrize(
    ("tied", "order"),
    [(True, "tied"), (True, "partial"), (False, "tied")],
    ids=["unit-called-twice", "called-again-while-others-wait", "micro-batches"],
)
def test_a_bucket_flushed_early_or_kept_unsharded_trains_like_one_device(pools, tied, order):
    micro = 1 if tied else 2
    expected = _reference({"fsdp": 2}, tied=tied, micro=micro, order=order)
    for r in pools.run(2, _train, {"fsdp": 2}, "full_shard", None, tied, micro, order):
        assert_trees_close(r["grads"], expected, rtol=1e-5, atol=1e-6)
        assert r["buckets"] == 1


def test_bucket_bytes_must_be_a_size():
    plan = fs.plan({"w": torch.ones(2)}, fs.Mesh({"fsdp": 1}))
    for bad in (-1, True):
        with pytest.raises(ValueError, match="bucket_bytes must be a number of bytes"):
            fs.value_and_grad(lambda p: p["w"].sum(), plan, bucket_bytes=bad)
