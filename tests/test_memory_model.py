"""Memory that counts everything: logits and loss, staging buffers, replicated state, the reserve.

Each test names the figure it reproduces; a failure localises to one category of
``fs.cost.Memory`` or to ``usable_budget``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import funcshard as fs
from funcshard._src.plan.auto import BudgetError
from funcshard._src.plan.cost import estimate
from funcshard._src.plan.cost_model import CostModel, Reserve, reserve_bytes, usable_budget
from funcshard._src.plan.unit_cost import unit_cost
from tests.models import Model

GiB = 2**30
BF16 = fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
LLAMA3_8B = fs.presets.ModelConfig("llama", 32, 4096, 14336, 32, 8, 128, vocab=128256, seq_len=8192)


def _stack(n: int = 2, width: int = 8) -> dict[str, Any]:
    return {"embed": torch.zeros(16, width), "blocks": [{"w": torch.zeros(width, width)}] * n}


# -- logits and loss ---------------------------------------------------------------------------


def test_llama3_8b_logits_at_8k_tokens_are_ten_and_a_half_gigabytes():
    """Llama 3 8B (vocab 128,256), 1 x 8,192 tokens, bf16 compute.

    Logits 8,192 x 128,256 = 1,050,673,152 elements: 2 bytes each in bf16 (the head's
    output), 4 in fp32 (the loss's upcast / log-softmax kept for backward) and 4 in
    fp32 (their gradient): 10 bytes, 10,506,731,520 bytes = 9.79 GiB per rank.
    """
    workload = fs.cost.Workload(LLAMA3_8B, batch_size=1, seq_len=8192, remat=True)
    plan = fs.plan(
        {"w": torch.empty(4096, 4096, dtype=torch.bfloat16, device="meta")}, fs.Mesh({"fsdp": 8})
    )
    mem = estimate(plan, CostModel(mixed_precision=BF16, workload=workload)).memory
    assert mem.logits == 8192 * 128256 * (2 + 4 + 4) == 10_506_731_520
    assert mem.total == mem.model_state + mem.activations + mem.logits + mem.staging
    fused = fs.cost.Workload(LLAMA3_8B, batch_size=1, seq_len=8192, remat=True, logits=False)
    without = estimate(plan, CostModel(mixed_precision=BF16, workload=fused)).memory
    assert without.logits == 0
    assert without.activations == mem.activations


def test_logits_take_the_compute_dtype_and_scale_with_tokens():
    """fp32 compute: 4 + 4 + 4 bytes per logit; twice the batch, twice the logits."""
    config = fs.presets.get("llama-7b").config
    plan = fs.plan({"w": torch.empty(8, 8)}, fs.Mesh({"fsdp": 1}))
    one = estimate(plan, CostModel(workload=fs.cost.Workload(config, batch_size=1))).memory
    two = estimate(plan, CostModel(workload=fs.cost.Workload(config, batch_size=2))).memory
    assert one.logits == 2048 * 32000 * 12
    assert two.logits == 2 * one.logits


# -- staging buffers ---------------------------------------------------------------------------


def test_staging_is_the_largest_all_gather_output_and_reduce_scatter_input():
    """Two 6x6 fp32 leaves in one unit on 4 ranks: shards of 2x6 = 12 elements each.

    All-gather output: 4 ranks x 24 elements x 2 bytes (bf16) = 192; reduce-scatter
    input: 4 x 24 x 4 (fp32) = 384. A unit of one leaf split evenly on dim 0 is
    gathered into its own storage (no output buffer) but still reduced from 4 rows.
    """
    params = {"a": {"w": torch.zeros(6, 6), "v": torch.zeros(6, 6)}, "e": torch.zeros(8, 3)}
    plan = fs.plan(params, fs.Mesh({"fsdp": 4}), units=["a", "e"])
    model = CostModel(mixed_precision=BF16)
    costs = {u.name: unit_cost(plan, u, model) for u in plan.units}
    assert (costs["a"].gather_buffer, costs["a"].reduce_buffer) == (4 * 24 * 2, 4 * 24 * 4)
    assert (costs["e"].gather_buffer, costs["e"].reduce_buffer) == (0, 4 * 6 * 4)
    assert estimate(plan, model).memory.staging == 192 + 384


def test_no_shard_without_a_cast_needs_no_staging():
    """no_shard in fp32: the full leaves alias the shard and gradients reduce in place."""
    plan = fs.plan(_stack(), fs.Mesh({"fsdp": 4}), units=["blocks/*"], strategy="no_shard")
    assert estimate(plan).memory.staging == 0
    # with bf16 compute every rank casts into a gathered buffer of the whole unit
    assert estimate(plan, CostModel(mixed_precision=BF16)).memory.staging == 16 * 8 * 2


def _staging_in_a_run(
    model: Model, mesh: dict[str, int], bf16: bool, layout: Any = "leaf"
) -> dict[str, int]:
    """Worker body: the executor's own buffers, prefetch 0, against the cost model."""
    params = model.init(0)
    plan = fs.plan(params, fs.Mesh(mesh), units=model.units, strategy="full_shard", layout=layout)
    mp = BF16 if bf16 else None
    step = fs.value_and_grad(model.loss_fn, plan, mixed_precision=mp, prefetch=0, bucket_bytes=0)
    step(fs.shard(params, plan), *model.batch_for(fs.rank()))
    runtimes = step._runtimes()
    # UnitRuntime.prefetch: torch.empty(group_size * local.numel()) per gathered part
    gather = {
        u.name: sum(
            u.group_size * p.layout.numel * p.compute_dtype.itemsize
            for p in u.parts
            if not p.aliased and not p.in_place
        )
        for u in runtimes
    }
    # Reducer._reduce_part: torch.empty(group_size, layout.numel) in the reduce dtype
    reduce = max(
        u.group_size * p.layout.numel * p.grad_dtype.itemsize
        for u in runtimes
        for p in u.parts
        if p.layout.dtype.is_floating_point and not p.layout.frozen
    )
    root = sum(u.gathered_bytes for u in runtimes if u.unit.is_root)
    peak = root + max(u.gathered_bytes + gather[u.name] for u in runtimes if not u.unit.is_root)
    est = estimate(plan, CostModel(mixed_precision=mp, prefetch=0, backend="gloo"))
    return {
        "staging": est.memory.staging,
        "expected": max(gather.values()) + reduce,
        "measured_peak": step.stats.peak_gathered_bytes,
        "model_peak": peak,
    }


@pytest.mark.parametrize(("bf16", "layout"), [(False, "leaf"), (True, "leaf"), (True, "flat")])
def test_staging_equals_the_buffers_the_executor_allocates(pools, bf16, layout):
    """full_shard on 2 ranks, prefetch 0: the model's staging is the executor's largest
    all-gather output plus its largest packed gradient rows, and the measured peak of
    gathered memory is the root unit plus the largest unit's leaves and its buffer (in the
    flat layout: the gathered concatenation, end padding included, and no staging)."""
    model = Model(kind="transformer", vocab=15, width=7, hidden=16, layers=2, heads=1)
    for r in pools.run(2, _staging_in_a_run, model, {"fsdp": 2}, bf16, layout):
        assert r["staging"] == r["expected"]
        assert r["measured_peak"] == r["model_peak"]


# -- replicated state --------------------------------------------------------------------------


def test_replicated_params_frozen_leaves_and_buffers_are_counted_whole():
    """no_shard: every rank holds the whole leaf; hybrid_shard: a 1/fsdp share; frozen
    leaves as stored; buffers from CostModel(buffers=) or from the tensors (state=)."""
    params = {"w": torch.zeros(64, 64), "f": torch.zeros(32)}
    mesh = fs.Mesh({"dp": 2, "fsdp": 4})
    cases: list[tuple[Any, int]] = [("no_shard", 1), ("hybrid_shard", 4), ("full_shard", 8)]
    for strategy, share in cases:
        mem = estimate(fs.plan(params, mesh, strategy=strategy, frozen=["f"])).memory
        assert (mem.params, mem.frozen) == (64 * 64 * 4 // share, 32 * 4 // share)
        assert mem.grads == mem.params
        assert mem.optimizer == 2 * mem.params + 8
    whole = fs.plan(params, mesh, strategy="no_shard")
    state = {"rope": torch.zeros(128, 16)}
    assert estimate(whole, state=state).memory.buffers == 128 * 16 * 4
    assert estimate(whole, CostModel(buffers=1000)).memory.buffers == 1000


# -- the reserve -------------------------------------------------------------------------------


def test_the_default_reserve_is_five_percent_and_a_gib_on_a_device_and_nothing_on_a_tiny_budget():
    """80 GiB: 4 GiB + 1 GiB kept back, 75 GiB usable; a KiB budget keeps everything."""
    assert reserve_bytes(80 * GiB, CostModel()) == 5 * GiB
    assert usable_budget(80 * GiB, CostModel()) == 75 * GiB
    assert usable_budget(4096, CostModel()) == 4096
    assert reserve_bytes(2 * GiB, CostModel()) == GiB // 2  # half of what exceeds 1 GiB
    assert usable_budget(80 * GiB, CostModel(reserve=Reserve())) == 80 * GiB


@given(st.integers(1, 200 * GiB), st.integers(1, 200 * GiB))
def test_a_larger_budget_never_leaves_less_usable(a, b):
    small, large = sorted((a, b))
    assert usable_budget(small, CostModel()) <= usable_budget(large, CostModel())
    assert 0 <= reserve_bytes(large, CostModel()) <= 0.05 * large + GiB + 1


def test_a_reserve_makes_a_plan_that_fit_no_longer_fit():
    """A budget equal to full_shard's total fits with the default (nothing reserved at
    4 KiB), and not with 10 % reserved: 10 % of the budget is missing."""
    params, mesh = _stack(), fs.Mesh({"fsdp": 2})
    need = estimate(fs.plan(params, mesh, units="auto", strategy="full_shard")).memory.total
    fits = fs.plan(params, mesh, units="auto", strategy="full_shard", memory_budget=need)
    assert estimate(fits).fits
    strict = CostModel(reserve=Reserve(fraction=0.1))
    with pytest.raises(BudgetError, match="too many per rank"):
        fs.plan(params, mesh, units="auto", strategy="auto", memory_budget=need, cost=strict)
    late = estimate(fits, strict, budget=need)
    assert late.reserve == math.ceil(0.1 * need)
    assert late.fits is False


def test_explain_and_json_show_the_budget_the_reserve_and_what_is_left():
    params, mesh = _stack(), fs.Mesh({"fsdp": 2})
    plan = fs.plan(params, mesh, units="auto", strategy="full_shard")
    est = estimate(plan, CostModel(reserve=Reserve(fixed=256)), budget="8KiB")
    assert (est.budget, est.reserve, est.usable) == (8192, 256, 8192 - 256)
    data = est.to_json()
    assert (data["reserve"], data["usable"], data["fits"]) == (256, 7936, True)
    assert set(data["memory"]) >= {"logits", "staging", "params", "gathered"}
    # explain() shows the plan's estimate; one made with the budget asked for
    est = estimate(plan, budget="80GiB")
    shown = dataclasses.replace(plan, estimate=est).explain()
    assert "budget 80.00 GiB, reserve 5.00 GiB for the runtime" in shown
    assert "75.00 GiB usable" in shown
    assert "to spare" in shown
    assert "- reserve for the CUDA context" in shown


def test_a_moe_layer_keeps_the_activations_of_every_expert_a_token_runs():
    """Mixtral (8 experts, 2 per token): each layer's MLP term twice, plus router logits.

    Compute counts the experts a token runs: 12,879,925,248 of 46,702,792,704 parameters
    (Mixtral's published "12.9B active").
    """
    import dataclasses

    from funcshard._src.plan.activations import activation_bytes
    from funcshard._src.plan.step_time import active_params

    mixtral = fs.presets.get("mixtral-8x7b")
    cfg = mixtral.config
    dense = dataclasses.replace(cfg, n_experts=0, experts_per_token=0)
    tokens, p = 4096, 2
    per_layer = p * tokens * (cfg.hidden + 4 * cfg.ffn_hidden) + p * tokens * cfg.n_experts
    assert (
        activation_bytes(cfg, 1, tokens) - activation_bytes(dense, 1, tokens)
        == cfg.n_layers * per_layer
    )
    assert active_params(mixtral.n_params, cfg) == 12_879_925_248
