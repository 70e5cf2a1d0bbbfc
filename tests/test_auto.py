"""Automatic plans: unit boundaries from the tree, strategies from a budget, clear refusals."""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, cast

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import funcshard as fs
from funcshard._src.plan.activations import Workload
from funcshard._src.plan.auto import BudgetError, ladder
from funcshard._src.plan.cost import estimate
from funcshard._src.plan.cost_model import CostModel, usable_budget
from funcshard._src.plan.precision import MixedPrecision
from funcshard._src.plan.presets import get_preset

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


def test_a_generous_budget_sends_the_least_and_a_tight_one_shards_everything():
    params, mesh = _stack(4), fs.Mesh({"fsdp": 4})
    least, most = _totals(params, mesh, CostModel())
    loose = fs.plan(params, mesh, units="auto", strategy="auto", memory_budget=most)
    tight = fs.plan(params, mesh, units="auto", strategy="auto", memory_budget=least)
    # no_shard all-reduces 2 * 3/4 bytes per byte of params; shard_grad_op gathers 3/4 and
    # reduce-scatters 3/4: the same bytes in less memory, so the tie goes to shard_grad_op
    assert {u.strategy for u in loose.units} == {"shard_grad_op"}
    # the root unit stays gathered all step under either: shard_grad_op costs it no more
    assert {u.strategy for u in tight.units if not u.is_root} == {"full_shard"}
    assert estimate(tight).memory.total == least
    assert dict(tight.reasons)["layers/0"].startswith("the fewest bytes sent that fits")
    assert "no_shard exceeds " + fs_format(least) in dict(tight.reasons)["layers/0"]


def test_with_micro_batches_a_generous_budget_picks_shard_optimizer():
    """4 micro-batches: shard_optimizer gathers and reduces once per step, shard_grad_op 4 times."""
    params, mesh = _stack(4), fs.Mesh({"fsdp": 4})
    cost = CostModel(micro_batches=4)
    _, most = _totals(params, mesh, cost)
    loose = fs.plan(params, mesh, units="auto", strategy="auto", memory_budget=2 * most, cost=cost)
    assert {u.strategy for u in loose.units} == {"shard_optimizer"}
    assert "shard_grad_op sends" in dict(loose.reasons)["layers/0"]


def test_where_gathers_across_nodes_are_exposed_auto_keeps_partial_copies():
    """llama-7b on 4 nodes of 8 A100s, 256 tokens a rank (communication exposed), a budget
    that fits every unit's partial copy ([Note: partial copies] in ``plan/strategy.py``) but not shard_grad_op or
    hybrid_shard: re-gathers inside a node make partial copies the fastest plan that fits.
    With 4 micro-batches, and a budget that also fits partial gradients
    ([Note: two-hop reductions] in ``execute/param_group.py``), they are kept for the step
    (hybrid_shard_optimizer)."""
    preset = get_preset("llama-7b")
    params, mesh = preset.params(), fs.Mesh({"node": 4, "local": 8})
    for micro, expected in [(1, "partial_reshard"), (4, "hybrid_shard_optimizer")]:
        cost = CostModel(
            micro_batches=micro,
            mixed_precision=BF16,
            workload=Workload(preset.config, 1, 256, remat=True),
            hardware=fs.cost.hardware("a100-80gb"),
        )
        fixed = {
            s: estimate(fs.plan(params, mesh, units=[preset.unit_pattern], strategy=s), cost)
            for s in cast(
                tuple[Any, ...], ("full_shard", expected, "hybrid_shard", "shard_grad_op")
            )
        }
        need = fixed[expected].memory.total
        assert need < min(fixed[s].memory.total for s in ("hybrid_shard", "shard_grad_op"))
        budget = need
        while usable_budget(budget, cost) < need:  # the budget whose usable part is ``need``
            budget += 1 << 24
        plan = fs.plan(
            params,
            mesh,
            units=[preset.unit_pattern],
            strategy="auto",
            memory_budget=budget,
            cost=cost,
        )
        assert {u.strategy for u in plan.units} == {expected}
        time = estimate(plan, cost).time
        slower = fixed["full_shard"].time
        assert time is not None
        assert slower is not None
        assert time.step_s < slower.step_s


def fs_format(n: int) -> str:
    from funcshard._src.plan.sizes import format_bytes

    return format_bytes(n)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 5),
    mesh=st.sampled_from(MESHES),
    a=st.floats(0, 1),
    optimizer=st.sampled_from(["sgd", "sgd_momentum", "adamw"]),
)
def test_the_auto_plan_fits_its_budget(n, mesh, a, optimizer):
    params, cost = _stack(n), CostModel(optimizer=optimizer)
    least, most = _totals(params, mesh, cost)
    budget = int(least + a * (most - least))
    plan = fs.plan(params, mesh, units="auto", strategy="auto", memory_budget=budget, cost=cost)
    assert estimate(plan, cost).memory.total <= budget


# -- auto dominates every fixed strategy (see [Note: auto dominates] in ``plan/search.py``) --------------------------

BF16 = MixedPrecision(torch.bfloat16, torch.float32)
Axes = tuple[tuple[str, int], ...]


def _cli_cost(preset: str, hardware: str | None, *, remat: bool) -> CostModel:
    """The cost model ``funcshard plan --mixed-precision bf16 [--remat] --hardware ...`` builds."""
    return CostModel(
        mixed_precision=BF16,
        workload=Workload(get_preset(preset).config, 1, None, remat, False),
        hardware=None if hardware is None else fs.cost.hardware(hardware),
    )


def _rank(e: Any) -> tuple[float, int]:
    """Step time then memory; bytes sent then memory without a time."""
    primary = float(sum(e.comm.values())) if e.time is None else e.time.step_s
    return primary, e.memory.total


@functools.cache
def _fixed(preset: str, axes: Axes, cost: CostModel) -> dict[str, Any]:
    p, mesh = get_preset(preset), fs.Mesh(dict(axes))
    return {
        s: estimate(fs.plan(p.params(), mesh, units=[p.unit_pattern], strategy=s), cost)
        for s in ladder(mesh)
    }


def _auto(preset: str, axes: Axes, cost: CostModel, budget: int) -> tuple[Any, fs.Plan]:
    p = get_preset(preset)
    plan = fs.plan(
        p.params(),
        fs.Mesh(dict(axes)),
        units=[p.unit_pattern],
        strategy="auto",
        memory_budget=budget,
        cost=cost,
    )
    return estimate(plan, cost), plan


def _assert_dominates(auto: Any, fixed: dict[str, Any], budget: int) -> None:
    for strategy, e in fixed.items():
        if e.memory.total <= budget:
            assert _rank(auto) <= _rank(e), (strategy, _rank(auto), _rank(e))


COSTS = [
    CostModel(),
    CostModel(mixed_precision=BF16),
    CostModel(mixed_precision=BF16, micro_batches=4),  # where shard_optimizer sends the least
    _cli_cost("llama-7b", "a100-80gb", remat=True),
    _cli_cost("llama-7b", "h100-80gb", remat=False),
]


@settings(max_examples=12, deadline=None)
@given(
    preset=st.sampled_from(["llama-7b", "bloom-7b"]),
    axes=st.sampled_from([(("fsdp", 4),), (("dp", 2), ("fsdp", 2)), (("dp", 2), ("fsdp", 8))]),
    cost=st.sampled_from(COSTS),
    a=st.floats(0, 1),
)
def test_the_auto_plan_is_never_worse_than_a_fixed_strategy_that_fits(preset, axes, cost, a):
    """Reference: every uniform strategy, estimated alone; a failure names the one that wins."""
    if cost.workload is not None:  # the workload of the preset planned
        cost = dataclasses.replace(cost, workload=Workload(get_preset(preset).config, 1))
    fixed = _fixed(preset, axes, cost)
    least, most = (f(e.memory.total for e in fixed.values()) for f in (min, max))
    budget = int(least + a * (most - least))
    usable = usable_budget(budget, cost)  # what a plan may fill: the budget less the reserve
    if not any(e.memory.total <= usable for e in fixed.values()):
        with pytest.raises(BudgetError):
            _auto(preset, axes, cost, budget)
        return
    auto, _ = _auto(preset, axes, cost, budget)
    assert auto.memory.total <= usable
    _assert_dominates(auto, fixed, usable)


@pytest.mark.parametrize(
    ("preset", "axes", "remat", "beaten"),
    [
        ("llama-7b", (("fsdp", 8),), False, "shard_grad_op"),
        ("llama-13b", (("dp", 2), ("fsdp", 8)), True, "hybrid_shard"),
    ],
)
def test_the_auto_plans_of_the_issue_beat_the_fixed_ones(preset, axes, remat, beaten):
    """Reference: ``funcshard plan --mixed-precision bf16 --device-memory 80GiB --hardware
    a100-80gb``, where auto needed more memory and a longer step than ``beaten``."""
    cost = _cli_cost(preset, "a100-80gb", remat=remat)
    fixed = _fixed(preset, axes, cost)
    auto, plan = _auto(preset, axes, cost, 80 * GiB)
    usable = usable_budget(80 * GiB, cost)
    assert fixed[beaten].memory.total <= usable
    _assert_dominates(auto, fixed, usable)
    assert any("ranked by step time then memory" in n for n in plan.notes)
    why = dict(plan.reasons)["layers/0"]
    assert why.startswith(("the fastest step that fits", "the best found")), why


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
    return str(info.value), estimate(least, cost).memory.total - usable_budget(80 * GiB, cost)


def test_when_the_model_state_does_not_fit_the_error_says_how_many_ranks_would():
    message, missing = _refusal("llama-70b", 8, CostModel())
    assert f"({missing:,} bytes) too many per rank" in message
    found = re.search(r"Would fit: (\d+) ranks \(fsdp=\1\)", message)
    assert found is not None, message
    ranks = int(found[1])
    params = get_preset("llama-70b").params()

    def fits(n: int) -> bool:
        plan = fs.plan(params, fs.Mesh({"fsdp": n}), units=["layers/*"], strategy="full_shard")
        return estimate(plan).memory.total <= usable_budget(80 * GiB, CostModel())

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
    assert "Would fit: remat=True (recompute activations in backward) (auto plan: " in message
    assert "ranks (fsdp=" not in message  # activations do not shrink with more ranks


def test_when_only_a_combination_fits_the_error_names_it_with_its_step_time():
    """Reference: the auto plan under the named changes. llama-7b on 8 A100s in 10 GiB: no
    one change is enough; more ranks with remat and bf16 together are."""
    preset = get_preset("llama-7b")
    cost = CostModel(workload=Workload(preset.config, 1), hardware=fs.cost.hardware("a100-80gb"))
    with pytest.raises(BudgetError) as info:
        fs.plan(
            preset.params(),
            fs.Mesh({"fsdp": 8}),
            units=[preset.unit_pattern],
            strategy="auto",
            memory_budget="10GiB",
            cost=cost,
        )
    message = str(info.value)
    found = re.search(
        r"Would fit: (\d+) ranks \(fsdp=\1\) \+ remat=True .* \+ bf16 mixed precision .*"
        r"\(auto plan: ([\d.]+) s/step, ([\d.]+) GiB\)",
        message,
    )
    assert found is not None, message
    changed = dataclasses.replace(
        cost, mixed_precision=BF16, workload=Workload(preset.config, 1, remat=True)
    )
    plan = fs.plan(
        preset.params(),
        fs.Mesh({"fsdp": int(found[1])}),
        units=[preset.unit_pattern],
        strategy="auto",
        memory_budget="10GiB",
        cost=changed,
    )
    e = estimate(plan, changed)
    assert e.time is not None
    assert f"{e.time.step_s:.4g}" == found[2]
    assert f"{e.memory.total / GiB:.2f}" == found[3]


def test_when_no_combination_fits_the_error_says_so():
    """Two bf16 units gathered at once (prefetch 1) do not fit, however many ranks."""
    params = {"layers": [{"w": _meta(256, 256).to(torch.bfloat16)} for _ in range(4)]}
    one = 256 * 256 * 2
    with pytest.raises(BudgetError, match="alone or together, is enough"):
        fs.plan(params, fs.Mesh({"fsdp": 2}), units="auto", strategy="auto", memory_budget=2 * one)


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
    assert "the fewest bytes sent that fits" in text
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
