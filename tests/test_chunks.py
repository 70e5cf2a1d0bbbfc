"""Reductions in chunks ([Note: reductions in chunks] in ``execute/param_group.py``).

A part whose packed gradients pass ``LARGE_BYTES`` is reduced a range of columns
at a time: a flat part any range, a leaf layout whole slots or whole rows of a
slot's chunk. The threshold is lowered inside the workers so that a small model's
units take that path; the gradients must be bitwise those of the whole
reduce-scatter, and the ledger the same bytes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import funcshard as fs
from funcshard._src.comm import transport
from funcshard._src.execute import param_group
from tests.models import Model

WHOLE = param_group.reduce_in_chunks  # put back after each worker body


def _grads(
    mesh: dict[str, int], strategy: str, layout: str, large: int | None, micro: int, mode: Any
) -> dict[str, Any]:
    """Worker body: two steps' gradients, ledger and how many parts were reduced in chunks."""
    count = [0]

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        count[0] += 1
        return WHOLE(*args, **kwargs)

    # the worker outlives this call: put both back after it
    param_group.LARGE_BYTES = transport.LARGE_BYTES if large is None else large
    param_group.reduce_in_chunks = counted
    try:
        return _step(mesh, strategy, layout, micro, mode) | {"chunked": count[0]}
    finally:
        param_group.LARGE_BYTES = transport.LARGE_BYTES
        param_group.reduce_in_chunks = WHOLE


def _step(
    mesh: dict[str, int], strategy: Any, layout: Any, micro: int, mode: Any
) -> dict[str, Any]:
    # in the leaf layout only the root unit is reduced in chunks: the embedding is the root's
    # there, and its 66 rows do not divide by 4, so at W=4 it is split on its columns
    model = Model(
        kind="transformer", vocab=66, width=16, hidden=32, layers=2, embed_unit=layout == "flat"
    )
    params = model.init(0)
    plan = fs.plan(params, fs.Mesh(mesh), units=model.units, strategy=strategy, layout=layout)
    sparams = fs.shard(params, plan)
    step = fs.value_and_grad(model.loss_fn, plan, donate_grads=True)
    batches = [model.batch_for(10 * fs.rank() + m) for m in range(micro)]
    step.accumulate(sparams, batches, mode=mode)  # learns the call order; donates
    step.ledger.reset()
    _, grads = step.accumulate(sparams, batches, mode=mode)
    return {
        "grads": [g.clone() for g in fs.tree.leaves(fs.unshard(grads)) if g is not None],
        "ledger": dict(step.ledger.bytes_by_key),
    }


@pytest.mark.parametrize(
    ("world_size", "mesh", "strategy", "layout"),
    [
        (2, {"fsdp": 2}, "full_shard", "flat"),
        (4, {"fsdp": 4}, "shard_grad_op", "flat"),
        (2, {"fsdp": 2}, "full_shard", "leaf"),
        (4, {"fsdp": 4}, "full_shard", "leaf"),
    ],
)
def test_a_reduction_in_chunks_is_bitwise_the_whole_one(pools, world_size, mesh, strategy, layout):
    """Every unit past a 1 KiB threshold: one micro-batch, and three kept ("unsharded")."""
    for micro, mode in ((1, "sharded"), (3, "unsharded")):
        whole = pools.run(world_size, _grads, mesh, strategy, layout, None, micro, mode)
        chunked = pools.run(world_size, _grads, mesh, strategy, layout, 1024, micro, mode)
        for w, c in zip(whole, chunked):
            assert w["chunked"] == 0
            assert c["chunked"] > 0
            assert c["ledger"] == w["ledger"]
            for a, b in zip(w["grads"], c["grads"]):
                assert torch.equal(a, b)
