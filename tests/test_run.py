"""Memory and communication of a step, measured on the ranks and compared with what is promised.

Memory: the peak of gathered parameters alive stays within the prefetch bound,
and the sharded parameters, gradients and optimizer state a rank holds are
(total bytes) / W up to padding. Communication: the ledger of every rank equals
the cost model's bytes exactly, which for ``full_shard`` is 3 (W - 1) / W of the
parameter bytes per step.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import funcshard as fs
from funcshard._src.execute.run import current_run
from funcshard._src.plan.cost import estimate
from funcshard._src.plan.cost_model import CostModel
from funcshard._src.plan.unit_cost import comm_bytes_per_step, param_bytes_per_rank, unit_cost
from funcshard._src.shard.sharded import flats_of
from funcshard.testing import reference_value_and_grad
from tests.models import Model

EVEN = Model(
    kind="transformer", vocab=16, width=8, hidden=16, layers=4, heads=2
)  # every dim divides by 4
UNEVEN = Model(kind="mlp", vocab=11, width=6, layers=4)


def _held_and_peak(
    model: Model, mesh: dict[str, int], strategy: Any, prefetch: int, bucket_bytes: int | None = 0
) -> dict[str, Any]:
    params = model.init(0)
    plan = fs.plan(params, fs.Mesh(mesh), units=model.units, strategy=strategy)
    sparams = fs.shard(params, plan)
    opt = fs.optim.adamw(lr=1e-3)
    state = opt.init(sparams)
    step = fs.value_and_grad(model.loss_fn, plan, prefetch=prefetch, bucket_bytes=bucket_bytes)
    _, grads = step(sparams, *model.batch_for(fs.rank()))

    def nbytes(tree: Any) -> int:
        return sum(f.data.numel() * f.data.element_size() for f in flats_of(tree))

    units = step._runtimes()
    cost = {
        u.name: u.gathered_bytes
        + u.group_size * sum(p.layout.nbytes for p in u.parts if not p.aliased)
        for u in units
    }
    root = sum(u.gathered_bytes for u in units if u.unit.is_root)
    return {
        "params": nbytes(sparams),
        "grads": nbytes(grads),
        "state": nbytes(state.mu) + nbytes(state.nu),
        "peak": step.stats.peak_gathered_bytes,
        "root": root,
        "max_unit": max(c for name, c in cost.items() if name != "<root>"),
        "max_group": max_group_bytes(step._members, cost),
        "all_units": sum(u.gathered_bytes for u in units),
        "expected_params": param_bytes_per_rank(plan),
    }


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_gathered_parameters_stay_within_the_prefetch_bound(pools, prefetch):
    """full_shard, W=2: peak <= root + (1 + prefetch) units (each its full leaves plus its all-gather buffer)."""
    for r in pools.run(2, _held_and_peak, EVEN, {"fsdp": 2}, "full_shard", prefetch):
        assert r["peak"] <= r["root"] + (1 + prefetch) * r["max_unit"]
        assert r["peak"] < r["all_units"]  # memory really drops: not every unit is alive at once


def _peak_against_the_model(mesh: dict[str, int], strategy: Any, micro: int) -> dict[str, int]:
    """Worker body: the measured peak of gathered memory over a step of ``micro`` micro-batches."""
    model = EVEN
    params = model.init(0)
    plan = fs.plan(params, fs.Mesh(mesh), units=model.units, strategy=strategy)
    copies: list[int] = []  # bytes of partial copies held at the end of each forward

    def loss_fn(p: Any, *batch: torch.Tensor) -> torch.Tensor:
        loss = model.loss_fn(p, *batch)
        run = current_run()
        assert run is not None
        copies.append(
            sum(
                u.partial.nbytes(part)
                for u in run.units.values()
                if u.partial.held
                for part in u.parts
            )
        )
        return loss

    step = fs.value_and_grad(loss_fn, plan, bucket_bytes=0)
    batches = [model.batch_for(10 * fs.rank() + m) for m in range(micro)]
    step.accumulate(fs.shard(params, plan), batches)
    cost_model = CostModel(micro_batches=micro, backend="gloo")
    est = estimate(plan, cost_model).memory
    units = step._runtimes()
    return {
        "partial": max(copies),
        "partial_model": sum(unit_cost(plan, u, cost_model).partial for u in plan.units),
        "peak": step.stats.peak_gathered_bytes,
        "bound": est.gathered + est.staging,
        "all_units": sum(u.gathered_bytes for u in units),
        "largest": max(u.gathered_bytes for u in units if not u.unit.is_root),
        "root": sum(u.gathered_bytes for u in units if u.unit.is_root),
    }


@pytest.mark.parametrize(
    ("world_size", "mesh", "strategy"),
    [
        (2, {"fsdp": 2}, "full_shard"),
        (2, {"fsdp": 2}, "shard_grad_op"),
        (2, {"fsdp": 2}, "shard_optimizer"),
        (4, {"dp": 2, "fsdp": 2}, "hybrid_shard"),
        (4, {"node": 2, "local": 2}, "partial_reshard"),
        (4, {"dp": 2, "fsdp": 2}, "hybrid_shard_optimizer"),
    ],
)
def test_gathered_memory_stays_within_the_cost_model(pools, world_size, mesh, strategy):
    """One and three micro-batches: the measured peak of gathered parameters and staging is
    at most the model's ``gathered + staging``. Units freed after forward (full_shard,
    hybrid_shard, as FSDP's HYBRID_SHARD) never hold every unit at once; the others hold
    all of them at the end of forward, shard_optimizer's for the whole step. Partial copies
    ([Note: partial copies] in ``plan/strategy.py``) held at the end of forward are exactly the model's."""
    for micro in (1, 3):
        for r in pools.run(world_size, _peak_against_the_model, mesh, strategy, micro):
            assert r["peak"] <= r["bound"], (micro, r)
            # the partial copies held at the end of forward: exactly the model's
            assert r["partial"] == r["partial_model"], (micro, r)
            if strategy in PARTIAL:
                assert 0 < r["partial"] < r["all_units"], (micro, r)
            elif strategy in ("full_shard", "hybrid_shard"):
                assert r["peak"] < r["all_units"], (micro, r)
            else:
                assert r["peak"] >= r["all_units"], (micro, r)


# meshes on which a partial copy is more than the shard ([Note: partial copies] in ``plan/strategy.py``): its copy is
# the whole unit (re-gathered over a group of one), 2x2, and three axes
PARTIAL_MESHES = [
    (2, {"node": 2, "local": 1}),
    (4, {"node": 2, "local": 2}),
    (4, {"a": 2, "b": 1, "c": 2}),
]
PARTIAL = ["partial_reshard", "hybrid_shard_optimizer"]


@pytest.mark.parametrize(
    ("world_size", "mesh", "strategy"),
    [
        (*PARTIAL_MESHES[0], "partial_reshard"),
        (*PARTIAL_MESHES[1], "partial_reshard"),
        (*PARTIAL_MESHES[1], "hybrid_shard_optimizer"),
        (*PARTIAL_MESHES[2], "hybrid_shard_optimizer"),
    ],
)
def test_the_ledger_of_partial_copies_equals_the_cost_model(pools, world_size, mesh, strategy):
    """Every layout, fp32 and bf16, one micro-batch and three in both modes: the gathers from
    the shards over every axis and the re-gathers of the partial copy over the last one."""
    _check_every_layout(pools, world_size, mesh, strategy)
    for per_rank in pools.run(world_size, _accumulated_ledgers, mesh, strategy):
        for mode, ledger, expected in per_rank:
            assert ledger == expected, mode


def test_partial_copies_keep_backward_inside_the_last_axis(pools):
    """On {"node": 2, "local": 2}, three micro-batches: partial_reshard gathers over both axes
    once per micro-batch (forward) and over "local" alone for backward; hybrid_shard_optimizer
    crosses "node" once per step, with its gathers and its gradients. full_shard crosses it in
    all six gathers and three reductions."""
    mesh = {"node": 2, "local": 2}
    no_root = Model(kind="mlp", vocab=12, width=6, layers=3, embed_unit=True, head_unit=True)
    ledgers = {
        s: {
            mode: ledger
            for mode, ledger, _ in pools.run(4, _accumulated_ledgers, mesh, s, no_root)[0]
        }
        for s in ("full_shard", *PARTIAL)
    }
    both, local = ("all_gather", ("node", "local")), ("all_gather", ("local",))
    full = ledgers["full_shard"]["sharded"][both]
    assert local not in ledgers["full_shard"]["sharded"]
    assert ledgers["partial_reshard"]["sharded"][both] * 2 == full
    assert ledgers["hybrid_shard_optimizer"]["sharded"][both] * 6 == full
    # a re-gather sends (L - 1) / L of the unit where a gather from shards sends (W - 1) / W
    one = full // 6  # one gather of every unit, from the shards: 3/4 of the parameters
    assert ledgers["partial_reshard"]["sharded"][local] == 3 * one * 2 // 3
    assert ledgers["hybrid_shard_optimizer"]["sharded"][local] == 5 * one * 2 // 3
    # gradients ([Note: two-hop reductions] in ``execute/param_group.py``): full_shard and partial_reshard reduce-scatter over
    # both axes each micro-batch, 3/4 of the unit; hybrid_shard_optimizer over "local" each
    # micro-batch (1/2 of it) and over "node" once per step (1/2 of its partial gradient)
    rs_both = ("reduce_scatter", ("node", "local"))
    rs_local, rs_node = ("reduce_scatter", ("local",)), ("reduce_scatter", ("node",))
    reduced = ledgers["full_shard"]["sharded"][rs_both]
    assert ledgers["partial_reshard"]["sharded"][rs_both] == reduced
    hfsdp = ledgers["hybrid_shard_optimizer"]
    for mode, micro in (("sharded", 3), ("unsharded", 1)):
        assert rs_both not in hfsdp[mode]
        assert hfsdp[mode][rs_local] * 9 == micro * reduced * 2
        assert hfsdp[mode][rs_node] * 9 == reduced


def _partial_gradients(mesh: dict[str, int], layout: Any) -> list[tuple[Any, int, int]]:
    """Worker body: per accumulation, the most partial-gradient bytes alive and the cost model's."""
    model = UNEVEN
    params = model.init(0)
    plan = fs.plan(
        params, fs.Mesh(mesh), units=model.units, strategy="hybrid_shard_optimizer", layout=layout
    )
    sparams = fs.shard(params, plan)
    out = []
    modes: tuple[tuple[int, Any], ...] = ((1, "sharded"), (3, "sharded"), (3, "unsharded"))
    for micro, mode in modes:
        batches = [model.batch_for(10 * fs.rank() + m) for m in range(micro)]
        step = fs.value_and_grad(model.loss_fn, plan)
        step.accumulate(sparams, batches, mode=mode)
        cost = CostModel(micro_batches=micro, accumulate=mode)
        each = [unit_cost(plan, u, cost).partial_grads for u in plan.units]
        expected = sum(each) if (micro, mode) == (3, "sharded") else max(each)
        out.append(((micro, mode), step.stats.peak_partial_grad_bytes, expected))
    return out


@pytest.mark.parametrize("layout", ["leaf", "flat"])
def test_partial_gradients_alive_equal_the_cost_model(pools, layout):
    """[Note: two-hop reductions] in ``execute/param_group.py`` on 2x2: every unit's partial gradient between micro-batches,
    one unit's at a time within one micro-batch or with accumulate="unsharded"."""
    for per_rank in pools.run(4, _partial_gradients, {"node": 2, "local": 2}, layout):
        for case, peak, expected in per_rank:
            assert peak == expected > 0, case


@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("bucket_bytes", [600, 10_000])
def test_buckets_bound_gathered_parameters_by_buckets(pools, prefetch, bucket_bytes):
    """With buckets, the bound is (1 + prefetch) buckets: their members' full leaves and the bucket's buffer."""
    for r in pools.run(2, _held_and_peak, EVEN, {"fsdp": 2}, "full_shard", prefetch, bucket_bytes):
        assert r["peak"] <= r["root"] + (1 + prefetch) * r["max_group"]


@pytest.mark.parametrize(
    ("world_size", "mesh"),
    [(1, {"fsdp": 1}), (2, {"fsdp": 2}), (4, {"fsdp": 4}), (4, {"dp": 2, "fsdp": 2})],
)
def test_sharded_state_is_a_wth_of_the_total(pools, world_size, mesh):
    """Parameters, gradients and AdamW state per rank: total/W plus padding (and replicated scalars)."""
    for model in (EVEN, UNEVEN):
        params = model.init(0)
        total = sum(t.numel() * t.element_size() for t in fs.tree.leaves(params))
        plan = fs.plan(params, fs.Mesh(mesh), units=model.units)
        padding = sum(
            (math.prod(leaf.sharding(plan.mesh).shard_shape(leaf.shape)) * world_size - leaf.numel)
            * leaf.itemsize
            for leaf in plan.leaves
        )
        for r in pools.run(world_size, _held_and_peak, model, mesh, "full_shard", 1):
            assert r["params"] == r["grads"] == r["state"] // 2 == r["expected_params"]
            assert r["params"] * world_size == total + padding
            if model is EVEN:  # no padding; only the replicated scalar head/temp is held W times
                assert padding == (world_size - 1) * 4


def _ledger_of_a_step(
    model: Model, mesh: dict[str, int], strategy: Any, bf16: bool, layout: Any = "leaf"
) -> tuple[dict, dict]:
    params = model.init(0)
    plan = fs.plan(params, fs.Mesh(mesh), units=model.units, strategy=strategy, layout=layout)
    mp = fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    step = fs.value_and_grad(model.loss_fn, plan, mixed_precision=mp)
    sparams = fs.shard(params, plan)
    # the first step learns the call order; where the plan's order guessed it wrong, the
    # unit it prefetched is freed at once and gathered again at its call
    step(sparams, *model.batch_for(fs.rank()))
    step.ledger.reset()
    step(sparams, *model.batch_for(fs.rank()))
    return dict(step.ledger.bytes_by_key), dict(comm_bytes_per_step(plan, mp))


def _ledgers_of_every_layout(
    model: Model, mesh: dict[str, int], strategy: Any, bf16: bool
) -> list[tuple[dict, dict]]:
    """:func:`_ledger_of_a_step` for the leaf layout, the flat one and the planner's pick."""
    return [_ledger_of_a_step(model, mesh, strategy, bf16, layout) for layout in LAYOUTS]


LAYOUTS = ("leaf", "flat", "auto")


@pytest.mark.parametrize(
    "strategy", ["full_shard", "shard_grad_op", "shard_optimizer", "no_shard", "hybrid_shard"]
)
@pytest.mark.parametrize(
    ("world_size", "mesh"), [(2, {"fsdp": 2}), (4, {"fsdp": 4}), (4, {"dp": 2, "fsdp": 2})]
)
def test_ledger_equals_the_cost_model(pools, strategy, world_size, mesh):
    """On every layout: the leaf one, the flat one and layout="auto"'s mix of them."""
    _check_every_layout(pools, world_size, mesh, strategy)


def _check_every_layout(pools: Any, world_size: int, mesh: dict[str, int], strategy: Any) -> None:
    """The ledger equals the cost model on every layout, fp32 and bf16, even and uneven dims."""
    for bf16 in (False, True):
        for model in (EVEN, UNEVEN):
            for per_layout in pools.run(
                world_size, _ledgers_of_every_layout, model, mesh, strategy, bf16
            ):
                for layout, (ledger, expected) in zip(LAYOUTS, per_layout):
                    assert ledger == expected, layout


@pytest.mark.parametrize("world_size", [2, 4])
def test_full_shard_moves_three_times_w_minus_1_over_w_of_the_parameters(pools, world_size):
    """No root unit: 3 (W-1)/W x parameter bytes per rank and step; shard_grad_op 2 (W-1)/W; DDP 2 (W-1)/W.

    Sharded strategies move the parameters as stored across the ranks, W x the
    per-rank bytes: here the model's bytes plus W - 1 more copies of the
    replicated scalar ``head/temp`` (every other dim divides evenly). DDP
    all-reduces the model's bytes.
    """
    model = Model(
        kind="transformer", vocab=16, width=8, hidden=16, layers=2, embed_unit=True, head_unit=True
    )
    params = model.init(0)
    plan = fs.plan(params, fs.Mesh({"fsdp": world_size}), units=model.units)
    param_bytes = sum(t.numel() * t.element_size() for t in fs.tree.leaves(params))
    stored = world_size * param_bytes_per_rank(plan)
    assert stored == param_bytes + (world_size - 1) * 4
    for strategy, factor, moved in [
        ("full_shard", 3, stored),
        ("shard_grad_op", 2, stored),
        ("shard_optimizer", 2, stored),
        ("no_shard", 2, param_bytes),
    ]:
        for ledger, _ in pools.run(
            world_size, _ledger_of_a_step, model, {"fsdp": world_size}, strategy, False
        ):
            assert sum(ledger.values()) * world_size == factor * (world_size - 1) * moved


def _accumulate_ledger(mode: Any) -> dict:
    model = UNEVEN
    params = model.init(0)
    plan = fs.plan(params, fs.Mesh({"fsdp": fs.world_size()}), units=model.units)
    step = fs.value_and_grad(model.loss_fn, plan)
    batches = [model.batch_for(10 * fs.rank() + m) for m in range(3)]
    step.accumulate(fs.shard(params, plan), batches, mode=mode)
    return dict(step.ledger.bytes_by_key)


def test_accumulation_modes_trade_memory_for_communication(pools):
    """3 micro-batches: 'sharded' reduce-scatters 3 times, 'unsharded' once; both gather 3 times."""
    one_step = comm_bytes_per_step(
        fs.plan(UNEVEN.init(0), fs.Mesh({"fsdp": 2}), units=UNEVEN.units)
    )
    gather, reduce = ("all_gather", ("fsdp",)), ("reduce_scatter", ("fsdp",))
    sharded = pools.run(2, _accumulate_ledger, "sharded")[0]
    unsharded = pools.run(2, _accumulate_ledger, "unsharded")[0]
    assert sharded[gather] == unsharded[gather] == 3 * one_step[gather]
    assert sharded[reduce] == 3 * one_step[reduce]
    assert unsharded[reduce] == one_step[reduce]


def _accumulated_ledgers(
    mesh: dict[str, int], strategy: Any, model: Model = UNEVEN
) -> list[tuple[str, dict, dict]]:
    """Worker body: per mode, the ledger of one step of 3 micro-batches and the cost model's."""
    params = model.init(0)
    plan = fs.plan(params, fs.Mesh(mesh), units=model.units, strategy=strategy)
    sparams = fs.shard(params, plan)
    batches = [model.batch_for(10 * fs.rank() + m) for m in range(3)]
    out = []
    for mode in ("sharded", "unsharded"):
        step = fs.value_and_grad(model.loss_fn, plan)
        step.accumulate(sparams, batches, mode=mode)  # learns the call order
        step.ledger.reset()
        step.accumulate(sparams, batches, mode=mode)
        model_ = CostModel(micro_batches=3, accumulate=mode)
        out.append((mode, dict(step.ledger.bytes_by_key), dict(estimate(plan, model_).comm)))
    return out


@pytest.mark.parametrize(
    ("world_size", "mesh"), [(2, {"fsdp": 2}), (4, {"fsdp": 4}), (4, {"dp": 2, "fsdp": 2})]
)
def test_the_ledger_of_several_micro_batches_equals_the_cost_model(pools, world_size, mesh):
    """CostModel(micro_batches=3): full_shard gathers 6 times, shard_grad_op, hybrid_shard's
    root and no_shard 3, shard_optimizer once; reductions 3 times ('sharded') or once."""
    for strategy in ["full_shard", "shard_grad_op", "shard_optimizer", "no_shard", "hybrid_shard"]:
        for per_rank in pools.run(world_size, _accumulated_ledgers, mesh, strategy):
            for mode, ledger, expected in per_rank:
                assert ledger == expected, (strategy, mode)


def test_shard_optimizer_gathers_and_reduces_once_per_step(pools):
    """[Note: shard_optimizer] in ``plan/strategy.py``: one all-gather and one reduce-scatter per step of 3 micro-batches,
    a third of shard_grad_op's gathers, whatever the accumulation mode."""
    once, per_micro_batch = (
        {mode: ledger for mode, ledger, _ in pools.run(2, _accumulated_ledgers, {"fsdp": 2}, s)[0]}
        for s in ("shard_optimizer", "shard_grad_op")
    )
    one_step = comm_bytes_per_step(
        fs.plan(
            UNEVEN.init(0), fs.Mesh({"fsdp": 2}), units=UNEVEN.units, strategy="shard_optimizer"
        )
    )
    for mode in ("sharded", "unsharded"):
        assert once[mode] == one_step
        gather = ("all_gather", ("fsdp",))
        assert per_micro_batch[mode][gather] == 3 * once[mode][gather]


def _skipping_unit(strategy: Any, mode: Any) -> tuple[Any, Any]:
    """Worker body: unit "b" runs in the first micro-batch only; the sharded and reference grads."""
    params = {
        "a": {"w": torch.randn(4, 3, generator=torch.Generator().manual_seed(0))},
        "b": {"w": torch.randn(3, 3, generator=torch.Generator().manual_seed(1))},
    }

    def loss_fn(p: Any, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = fs.call(lambda q, x: x @ q["w"], p["a"], x)
        if use_b:
            h = fs.call(lambda q, h: torch.tanh(h @ q["w"]), p["b"], h)
        return (h**2).mean()

    plan = fs.plan(params, fs.Mesh({"fsdp": fs.world_size()}), units=["a", "b"], strategy=strategy)
    step = fs.value_and_grad(loss_fn, plan)
    x = [
        torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * r + m))
        for r in range(fs.world_size())
        for m in range(2)
    ]
    mine = [(x[2 * fs.rank()], True), (x[2 * fs.rank() + 1], False)]
    _, grads = step.accumulate(fs.shard(params, plan), mine, mode=mode)
    everyone = [(x[2 * r + m], m == 0) for r in range(fs.world_size()) for m in range(2)]
    _, expected = fs.testing.reference_value_and_grad(loss_fn, params, everyone)
    return fs.unshard(grads), expected


def test_a_unit_called_only_in_an_earlier_micro_batch_has_its_gradients_reduced(pools):
    """Gradients kept across micro-batches (accumulate="unsharded", shard_optimizer) of a unit
    the last micro-batch does not call are reduced at the end of the step, not dropped."""
    for strategy, mode in [("full_shard", "unsharded"), ("shard_optimizer", "sharded")]:
        for grads, expected in pools.run(2, _skipping_unit, strategy, mode):
            assert torch.count_nonzero(expected["b"]["w"]) > 0
            fs.testing.assert_trees_close(grads, expected, rtol=1e-5, atol=1e-6)


def _states_seen_in_forward() -> list[list[str]]:
    from funcshard._src.execute.run import current_run

    model = Model(kind="mlp", layers=3)
    seen: list[list[str]] = []

    def loss_fn(params: Any, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = params["embed"]["tokens"][tokens]
        for blk in params["blocks"]:

            def block(p: Any, h: torch.Tensor) -> torch.Tensor:
                run = current_run()
                assert run is not None
                seen.append([run.units[f"blocks/{i}"].state.value for i in range(3)])
                return torch.tanh(h @ p["w"] + p["b"])

            h = fs.call(block, blk, h)
        return (h @ params["head"]["w"]).logsumexp(-1).mean()

    params = model.init(0)
    plan = fs.plan(params, fs.Mesh({"fsdp": 2}), units=["blocks/*"])
    step = fs.value_and_grad(loss_fn, plan, bucket_bytes=0)  # units, not buckets
    sparams = fs.shard(params, plan)
    step(sparams, *model.batch_for(0))  # the first step learns the call order
    seen.clear()
    step(sparams, *model.batch_for(1))
    return seen


def test_forward_prefetches_the_next_unit(pools):
    """While block i computes, block i+1's all-gather is in flight and blocks before i are freed."""
    seen = pools.run(2, _states_seen_in_forward)[0]
    assert seen == [
        ["gathered", "gathering", "sharded"],
        ["sharded", "gathered", "gathering"],
        ["sharded", "sharded", "gathered"],
    ]


def _trace_one_step() -> list[tuple[str, str]]:
    model = Model(kind="mlp", layers=3)
    params = model.init(0)
    plan = fs.plan(params, fs.Mesh({"fsdp": 2}), units=["blocks/*"])
    step = fs.value_and_grad(model.loss_fn, plan, bucket_bytes=0)  # units, not buckets
    sparams = fs.shard(params, plan)
    step(sparams, *model.batch_for(0))
    step.memory.events = []
    step(sparams, *model.batch_for(1))
    return step.memory.events


def test_backward_regathers_each_unit_and_prefetches_the_one_before(pools):
    """The order of gathers, frees and reductions of a whole step (3 block units and the root)."""
    events = pools.run(2, _trace_one_step)[0]
    b = [f"blocks/{i}" for i in range(3)]
    forward = [
        ("start", "<root>"),
        ("finish", "<root>"),
        ("start", b[0]),
        ("finish", b[0]),
        ("start", b[1]),
        ("free", b[0]),
        ("finish", b[1]),
        ("start", b[2]),
        ("free", b[1]),
        ("finish", b[2]),
        ("free", b[2]),
    ]
    backward = [  # a unit is freed before its gradients are packed for the reduce-scatter
        ("start", b[2]),
        ("finish", b[2]),
        ("start", b[1]),
        ("free", b[2]),
        ("reduce", b[2]),
        ("finish", b[1]),
        ("start", b[0]),
        ("free", b[1]),
        ("reduce", b[1]),
        ("finish", b[0]),
        ("free", b[0]),
        ("reduce", b[0]),
        ("free", "<root>"),
        ("reduce", "<root>"),
    ]
    assert events == forward + backward


def _frozen_prefix_step(bucket_bytes: int | None) -> tuple[list[Any], dict, dict, bool]:
    """A second step with the embeddings and three of four blocks frozen: events, ledger, model, grads right."""
    model = Model(kind="mlp", layers=4)
    params = model.init(0)
    frozen = ["embed/**", "blocks/0/**", "blocks/1/**", "blocks/2/**"]
    plan = fs.plan(params, fs.Mesh({"fsdp": 2}), units=model.units, frozen=frozen)
    step = fs.value_and_grad(model.loss_fn, plan, bucket_bytes=bucket_bytes)
    sparams = fs.shard(params, plan)
    step(sparams, *model.batch_for(fs.rank()))
    step.ledger.reset()
    step.memory.events = []
    _, grads = step(sparams, *model.batch_for(fs.rank()))
    _, expected = reference_value_and_grad(
        model.loss_fn, params, [model.batch_for(r) for r in range(2)]
    )
    full = fs.unshard(grads)
    # frozen leaves get no gradient (None, which has no tensor leaf)
    assert not fs.tree.leaves([full["embed"], full["blocks"][:3]])
    trained = [(full["blocks"][3], expected["blocks"][3]), (full["head"], expected["head"])]
    close = all(
        torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        for got, want in trained
        for a, b in zip(fs.tree.leaves(got), fs.tree.leaves(want), strict=True)
    )
    ledger = dict(step.ledger.bytes_by_key)
    return step.memory.events, ledger, dict(comm_bytes_per_step(plan)), close


@pytest.mark.parametrize("bucket_bytes", [0, None], ids=["units", "buckets"])
def test_a_frozen_prefix_is_gathered_once_and_the_cost_model_says_so(pools, bucket_bytes):
    """No gradient reaches the frozen blocks: backward neither gathers them nor prefetches them
    ([Note: calls without a backward] in ``execute/run.py``), and the ledger equals the cost
    model, which counts a unit with no trained leaf once."""
    for events, ledger, model, close in pools.run(2, _frozen_prefix_step, bucket_bytes):
        assert close
        assert ledger == model
        for i in range(3):
            assert events.count(("start", f"blocks/{i}")) == 1
        assert events.count(("start", "blocks/3")) == 2


def max_group_bytes(groups: Any, cost: dict[str, int]) -> int:
    """The most bytes one gather group holds: a unit, or a bucket's members plus its 1/W-sized input."""
    return max(
        sum(cost[u.name] for u in members)
        + (
            sum(p.layout.nbytes for u in members for p in u.parts if not p.aliased)
            if len(members) > 1
            else 0
        )
        for members in groups
        if not any(u.unit.is_root for u in members)
    )


def test_the_step_run_is_found_from_a_thread_outside_its_context():
    """[Note: the current run] in ``execute/run.py``: autograd runs a CUDA backward on its
    device threads, which do not see the caller's context variables; a checkpoint's
    recompute there must still find the step it belongs to (a thread stands in for them)."""
    import threading

    from funcshard._src.execute.run import step_run

    params = {"blocks": [{"w": torch.randn(3, 3)} for _ in range(2)]}
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=["blocks/*"])
    seen: list[bool] = []

    def loss(p, x):
        for blk in p["blocks"]:
            x = fs.call(lambda b, x: x @ b["w"], blk, x)
        thread = threading.Thread(target=lambda: seen.append(step_run() is not None))
        thread.start()
        thread.join()
        return x.sum()

    fs.value_and_grad(loss, plan)(fs.shard(params, plan), torch.ones(2, 3))
    assert seen == [True]
    assert step_run() is None  # and nobody finds it once the step is over
