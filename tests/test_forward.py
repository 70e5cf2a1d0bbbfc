"""Evaluation with ``fs.forward``: outputs equal the unsharded function, each unit is gathered once.

Every rank evaluates its own batch on sharded params and gets what the pure
function returns on the full params in one process. The unit trace shows one
all-gather per call and no reduction; the gathered bytes alive at once stay
within the root unit plus ``1 + prefetch`` units, whatever the strategy (an
evaluation frees every unit right after its call).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import funcshard as fs
from tests.models import Model

MODEL = Model(kind="transformer", vocab=16, width=8, hidden=16, layers=4, heads=2, embed_unit=True)


def _logits(model: Model) -> Any:
    def fn(params: Any, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, Any]:
        loss = model.loss_fn(params, tokens, targets)
        return loss, {"loss_times_two": 2 * loss}

    return fn


def _evaluate(model: Model, mesh: dict[str, int], strategy: Any, prefetch: int) -> dict[str, Any]:
    params = model.init(0)
    plan = fs.plan(params, fs.Mesh(mesh), units=model.units, strategy=strategy)
    sparams = fs.shard(params, plan)
    step = fs.value_and_grad(_logits(model), plan, has_aux=True, prefetch=prefetch, bucket_bytes=0)
    step.memory.events = []
    outs = [step.forward(sparams, *model.batch_for(10 * t + fs.rank())) for t in range(2)]
    events = list(step.memory.events)
    units = step._runtimes()
    per_unit = {
        u.name: u.gathered_bytes
        + u.group_size * sum(p.layout.nbytes for p in u.parts if not p.aliased)
        for u in units
    }
    evaluate = fs.forward(
        _logits(model), plan, prefetch=prefetch, bucket_bytes=0
    )  # the public spelling
    again = evaluate(sparams, *model.batch_for(fs.rank()))
    return {
        "outs": outs,
        "again": again,
        "events": events,
        "peak": step.stats.peak_gathered_bytes,
        "root": per_unit.get("<root>", 0),
        "max_unit": max(c for name, c in per_unit.items() if name != "<root>"),
        "ledger": dict(step.ledger.bytes_by_key),
        "requires_grad": outs[0][0].requires_grad,
    }


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op", "no_shard"])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_evaluation_equals_the_unsharded_function(pools, strategy, prefetch):
    results = pools.run(2, _evaluate, MODEL, {"fsdp": 2}, strategy, prefetch)
    params = MODEL.init(0)
    fn = _logits(MODEL)
    for rank, r in enumerate(results):
        for t, (loss, aux) in enumerate(r["outs"]):
            expected, expected_aux = fn(params, *MODEL.batch_for(10 * t + rank))
            torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(aux["loss_times_two"], expected_aux["loss_times_two"])
        torch.testing.assert_close(r["again"][0], fn(params, *MODEL.batch_for(rank))[0])
        assert not r["requires_grad"]  # no graph: nothing kept for a backward


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op"])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_each_unit_is_gathered_once_and_nothing_is_reduced(pools, strategy, prefetch):
    """One all-gather per call, no reduction, gathered bytes within root + (1 + prefetch) units."""
    for r in pools.run(2, _evaluate, MODEL, {"fsdp": 2}, strategy, prefetch):
        events = r["events"]
        assert not [e for e in events if e[0] == "reduce"]
        starts = [u for e, u in events if e == "start"]
        calls = [f"blocks/{i}" for i in range(MODEL.layers)] + ["embed"]
        assert sorted(starts) == sorted(["<root>", *calls] * 2)  # two evaluations, once each
        assert set(r["ledger"]) == {("all_gather", ("fsdp",))}
        assert r["peak"] <= r["root"] + (1 + prefetch) * r["max_unit"]


def _nested(model: Model) -> None:
    params = model.init(0)
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=model.units)
    sparams = fs.shard(params, plan)
    evaluate = fs.forward(model.loss_fn, plan)
    step = fs.value_and_grad(lambda p, *b: evaluate(sparams, *b) + model.loss_fn(p, *b), plan)
    step(sparams, *model.batch_for(0))


def test_an_evaluation_inside_a_step_is_refused():
    with pytest.raises(RuntimeError, match="evaluation was called inside a step's loss_fn"):
        _nested(MODEL)


def test_evaluation_of_frozen_leaves_under_mixed_precision():
    """Frozen leaves are gathered in the compute dtype like the others."""
    params = MODEL.init(0)
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=MODEL.units, frozen=["embed"])
    mp = fs.MixedPrecision(param_dtype=torch.bfloat16)
    seen: list[torch.dtype] = []

    def fn(p: Any, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        seen.append(fs.call(lambda e: e["tokens"].dtype, p["embed"]))
        return MODEL.loss_fn(p, tokens, targets)

    loss = fs.forward(fn, plan, mixed_precision=mp)(fs.shard(params, plan), *MODEL.batch_for(0))
    assert seen == [torch.bfloat16]
    reference = MODEL.loss_fn(
        fs.tree.map(lambda t: t.to(torch.bfloat16), params), *MODEL.batch_for(0)
    )
    torch.testing.assert_close(loss, reference)
