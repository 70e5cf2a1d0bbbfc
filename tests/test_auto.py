"""Automatic plans: unit boundaries from the tree, strategies from a budget, clear refusals."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import funcshard as fs
from funcshard._src.plan.activations import Workload
from funcshard._src.plan.auto import BudgetError, _by_communication, ladder
from funcshard._src.plan.cost import estimate
from funcshard._src.plan.cost_model import CostModel
from funcshard._src.plan.presets import get_preset
from funcshard._src.plan.strategy import Strategy

GiB = 2**30


def _meta(*shape: int) -> torch.Tensor:
    return torch.empty(*shape, device="meta")


def _stack(n: int, width: int = 64) -> dict[str, Any]:
    return {
        "embed": _meta(1000, width),
        "layers": [{"attn": {"w": _meta(width, width)}, "mlp": _meta(width, 4 * width)}] * n,
        "norm": _meta(width),
    }


# -- units="auto" ------------------------------------------------------------------------------


def test_auto_units_are_the_layers_of_a_stack_and_subtrees_as_large_as_one():
    plan = fs.plan(_stack(3), fs.Mesh({"fsdp": 2}), units="auto")
    # the embedding (64,000 params) outweighs a layer (20,480): a unit; the norm stays in the root
    assert [u.name for u in plan.units] == ["<root>", "embed", "layers/0", "layers/1", "layers/2"]
    assert plan.unit("<root>").paths == ("norm",)
    assert any("one unit per element of the layer stack 'layers'" in n for n in plan.notes)


@pytest.mark.parametrize(
    ("preset", "expected"),
    [
        ("llama-7b", {"layers"}),  # its 131M-parameter embedding is smaller than a layer
        ("bloom-7b", {"layers", "embed"}),  # its 1B-parameter embedding is not
        ("t5-11b", {"encoder/layers", "decoder/layers"}),
    ],
)
def test_auto_units_of_presets(preset, expected):
    p = get_preset(preset)
    plan = fs.plan(p.params(), fs.Mesh({"fsdp": 8}), units="auto")
    prefixes = {u.name.rsplit("/", 1)[0] if u.name[-1].isdigit() else u.name for u in plan.units}
    assert prefixes - {"<root>"} == expected
    assert len([u for u in plan.units if u.name[-1].isdigit()]) == p.config.n_layers


def test_auto_units_without_a_stack_split_large_subtrees():
    params = {
        "encoder": {"a": _meta(100, 100), "b": _meta(100, 100)},
        "head": _meta(100, 30),
        "bias": _meta(3),
    }
    plan = fs.plan(params, fs.Mesh({"fsdp": 2}), units="auto")
    assert [u.name for u in plan.units] == ["<root>", "encoder/a", "encoder/b", "head"]
    assert plan.unit("<root>").paths == ("bias",)


# -- strategy="auto" ---------------------------------------------------------------------------


def _totals(params: Any, mesh: fs.Mesh, cost: CostModel) -> tuple[int, int]:
    """Model-state bytes of all-full_shard (the least) and all-no_shard (the most)."""
    least = estimate(fs.plan(params, mesh, units="auto", strategy="full_shard"), cost)
    most = estimate(fs.plan(params, mesh, units="auto", strategy="no_shard"), cost)
    return least.memory.total, most.memory.total


MESHES = [fs.Mesh({"fsdp": 4}), fs.Mesh({"dp": 2, "fsdp": 4})]


def test_a_generous_budget_keeps_no_shard_and_a_tight_one_shards_everything():
    params, mesh = _stack(4), fs.Mesh({"fsdp": 4})
    least, most = _totals(params, mesh, CostModel())
    loose = fs.plan(params, mesh, units="auto", strategy="auto", memory_budget=most)
    tight = fs.plan(params, mesh, units="auto", strategy="auto", memory_budget=least)
    assert {u.strategy for u in loose.units} == {"no_shard"}
    # the root unit stays gathered all step under either: shard_grad_op costs it no more
    assert {u.strategy for u in tight.units if not u.is_root} == {"full_shard"}
    assert estimate(tight).memory.total == least
    assert dict(tight.reasons)["layers/0"] == "with shard_grad_op the plan exceeds " + (
        fs_format(least)
    )


def fs_format(n: int) -> str:
    from funcshard._src.plan.sizes import format_bytes

    return format_bytes(n)


@settings(max_examples=40)
@given(
    n=st.integers(1, 5),
    mesh=st.sampled_from(MESHES),
    a=st.floats(0, 1),
    b=st.floats(0, 1),
    optimizer=st.sampled_from(["sgd", "sgd_momentum", "adamw"]),
)
def test_the_auto_plan_fits_and_a_stricter_budget_never_shards_less(n, mesh, a, b, optimizer):
    params, cost = _stack(n), CostModel(optimizer=optimizer)
    least, most = _totals(params, mesh, cost)
    loose_budget, strict_budget = (int(least + x * (most - least)) for x in sorted((a, b))[::-1])
    plans = [
        fs.plan(params, mesh, units="auto", strategy="auto", memory_budget=budget, cost=cost)
        for budget in (loose_budget, strict_budget)
    ]
    for plan, budget in zip(plans, (loose_budget, strict_budget)):
        assert estimate(plan, cost).memory.total <= budget
    order = _by_communication(
        list(ladder(mesh)),
        {s: estimate(fs.plan(params, mesh, units="auto", strategy=s)).comm for s in ladder(mesh)},
        mesh,
        None,
    )
    loose, strict = ({u.name: order.index(u.strategy) for u in p.units} for p in plans)
    assert all(strict[name] >= level for name, level in loose.items())


def test_hybrid_shard_comes_before_shard_grad_op_when_it_sends_less_time():
    """On 2 nodes of 8 with fast links inside a node, hybrid_shard's traffic mostly stays inside."""
    params, mesh = get_preset("llama-7b").params(), fs.Mesh({"dp": 2, "fsdp": 8})
    plans: dict[Strategy, fs.Plan] = {
        s: fs.plan(params, mesh, units=["layers/*"], strategy=s) for s in ladder(mesh)
    }
    comm: dict[Strategy, Any] = {s: estimate(plan).comm for s, plan in plans.items()}
    by_bytes = _by_communication(list(ladder(mesh)), comm, mesh, None)
    on_a100 = _by_communication(list(ladder(mesh)), comm, mesh, fs.cost.hardware("a100-80gb"))
    assert by_bytes == ["no_shard", "shard_grad_op", "hybrid_shard", "full_shard"]
    assert on_a100 == ["no_shard", "hybrid_shard", "shard_grad_op", "full_shard"]


# -- refusals ----------------------------------------------------------------------------------


def test_auto_without_a_budget_is_refused():
    with pytest.raises(ValueError, match="strategy='auto' needs memory_budget"):
        fs.plan(_stack(2), fs.Mesh({"fsdp": 2}), strategy="auto")


def test_a_budget_smaller_than_the_largest_unit_names_the_unit():
    with pytest.raises(BudgetError, match=r"smaller than unit 'embed' alone .* split it"):
        fs.plan(_stack(2), fs.Mesh({"fsdp": 2}), units="auto", strategy="auto", memory_budget=4096)


def _refusal(preset_name: str, ranks: int, cost: CostModel) -> tuple[str, int]:
    preset = get_preset(preset_name)
    mesh = fs.Mesh({"fsdp": ranks})
    with pytest.raises(BudgetError) as info:
        fs.plan(
            preset.params(),
            mesh,
            units=[preset.unit_pattern],
            strategy="auto",
            memory_budget="80GiB",
            cost=cost,
        )
    least = fs.plan(preset.params(), mesh, units=[preset.unit_pattern], strategy="full_shard")
    return str(info.value), estimate(least, cost).memory.total - 80 * GiB


def test_when_the_model_state_does_not_fit_the_error_says_how_many_ranks_would():
    message, missing = _refusal("llama-70b", 8, CostModel())
    assert f"({missing:,} bytes) too many per rank" in message
    found = re.search(r"Would fit: (\d+) ranks \(fsdp=\1\)", message)
    assert found is not None, message
    ranks = int(found[1])
    params = get_preset("llama-70b").params()

    def fits(n: int) -> bool:
        plan = fs.plan(params, fs.Mesh({"fsdp": n}), units=["layers/*"], strategy="full_shard")
        return estimate(plan).memory.total <= 80 * GiB

    assert fits(ranks)
    assert not fits(ranks // 2)


def test_when_activations_do_not_fit_the_error_offers_remat_and_a_smaller_batch():
    preset = get_preset("llama-13b")
    cost = CostModel(
        mixed_precision=fs.MixedPrecision(torch.bfloat16, torch.float32),
        workload=Workload(preset.config, batch_size=2),
    )
    message, missing = _refusal("llama-13b", 8, cost)
    assert f"({missing:,} bytes) too many per rank (of which activations" in message
    assert (
        "Would fit: remat=True (recompute activations in backward); or batch_size=1 per rank"
        in message
    )
    assert "ranks (fsdp=" not in message  # activations do not shrink with more ranks


def test_a_fixed_strategy_over_budget_is_refused():
    with pytest.raises(BudgetError, match=r"no plan fits memory_budget 1.00 KiB per rank"):
        fs.plan(_stack(2, width=8), fs.Mesh({"fsdp": 2}), units="auto", memory_budget="1KiB")


@pytest.mark.parametrize("budget", ["lots", -5, "80 parsecs", 1.5])
def test_a_malformed_budget_is_refused(budget):
    with pytest.raises((ValueError, TypeError), match=r"memory_budget|size"):
        fs.plan(_stack(2), fs.Mesh({"fsdp": 2}), strategy="auto", memory_budget=budget)


# -- the plan explains itself ------------------------------------------------------------------


def test_explain_gives_strategy_and_why_per_unit_memory_comm_and_assumptions():
    params, mesh = _stack(3), fs.Mesh({"fsdp": 4})
    least, most = _totals(params, mesh, CostModel())
    plan = fs.plan(params, mesh, units="auto", strategy="auto", memory_budget=(least + most) // 2)
    text = plan.explain()
    assert "why" in text
    assert "least communication, and the plan fits" in text
    for category in ["params", "grads", "optimizer", "mixed precision", "gathered", "activations"]:
        assert re.search(rf"^{category} +", text, re.M), category
    assert "to spare" in text
    assert re.search(r"^all_gather +fsdp", text, re.M)
    assert "Assumptions:" in text
    assert "- optimizer adamw" in text


def test_an_auto_plan_round_trips_through_json():
    params, mesh = _stack(2), fs.Mesh({"fsdp": 4})
    least, most = _totals(params, mesh, CostModel())
    plan = fs.plan(params, mesh, units="auto", strategy="auto", memory_budget=(least + most) // 2)
    again = fs.Plan.from_json(plan.to_json())
    assert again.units == plan.units
    assert again.reasons == plan.reasons
    assert again.fingerprint() == plan.fingerprint()
