"""fs.optim: numerics equal torch.optim on the full tensors; flat foreach ops; global-norm clipping."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

import funcshard as fs
from funcshard._src.shard.flat import unpack_gathered
from funcshard._src.shard.shard import shard_for_rank
from funcshard._src.shard.sharded import flats_of
from tests.strategies import meshes, tensor_trees, units_for

OPTIMIZERS = {
    "sgd": (lambda: fs.optim.sgd(lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1)),
    "sgd_momentum_wd": (
        lambda: fs.optim.sgd(lr=0.05, momentum=0.9, weight_decay=0.1),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.1),
    ),
    "sgd_nesterov": (
        lambda: fs.optim.sgd(lr=0.05, momentum=0.8, nesterov=True),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, nesterov=True),
    ),
    "adamw": (
        lambda: fs.optim.adamw(lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05),
        lambda ps: torch.optim.AdamW(
            ps, lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05, fused=True
        ),
    ),
    "adamw_foreach": (
        lambda: fs.optim.adamw(
            lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05, fused=False
        ),
        lambda ps: torch.optim.AdamW(ps, lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05),
    ),
    # decay on matrices only == torch's two parameter groups
    "adamw_decay_mask": (
        lambda: fs.optim.adamw(lr=0.01, weight_decay=0.1, mask=lambda path, leaf: leaf.ndim >= 2),
        lambda ps: torch.optim.AdamW(_groups(ps, weight_decay=0.0), lr=0.01, weight_decay=0.1),
    ),
    "adamw_foreach_decay_mask": (
        lambda: fs.optim.adamw(lr=0.01, weight_decay=0.1, mask=_matrices, fused=False),
        lambda ps: torch.optim.AdamW(_groups(ps, weight_decay=0.0), lr=0.01, weight_decay=0.1),
    ),
    # the optimizer on matrices only; other leaves stay as they are
    "masked_sgd": (
        lambda: fs.optim.masked(fs.optim.sgd(lr=0.1, momentum=0.9), _matrices),
        lambda ps: torch.optim.SGD(
            [p for p in ps if p.ndim >= 2] or [torch.zeros(0)], lr=0.1, momentum=0.9
        ),
    ),
    "partition": (
        lambda: fs.optim.partition(
            {"m": fs.optim.adamw(lr=0.01), "v": fs.optim.sgd(lr=0.1)},
            lambda path, leaf: "m" if leaf.ndim >= 2 else "v",
        ),
        lambda ps: _Both(
            torch.optim.AdamW(
                [p for p in ps if p.ndim >= 2] or [torch.zeros(0)], lr=0.01, fused=True
            ),
            torch.optim.SGD([p for p in ps if p.ndim < 2] or [torch.zeros(0)], lr=0.1),
        ),
    ),
    "from_torch_adam": (
        lambda: fs.optim.from_torch(torch.optim.Adam, lr=0.01, betas=(0.8, 0.95), amsgrad=True),
        lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.95), amsgrad=True),
    ),
    "from_torch_sgd_dampening": (  # the first step's buffer is the gradient, not a zero lerp
        lambda: fs.optim.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9, dampening=0.5),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5),
    ),
    "from_torch_rmsprop": (
        lambda: fs.optim.from_torch(torch.optim.RMSprop, lr=0.01, momentum=0.5, centered=True),
        lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5, centered=True),
    ),
    "from_torch_adagrad": (
        lambda: fs.optim.from_torch(torch.optim.Adagrad, lr=0.1, initial_accumulator_value=0.1),
        lambda ps: torch.optim.Adagrad(ps, lr=0.1, initial_accumulator_value=0.1),
    ),
    "from_torch_asgd_schedule": (
        lambda: fs.optim.from_torch(torch.optim.ASGD, lr=lambda n: 0.1 / (n + 1), t0=1),
        lambda ps: _Scheduled(torch.optim.ASGD(ps, lr=0.1, t0=1), lambda n: 0.1 / (n + 1)),
    ),
    "from_torch_rprop": (
        lambda: fs.optim.from_torch(torch.optim.Rprop, lr=0.01),
        lambda ps: torch.optim.Rprop(ps, lr=0.01),
    ),
}


def _matrices(path: str, leaf: Any) -> bool:
    return leaf.ndim >= 2


def _groups(ps: list[torch.Tensor], **other: Any) -> list[dict[str, Any]]:
    """Two torch parameter groups: matrices, and the rest with ``other`` options."""
    return [
        {"params": [p for p in ps if p.ndim >= 2]},
        {"params": [p for p in ps if p.ndim < 2], **other},
    ]


class _Both:
    """Steps two torch optimizers (parameter groups with different optimizers)."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()


class _Scheduled:
    """A torch optimizer whose lr follows ``schedule(count)``, set before each step."""

    def __init__(self, optimizer: torch.optim.Optimizer, schedule: Any) -> None:
        self.optimizer, self.schedule, self.count = optimizer, schedule, 0

    def step(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.schedule(self.count)
        self.optimizer.step()
        self.count += 1


def _full(sharded_per_rank: list[Any]) -> list[torch.Tensor]:
    """Reassembles every leaf from every rank's flat buffers (one process)."""
    per_rank = [flats_of(s) for s in sharded_per_rank]
    leaves: dict[int, torch.Tensor] = {}
    for i, flat in enumerate(per_rank[0]):
        gathered = torch.stack([flats[i].data for flats in per_rank])
        for slot, leaf in zip(flat.layout.slots, unpack_gathered(flat.layout, gathered)):
            leaves[slot.index] = leaf
    return [leaves[i] for i in sorted(leaves)]


@st.composite
def float_cases(draw):
    params = draw(tensor_trees(dtypes=(torch.float32, torch.float64)))
    mesh = draw(meshes(max_size=4))
    return params, fs.plan(params, mesh, units=draw(units_for(params)))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@settings(max_examples=4)
@given(case=float_cases())
def test_updates_equal_torch_optim_on_full_tensors(name, case):
    """Three updates on every rank's shards (one process), reassembled == torch.optim on full tensors."""
    params, plan = case
    make, make_torch = OPTIMIZERS[name]
    opt = make()
    ranks = range(plan.mesh.size)
    sparams = [shard_for_rank(params, plan, r) for r in ranks]
    states = [opt.init(s) for s in sparams]
    leaves = [leaf.clone().requires_grad_() for leaf in fs.tree.leaves(params)]
    reference = make_torch(leaves)
    for step in range(3):
        grads_full = fs.tree.map(lambda t, step=step: torch.sin(t * (step + 1)) + 0.1, params)
        grads = [shard_for_rank(grads_full, plan, r) for r in ranks]
        for r in ranks:
            sparams[r], states[r] = opt.update_(grads[r], states[r], sparams[r])
        for leaf, g in zip(leaves, fs.tree.leaves(grads_full)):
            leaf.grad = g.clone()
        reference.step()
    for ours, ref in zip(_full(sparams), leaves):
        torch.testing.assert_close(ours, ref.detach(), rtol=1e-6, atol=1e-7)


def test_schedules_count_earlier_updates():
    seen = []
    opt = fs.optim.sgd(lr=lambda n: seen.append(n) or 0.1)
    params = {"w": torch.ones(3)}
    sparams = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1})))
    state = opt.init(sparams)
    for _ in range(3):
        sparams, state = opt.update_(sparams, state, sparams)
    assert seen == [0, 1, 2]
    assert int(state.count) == 3


def test_update_writes_params_and_state_in_place():
    params = {"w": torch.ones(3), "b": torch.ones(2)}
    sparams = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1})))
    opt = fs.optim.adamw(lr=0.1)
    state = opt.init(sparams)
    before = (sparams["w"].flat.data.data_ptr(), state.mu["w"].flat.data.data_ptr())
    new_params, new_state = opt.update_(sparams, state, sparams)
    assert (new_params["w"].flat.data.data_ptr(), new_state.mu["w"].flat.data.data_ptr()) == before


def test_the_old_name_update_warns():
    params = {"w": torch.ones(2)}
    sparams = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1})))
    opt = fs.optim.sgd(lr=0.5)
    with pytest.warns(DeprecationWarning, match=r"Optimizer.update is now Optimizer.update_"):
        update = opt.update
    sparams, _ = update(sparams, opt.init(sparams), sparams)
    assert torch.equal(sparams["w"].local, torch.full((2,), 0.5))


class _CountOps(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_update_does_not_loop_over_leaves(name):
    """The number of torch ops per update is the same for 2 leaves and 60 leaves in one unit."""

    def ops(n_leaves: int) -> int:
        params = {f"w{i}": torch.ones(3) for i in range(n_leaves)}
        sparams = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1})))
        opt = OPTIMIZERS[name][0]()
        state = opt.init(sparams)
        with _CountOps() as mode:
            opt.update_(sparams, state, sparams)
        return mode.calls

    assert ops(2) == ops(60)


def test_grads_of_another_plan_are_refused():
    params = {"w": torch.ones(4), "b": torch.ones(2)}
    sparams = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1})))
    other = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1}), units=["w"]))
    opt = fs.optim.sgd(lr=0.1)
    with pytest.raises(
        ValueError, match=r"grads is not sharded like params \(different units, dtypes or plan\)"
    ):
        opt.update_(other, opt.init(sparams), sparams)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: fs.optim.sgd(lr=0.1, nesterov=True), "nesterov=True needs momentum > 0"),
        (
            lambda: fs.optim.adamw(lr=0.1, betas=(1.0, 0.9)),
            r"adamw: betas\[0\] must be a number in \[0.0, 1.0\), got 1.0",
        ),
        (lambda: fs.optim.sgd(lr=0.1, weight_decay=-1), "weight_decay must be a number >= 0.0"),
        (lambda: fs.optim.sgd(lr=-0.1), r"learning rate -0.1: give a finite number >= 0"),
        (lambda: fs.optim.adamw(lr=float("nan")), r"learning rate nan: give a finite number >= 0"),
        (lambda: fs.optim.adamw(lr=float("inf")), r"learning rate inf"),
        (lambda: fs.optim.adamw(lr="3e-4"), r"learning rate '3e-4'"),  # pyright: ignore[reportArgumentType]
        (
            lambda: fs.optim.adamw(lr=0.1, eps=float("nan")),
            "adamw: eps must be a number >= 0.0, got nan",
        ),
        (
            lambda: fs.optim.sgd(lr=0.1, momentum=float("nan")),
            "sgd: momentum must be a number >= 0.0, got nan",
        ),
    ],
    ids=[
        "nesterov",
        "betas",
        "decay",
        "negative-lr",
        "nan-lr",
        "inf-lr",
        "str-lr",
        "nan-eps",
        "nan-momentum",
    ],
)
def test_bad_hyperparameters(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_a_schedule_that_returns_a_bad_rate_fails_the_update(bad):
    params = {"w": torch.ones(2)}
    sparams = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1})))
    opt = fs.optim.sgd(lr=lambda count: 0.1 if count == 0 else bad)
    state = opt.init(sparams)
    sparams, state = opt.update_(sparams, state, sparams)
    with pytest.raises(
        ValueError,
        match=rf"schedule returned {bad} for update 1; a learning rate must be a finite number >= 0",
    ):
        opt.update_(sparams, state, sparams)


def _clip(mesh: dict[str, int], max_norm: float) -> tuple[torch.Tensor, Any]:
    gen = torch.Generator().manual_seed(0)
    grads = {
        "w": torch.randn(6, 5, generator=gen),
        "b": torch.randn(3, generator=gen),
        "s": torch.tensor(2.0),
    }
    rules = [("s", fs.P()), ("b", fs.P())]  # replicated leaves count once
    plan = fs.plan(
        grads,
        fs.Mesh(mesh),
        rules=rules,
        strategy="hybrid_shard" if len(mesh) > 1 else "full_shard",
    )
    clipped, norm = fs.optim.clip_by_global_norm(fs.shard(grads, plan), max_norm)
    return norm, fs.unshard(clipped)


def _clip_summed_on_device(mesh: dict[str, int], max_norm: float) -> Any:
    """:func:`_clip` with the sums all-reduced as on an accelerator (gloo here)."""
    from funcshard._src.optim import clip

    before = clip._reduce_on_device
    clip._reduce_on_device = lambda device: True
    try:
        return _clip(mesh, max_norm)
    finally:
        clip._reduce_on_device = before


@pytest.mark.parametrize(("world_size", "mesh"), [(2, {"fsdp": 2}), (4, {"dp": 2, "fsdp": 2})])
def test_clip_by_global_norm_summed_on_the_device_equals_the_agreement(pools, world_size, mesh):
    """The accelerator's path (all-reduce, no host read) gives the host agreement's norm and grads."""
    for max_norm in (1.0, 100.0):
        agreed = pools.run(world_size, _clip, mesh, max_norm)
        on_device = pools.run(world_size, _clip_summed_on_device, mesh, max_norm)
        for (norm_a, clipped_a), (norm_d, clipped_d) in zip(agreed, on_device):
            torch.testing.assert_close(norm_d, norm_a, rtol=1e-15, atol=0)
            for k in clipped_a:
                torch.testing.assert_close(clipped_d[k], clipped_a[k], rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("world_size", "mesh"), [(1, {"fsdp": 1}), (2, {"fsdp": 2}), (4, {"dp": 2, "fsdp": 2})]
)
def test_clip_by_global_norm_equals_clip_grad_norm(pools, world_size, mesh):
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(6, 5, generator=gen), torch.randn(3, generator=gen), torch.tensor(2.0)]
    for max_norm in (1.0, 100.0):
        params = [torch.nn.Parameter(t.clone()) for t in full]
        for p, t in zip(params, full):
            p.grad = t.clone()
        expected_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        for norm, clipped in pools.run(world_size, _clip, mesh, max_norm):
            torch.testing.assert_close(norm, expected_norm)
            torch.testing.assert_close(clipped["w"], params[0].grad)
            torch.testing.assert_close(clipped["b"], params[1].grad)
            torch.testing.assert_close(clipped["s"], params[2].grad)


def _clip_trees() -> tuple[Any, Any, Any]:
    params = {"w": torch.tensor([3.0, 4.0]), "b": torch.tensor([12.0])}
    plan = fs.plan(params, fs.Mesh({"x": 1}))
    return fs.shard(params, plan), fs.shard(params, plan), plan


def test_clip_by_global_norm_does_not_write_its_input():
    """The pure form returns new gradients; a chain clips a copy; the _ forms write in place."""
    sparams, grads, _ = _clip_trees()
    clipped, norm = fs.optim.clip_by_global_norm(grads, 1.0)
    assert float(norm) == 13.0
    torch.testing.assert_close(grads["w"].local, torch.tensor([3.0, 4.0]), rtol=0, atol=0)
    torch.testing.assert_close(clipped["w"].local, torch.tensor([3.0, 4.0]) / 13)
    opt = fs.optim.chain(fs.optim.clip_by_global_norm(1.0), fs.optim.sgd(1.0))
    sparams, _ = opt.update_(grads, opt.init(sparams), sparams)
    torch.testing.assert_close(grads["b"].local, torch.tensor([12.0]), rtol=0, atol=0)
    torch.testing.assert_close(sparams["b"].local, torch.tensor([12.0 - 12.0 / 13]))
    same, _ = fs.optim.clip_by_global_norm_(grads, 1.0)
    assert same is grads
    torch.testing.assert_close(grads["b"].local, torch.tensor([12.0 / 13]))
    sparams, grads, _ = _clip_trees()
    opt = fs.optim.chain(fs.optim.clip_by_global_norm_(1.0), fs.optim.sgd(1.0))
    opt.update_(grads, opt.init(sparams), sparams)
    torch.testing.assert_close(grads["b"].local, torch.tensor([12.0 / 13]))


def test_clip_by_global_norm_scales_as_optax_and_eps_as_torch():
    """max_norm / norm (optax) by default; eps=1e-6 is torch's max_norm / (norm + eps), exactly."""
    _, grads, _ = _clip_trees()
    ours, _ = fs.optim.clip_by_global_norm(grads, 1.0)
    torch_style, _ = fs.optim.clip_by_global_norm(grads, 1.0, eps=1e-6)
    leaves = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))]
    leaves[0].grad, leaves[1].grad = torch.tensor([3.0, 4.0]), torch.tensor([12.0])
    torch.nn.utils.clip_grad_norm_(leaves, 1.0)
    torch.testing.assert_close(torch_style["w"].local, leaves[0].grad, rtol=0, atol=0)
    torch.testing.assert_close(ours["w"].local, torch.tensor([3.0, 4.0]) * (1.0 / 13.0))
    assert not torch.equal(ours["w"].local, torch_style["w"].local)
    under, _ = fs.optim.clip_by_global_norm(grads, 13.0)  # at max_norm: as they are
    assert torch.equal(under["b"].local, grads["b"].local)
    zero = fs.shard({"w": torch.zeros(2), "b": torch.zeros(1)}, _clip_trees()[2])
    kept, norm = fs.optim.clip_by_global_norm(zero, 0.0)  # 0 / 0 never arises
    assert float(norm) == 0
    assert torch.equal(kept["w"].local, torch.zeros(2))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: fs.optim.clip_by_global_norm(1.0, eps=-1.0), r"eps must be a finite number >= 0"),
        (
            lambda: fs.optim.adamw(1e-3, learning_rate=1e-3),
            r"adamw: the learning rate was given twice, as lr= .* and learning_rate=",
        ),
        (lambda: fs.optim.adamw(), r"adamw: missing the learning rate: give lr="),
        (
            lambda: fs.optim.adamw(1e-3, betas=(0.9, 0.99), b1=0.9),
            r"adamw: the decay rates were given twice, as betas= .* and b1=/b2=",
        ),
        (lambda: fs.optim.adamw(1e-3, eps_root=1e-8), r"eps_root=1e-08 .* is not supported"),
        (lambda: fs.optim.adamw(1e-3, nesterov=True), r"nesterov=True .* is not supported"),
        (lambda: fs.optim.adamw(1e-3, mu_dtype=torch.bfloat16), r"mu_dtype=.* is not supported"),
        (lambda: fs.optim.lion(1e-3, learning_rate=1e-3), r"lion: the learning rate was given"),
        (lambda: fs.optim.sgd(learning_rate=-1.0), r"learning rate -1.0: give a finite number"),
    ],
)
def test_optax_spellings_are_refused_twice_or_unsupported(call, message):
    with pytest.raises((TypeError, ValueError), match=message):
        call()


def test_optax_names_build_the_same_optimizers():
    """adamw(learning_rate=, b1=, b2=) equals adamw(lr, betas); sgd(momentum=None) is no momentum."""
    sparams, grads, _ = _clip_trees()
    results = []
    for opt in (
        fs.optim.adamw(1e-2, betas=(0.8, 0.95)),
        fs.optim.adamw(learning_rate=1e-2, b1=0.8, b2=0.95),
        fs.optim.lion(learning_rate=1e-2, b2=0.9),
        fs.optim.lion(1e-2, betas=(0.9, 0.9)),
        fs.optim.sgd(learning_rate=0.5, momentum=None),
        fs.optim.sgd(0.5),
    ):
        p = fs.shard(fs.unshard(sparams), _clip_trees()[2])
        p, _ = opt.update_(grads, opt.init(p), p)
        results.append(fs.unshard(p)["w"])
    for a, b in zip(results[::2], results[1::2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
