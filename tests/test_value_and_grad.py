"""Sharded training equals single-device training (the executor's central property).

Hypothesis draws small models (MLPs and transformer blocks with uneven dims and a
scalar leaf), unit groupings, rules, strategies, mixed precision, gradient
accumulation, remat, clipping and optimizers, on world sizes 1, 2, 4 and a 2x2
hybrid mesh. Every rank trains three steps on its own batches; the reference
trains the unsharded params in one process with ``torch.func`` gradients of the
mean loss over all ranks' batches and ``torch.optim``. A failure prints the
drawn case; the assertion names the first parameter path that differs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import funcshard as fs
from funcshard import P
from funcshard._src.plan.strategy import STRATEGIES as ALL_STRATEGIES
from funcshard.testing import assert_trees_close, reference_value_and_grad
from tests.models import Model

FP32_TOL = {"rtol": 1e-5, "atol": 1e-6}
# bf16: every rank computes the same bf16 forward and backward as the reference does
# for the same micro-batch, bit for bit; only the fp32 sums of gradients over ranks
# run in another order (relative error ~1e-7 each), which three AdamW/SGD steps
# carry into the parameters at well under 1e-4.
BF16_TOL = {"rtol": 1e-4, "atol": 1e-5}


@dataclass(frozen=True)
class Case:
    model: Model
    mesh: tuple[tuple[str, int], ...]
    strategy: Any
    mixed_precision: bool
    optimizer: str
    micro_batches: int = 1
    accumulate: Any = "sharded"
    clip: float | None = None
    rule: bool = False
    steps: int = 3
    budget: int | None = None  # with strategy="auto"
    frozen: tuple[str, ...] = ()  # fs.plan(frozen=...): sharded, no gradient, never updated
    bucket_bytes: int | None = None  # value_and_grad(bucket_bytes=...): None is the default
    layout: Any = "leaf"  # fs.plan(layout=...): "flat" concatenates each unit's leaves

    @property
    def world_size(self) -> int:
        n = 1
        for _, size in self.mesh:
            n *= size
        return n

    def batch(self, step: int, rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.batch_for(1000 * step + 10 * rank + micro)

    def make_optimizer(self) -> fs.optim.Optimizer:
        if self.optimizer == "adamw":
            return fs.optim.adamw(lr=lambda n: 0.01 / (1 + n), weight_decay=0.1)
        if self.optimizer == "sgd_nesterov":
            return fs.optim.sgd(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
        return fs.optim.sgd(lr=0.1)

    def torch_optimizer(self, leaves: list[torch.Tensor]) -> tuple[torch.optim.Optimizer, Any]:
        if self.optimizer == "adamw":
            opt = torch.optim.AdamW(leaves, lr=0.01, weight_decay=0.1)
            return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1 / (1 + n))
        if self.optimizer == "sgd_nesterov":
            return torch.optim.SGD(
                leaves, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01
            ), None
        return torch.optim.SGD(leaves, lr=0.1), None

    @property
    def precision(self) -> fs.MixedPrecision | None:
        return (
            fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if self.mixed_precision
            else None
        )

    def plan(self, params: Any) -> fs.Plan:
        last = self.mesh[-1][0]
        rules = (
            [("blocks/*/attn/wqkv", P(None, last)), ("**/w2", P(last))]
            if self.rule and self.model.kind == "transformer"  # an unused rule is an error
            else []
        )
        return fs.plan(
            params,
            fs.Mesh(dict(self.mesh)),
            rules=rules,
            units=self.model.units,
            frozen=self.frozen,
            strategy=self.strategy,
            memory_budget=self.budget,
            layout=self.layout,
        )


def train_sharded(case: Case) -> tuple[list[torch.Tensor], Any]:
    """Worker body: train ``case`` for its steps; returns local losses and (rank 0) the final params."""
    rank = fs.rank()
    params = case.model.init(0)
    plan = case.plan(params)
    sparams = fs.shard(params, plan)
    opt = case.make_optimizer()
    state = opt.init(sparams)
    step = fs.value_and_grad(
        case.model.loss_fn, plan, mixed_precision=case.precision, bucket_bytes=case.bucket_bytes
    )
    losses = []
    for t in range(case.steps):
        batches = [case.batch(t, rank, m) for m in range(case.micro_batches)]
        if case.micro_batches == 1:
            loss, grads = step(sparams, *batches[0])
        else:
            loss, grads = step.accumulate(sparams, batches, mode=case.accumulate)
        if case.clip is not None:
            grads, _ = fs.optim.clip_by_global_norm(grads, case.clip)
        sparams, state = opt.update_(grads, state, sparams)
        losses.append(loss)
    return losses, fs.unshard(sparams, rank0_only=True)


def train_reference(case: Case) -> tuple[list[torch.Tensor], Any]:
    """One process, full tensors: torch.func gradients of the mean loss and torch.optim."""
    params = case.model.init(0)
    leaves, treedef = fs.tree.flatten(params)
    leaves = [leaf.clone().requires_grad_() for leaf in leaves]
    trained = [not leaf.frozen for leaf in case.plan(params).leaves]
    opt, schedule = case.torch_optimizer([x for x, t in zip(leaves, trained) if t])
    compute = case.precision.param_dtype if case.precision is not None else None

    def loss_fn(p: Any, *batch: torch.Tensor) -> torch.Tensor:
        if compute is not None:  # the sharded run gathers and computes every float leaf in bf16
            p = fs.tree.map(lambda t: t.to(compute), p)
        return case.model.loss_fn(p, *batch)

    losses = []
    for t in range(case.steps):
        batches = [
            case.batch(t, r, m) for r in range(case.world_size) for m in range(case.micro_batches)
        ]
        full = fs.tree.unflatten(treedef, [leaf.detach() for leaf in leaves])
        loss, grads = reference_value_and_grad(loss_fn, full, batches)
        for leaf, grad, t in zip(leaves, fs.tree.leaves(grads), trained):
            leaf.grad = grad.clone() if t else None
        if case.clip is not None:
            torch.nn.utils.clip_grad_norm_([x for x, t in zip(leaves, trained) if t], case.clip)
        opt.step()
        if schedule is not None:
            schedule.step()
        losses.append(loss)
    return losses, fs.tree.unflatten(treedef, [leaf.detach() for leaf in leaves])


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


MESHES = [(("fsdp", 1),), (("fsdp", 2),), (("fsdp", 4),), (("dp", 2), ("fsdp", 2))]
STRATEGIES = list(ALL_STRATEGIES)  # every strategy, in every grid
# meshes on which a partial copy is more than the shard ([Note: partial copies] in ``plan/strategy.py``): two ranks
# whose copy is the whole unit (re-gathered over a group of one), 2x2, and three axes
PARTIAL_MESHES = [
    (("node", 2), ("local", 1)),
    (("node", 2), ("local", 2)),
    (("a", 2), ("b", 1), ("c", 2)),
]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    model = Model(
        kind=draw(st.sampled_from(["mlp", "transformer"])),
        vocab=draw(st.sampled_from([11, 12])),  # 12: the embedding is gathered in place
        width=draw(st.sampled_from([4, 6])),
        hidden=draw(st.sampled_from([5, 8, 10])),
        layers=draw(st.integers(1, 3)),
        grouping=draw(st.sampled_from(["per_block", "all_blocks", "none"])),
        embed_unit=draw(st.booleans()),
        head_unit=draw(st.booleans()),
        remat=draw(st.booleans()),
    )
    micro = draw(st.sampled_from([1, 1, 2]))
    return Case(
        model=model,
        mesh=draw(st.sampled_from(MESHES)),
        strategy=draw(st.sampled_from(STRATEGIES)),
        mixed_precision=draw(st.booleans()),
        optimizer=draw(st.sampled_from(["adamw", "sgd", "sgd_nesterov"])),
        micro_batches=micro,
        accumulate=draw(st.sampled_from(["sharded", "unsharded"])),
        clip=draw(st.sampled_from([None, None, 0.5])),
        rule=draw(st.booleans()),
        frozen=draw(
            st.sampled_from(
                [(), (), ("embed",), ("blocks/0",), ("head/temp",), ("embed", "blocks/0")]
            )
        ),
        # 0: every unit on its own; 300: buckets of two or three small blocks; None: the
        # backend's default (every unit of these models in one bucket on gloo)
        bucket_bytes=draw(st.sampled_from([0, 300, None])),
        layout=draw(st.sampled_from(["leaf", "flat", "auto"])),
    )


def check(pools: Any, case: Case) -> None:
    if case.strategy == "no_shard" and case.rule:
        case = dataclasses.replace(case, rule=False)  # no_shard replicates every leaf
    results = pools.run(case.world_size, train_sharded, case)
    with one_thread():  # as every worker rank: CPU kernels block (and round bf16) by thread count
        ref_losses, ref_params = train_reference(case)
    tol = BF16_TOL if case.mixed_precision else FP32_TOL
    for t, ref in enumerate(ref_losses):
        mean = torch.stack([losses[t] for losses, _ in results]).float().mean()
        torch.testing.assert_close(
            mean,
            ref.float(),
            rtol=tol["rtol"],
            atol=tol["atol"],
            msg=lambda m, t=t: f"step {t} loss: {m}",
        )
    assert_trees_close(results[0][1], ref_params, **tol)
    assert all(params is None for _, params in results[1:])
    initial = case.model.init(0)
    for leaf in case.plan(initial).leaves:
        if leaf.frozen:  # bit for bit: a frozen leaf is never written
            path = leaf.path.split("/")
            final: Any = results[0][1]
            first: Any = initial
            for key in path:
                final = final[int(key)] if isinstance(final, list) else final[key]
                first = first[int(key)] if isinstance(first, list) else first[key]
            assert torch.equal(final, first), f"frozen {leaf.path} changed"


@settings(max_examples=40)
@given(cases())
def test_sharded_training_equals_single_device(pools, case):
    check(pools, case)


def test_every_strategy_on_every_mesh(pools):
    """The grid the property test samples from, each point once (fp32, transformer, per-block units)."""
    for mesh in MESHES:
        for strategy in _on(mesh):
            check(
                pools,
                Case(Model(), mesh, strategy, mixed_precision=False, optimizer="adamw", steps=2),
            )


def _on(mesh: tuple[tuple[str, int], ...]) -> list[Any]:
    """The strategies a grid runs on ``mesh``: on one axis a partial copy is the shard, so
    partial_reshard and hybrid_shard_optimizer are full_shard there (and run in its place)."""
    partial = ("partial_reshard", "hybrid_shard_optimizer")
    return [s for s in STRATEGIES if len(mesh) > 1 or s not in partial]


def test_shard_optimizer_trains_like_one_device_over_micro_batches(pools):
    """ZeRO-1 ([Note: shard_optimizer] in ``plan/strategy.py``): gathered once per step, gradients kept whole across
    the micro-batches and reduced once; both accumulation modes, bf16, the flat layout, buckets.

    bf16 runs 4 micro-batches: the reference differentiates the mean loss, scaling each
    micro-batch's bf16 backward by 1 / (ranks x micro-batches), which is exact in bf16 only
    for a power of two (the sharded step scales the fp32 sums).
    """
    for mesh in MESHES:
        for mode, mixed_precision, layout, micro in [
            ("sharded", False, "leaf", 3),
            ("unsharded", True, "flat", 4),
        ]:
            check(
                pools,
                Case(
                    Model(embed_unit=True, remat=mesh == (("fsdp", 2),)),
                    mesh,
                    "shard_optimizer",
                    mixed_precision=mixed_precision,
                    optimizer="adamw",
                    steps=2,
                    micro_batches=micro,
                    accumulate=mode,
                    layout=layout,
                    bucket_bytes=300 if layout == "flat" else 0,
                    frozen=("blocks/0",) if mixed_precision else (),
                ),
            )


def test_partial_copies_train_like_one_device(pools):
    """partial_reshard and hybrid_shard_optimizer ([Note: partial copies] in ``plan/strategy.py``): the copy kept from
    forward to backward, or across micro-batches, re-gathered over the last axis; both
    accumulation modes, bf16, the flat layout, rules, remat and frozen leaves."""
    for mesh in PARTIAL_MESHES:
        for strategy in ("partial_reshard", "hybrid_shard_optimizer"):
            for micro, mode, mixed_precision, layout in [
                (1, "sharded", False, "leaf"),
                (3, "sharded", False, "flat"),
                (4, "unsharded", True, "leaf"),
            ]:
                check(
                    pools,
                    Case(
                        Model(embed_unit=True, remat=micro == 3),
                        mesh,
                        strategy,
                        mixed_precision=mixed_precision,
                        optimizer="adamw",
                        steps=2,
                        micro_batches=micro,
                        accumulate=mode,
                        layout=layout,
                        rule=layout == "leaf",
                        frozen=("blocks/0",) if mixed_precision else (),
                    ),
                )


def test_the_flat_layout_trains_like_one_device_on_every_strategy_and_mesh(pools):
    """Each unit's leaves concatenated and cut into equal ranges (cut inside leaves, the last
    range padded): fp32 and bf16, clipping, frozen leaves, unsharded accumulation, buckets."""
    for mesh in MESHES:
        for strategy in _on(mesh):
            check(
                pools,
                Case(
                    Model(vocab=11, embed_unit=True),
                    mesh,
                    strategy,
                    mixed_precision=strategy == "shard_grad_op",
                    optimizer="adamw",
                    steps=2,
                    clip=0.5 if strategy == "full_shard" else None,
                    frozen=("blocks/0",) if strategy == "hybrid_shard" else (),
                    micro_batches=2 if strategy == "no_shard" else 1,
                    accumulate="unsharded",
                    bucket_bytes=300,
                    layout="flat",
                ),
            )


def test_frozen_leaves_train_like_one_device_on_every_strategy(pools):
    """Frozen leaves are sharded and gathered, get no update, and the rest trains as in one process."""
    for strategy in [*_on((("fsdp", 2),)), "hybrid_shard_optimizer"]:
        hybrid = strategy in ("hybrid_shard", "hybrid_shard_optimizer")
        mesh = (("dp", 2), ("fsdp", 2)) if hybrid else (("fsdp", 2),)
        for mixed_precision in (False, True):
            check(
                pools,
                Case(
                    Model(embed_unit=True),
                    mesh,
                    strategy,
                    mixed_precision=mixed_precision,
                    optimizer="adamw",
                    steps=2,
                    frozen=("embed", "blocks/0"),
                ),
            )


def _in_place_parts(strategy: Any) -> list[str]:
    """Worker body: the units whose parts are all-gathered straight into their full storage."""
    model = Model(vocab=12, embed_unit=True)
    params = model.init(0)
    axes = {"dp": 2, "fsdp": 2} if fs.world_size() == 4 else {"fsdp": fs.world_size()}
    plan = fs.plan(params, fs.Mesh(axes), units=model.units, strategy=strategy)
    step = fs.value_and_grad(model.loss_fn, plan)
    step(fs.shard(params, plan), *model.batch_for(0))
    return sorted(u.name for u in step._runtimes() for p in u.parts if p.in_place)


def test_a_unit_gathered_in_place_trains_like_one_device(pools):
    """One leaf split evenly on dim 0 (an embedding alone in its unit) is gathered into its full
    storage and reduced without unpacking; training is unchanged, with and without bf16."""
    for mesh, strategy in [
        ((("fsdp", 2),), "full_shard"),
        ((("fsdp", 4),), "shard_grad_op"),
        ((("dp", 2), ("fsdp", 2)), "hybrid_shard"),
        ((("dp", 2), ("fsdp", 2)), "full_shard"),
    ]:
        world = 4 if len(mesh) == 2 or mesh[0][1] == 4 else 2
        assert pools.run(world, _in_place_parts, strategy)[0] == ["embed"]
        for mixed_precision in (False, True):
            check(
                pools,
                Case(
                    Model(vocab=12, embed_unit=True),
                    mesh,
                    strategy,
                    mixed_precision=mixed_precision,
                    optimizer="adamw",
                    steps=2,
                ),
            )


def _frozen_bytes(frozen: tuple[str, ...]) -> tuple[int, int, int]:
    """Worker body: bytes this rank holds of frozen params, of params, of optimizer state."""
    model = Model(embed_unit=True)
    params = model.init(0)
    plan = fs.plan(params, fs.Mesh({"fsdp": fs.world_size()}), units=model.units, frozen=frozen)
    sparams = fs.shard(params, plan)
    frozen_bytes = sum(
        x.padded.numel() * x.padded.element_size() for x in fs.tree.leaves(sparams) if x.frozen
    )
    state = fs.optim.adamw(1e-3).init(sparams)
    return frozen_bytes, fs.testing.held_bytes(sparams), fs.testing.held_bytes(state)


def test_frozen_leaves_cost_one_over_w_and_have_no_optimizer_state(pools):
    model = Model(embed_unit=True)
    params = model.init(0)
    frozen = ("embed", "blocks")
    whole = sum(
        t.numel() * 4 for t in [params["embed"]["tokens"], *fs.tree.leaves(params["blocks"])]
    )
    (one,) = pools.run(1, _frozen_bytes, frozen)
    two = pools.run(2, _frozen_bytes, frozen)
    assert one[0] == whole
    for frozen_bytes, _, state in two:  # padding aside, half each
        assert whole / 2 <= frozen_bytes <= whole / 2 + 4 * 64
        trained = one[1] - one[0]
        assert state <= 2 * trained + 8  # mu and nu of the trained leaves and a counter only
    estimate = fs.cost.estimate(
        fs.plan(params, fs.Mesh({"fsdp": 2}), units=model.units, frozen=frozen)
    )
    assert estimate.memory.frozen == two[0][0]


def test_an_automatic_plan_that_mixes_strategies_trains_like_one_device(pools):
    """strategy="auto" under a budget at which it mixes strategies trains like one device.

    The budget is the first of 32 steps from all-full_shard's memory to all-no_shard's at
    which the search picks more than one strategy (it moves identical units together, so
    not every budget in between mixes).
    """
    for mesh in [(("fsdp", 2),), (("dp", 2), ("fsdp", 2))]:
        model = Model(layers=3)
        params = model.init(0)
        low, high = (
            fs.cost.estimate(
                fs.plan(params, fs.Mesh(dict(mesh)), units=model.units, strategy=s)
            ).memory.total
            for s in ("full_shard", "no_shard")
        )
        mixing = [
            budget
            for budget in range(low, high, max(1, (high - low) // 32))
            if len(
                {
                    u.strategy
                    for u in Case(
                        model, mesh, "auto", mixed_precision=False, optimizer="adamw", budget=budget
                    )
                    .plan(params)
                    .units
                }
            )
            > 1
        ]
        assert mixing, f"no budget between {low} and {high} gives a mixed plan on {mesh}"
        case = Case(model, mesh, "auto", mixed_precision=False, optimizer="adamw", budget=mixing[0])
        check(pools, case)
