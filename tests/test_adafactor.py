"""Adafactor: equals torch.optim.Adafactor (default single-tensor path) on the full tensors.

References: ``torch.optim.Adafactor`` stepping the unsharded leaves in one process. One
process is compared bit for bit; sharded runs (simulated ranks, or 2 and 4 gloo ranks)
to float tolerance, since their sums add partial sums in another order. A failure
names the leaf (and the mesh) whose params or second moments differ.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import funcshard as fs
from funcshard._src.comm import collectives
from funcshard._src.optim.adafactor import AdafactorState, _Adafactor, adafactor
from funcshard._src.optim.base import LearningRate
from funcshard._src.shard.flat import unpack_gathered
from funcshard._src.shard.shard import shard_for_rank
from funcshard._src.shard.sharded import flats_of, trainable
from funcshard.testing import assert_trees_close
from tests.strategies import meshes, rules_for, tensor_trees, units_for

SCHEDULE = fs.optim.linear_schedule(0.05, 0.01, transition_steps=4)
# name: (our kwargs, torch kwargs); torch's lr is set per step from our schedule
CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "defaults": ({}, {}),
    "schedule_wd": ({"lr": SCHEDULE, "weight_decay": 0.1}, {"lr": 0.05, "weight_decay": 0.1}),
    "maximize_eps_d": (
        {"lr": 0.02, "beta2_decay": -0.5, "eps": (1e-20, 1e-2), "d": 2.0, "maximize": True},
        {"lr": 0.02, "beta2_decay": -0.5, "eps": (1e-20, 1e-2), "d": 2.0, "maximize": True},
    ),
}
STEPS = 5


def _params() -> dict[str, Any]:
    """1-D, 0-D, 2-D (one with a single row) and 3-D leaves of odd sizes, and a unit stack."""
    gen = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen)

    return {
        "b": w(5),
        "s": w(),
        "w": w(7, 3),
        "row": w(1, 6),
        "t": w(2, 5, 3),
        "blocks": [{"w": w(4, 8), "b": w(3)} for _ in range(2)],
    }


def _grads(params: Any, step: int) -> Any:
    """Gradients that grow with the step, so that update clipping (d) takes effect on some."""
    return fs.tree.map(lambda t: torch.sin(t * (step + 1)) * (step + 1) + 0.1, params)


def _lr_of(kwargs: dict[str, Any], step: int) -> float:
    lr: LearningRate = kwargs.get("lr", 1e-2)
    return lr(step) if callable(lr) else lr


def _torch_reference(
    params: Any, name: str, steps: int = STEPS
) -> list[tuple[torch.Tensor, dict[str, Any]]]:
    """torch.optim.Adafactor on the full leaves (those with elements): each leaf and its state."""
    ours, theirs = CONFIGS[name]
    leaves = [leaf.clone().requires_grad_() for leaf in fs.tree.leaves(params) if leaf.numel()]
    if not leaves:
        return []
    reference = torch.optim.Adafactor(leaves, **theirs)
    for step in range(steps):
        grads = [g for g in fs.tree.leaves(_grads(params, step)) if g.numel()]
        for leaf, g in zip(leaves, grads):
            leaf.grad = g.clone()
        reference.param_groups[0]["lr"] = _lr_of(ours, step)
        reference.step()
    return [(leaf.detach(), reference.state[leaf]) for leaf in leaves]


def _assert_equals_reference(
    params: Any, full: dict[str, Any], name: str, *, rtol: float, atol: float
) -> None:
    """``full``: unsharded params and the state's row, col and variance trees."""
    ours = {k: dict(zip(*fs.tree.flatten_with_paths(v)[:2])) for k, v in full.items()}
    for path, (ref, s) in zip(_paths(params), _torch_reference(params, name)):
        torch.testing.assert_close(
            ours["params"][path], ref, rtol=rtol, atol=atol, msg=lambda m, p=path: f"{p}: {m}"
        )
        expected = (
            {"row": s["row_var"], "col": s["col_var"]}
            if ref.ndim >= 2
            else {"variance": s["variance"]}
        )
        for kind, value in expected.items():
            torch.testing.assert_close(
                ours[kind][path],
                value,
                rtol=rtol,
                atol=atol,
                msg=lambda m, p=path, k=kind: f"{p} {k}: {m}",
            )


def _paths(params: Any) -> list[str]:
    """The paths of the leaves with elements (torch.optim.Adafactor cannot step empty ones)."""
    return [p for p, leaf in zip(*fs.tree.flatten_with_paths(params)[:2]) if leaf.numel()]


def _unshard_all(sparams: Any, state: AdafactorState) -> dict[str, Any]:
    return _unshard(
        {"params": sparams, "row": state.row, "col": state.col, "variance": state.variance}
    )


def _unshard(sharded: Any) -> Any:
    """``fs.unshard`` with copies of the plain tensors (the factors), which it passes through."""
    return fs.tree.map(lambda x: x.clone(), fs.unshard(sharded))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_one_process_equals_torch_bit_for_bit(name):
    """Five updates on a mesh of size 1 == torch.optim.Adafactor, exactly (params and moments)."""
    params = _params()
    plan = fs.plan(params, fs.Mesh({"x": 1}), units=["blocks/*"])
    opt = adafactor(**CONFIGS[name][0])
    sparams = fs.shard(params, plan)
    state = opt.init(sparams)
    for step in range(STEPS):
        sparams, state = opt.update_(fs.shard(_grads(params, step), plan), state, sparams)
    assert int(state.count) == STEPS
    _assert_equals_reference(params, _unshard_all(sparams, state), name, rtol=0, atol=0)


def test_no_collective_outside_a_distributed_run(monkeypatch):
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a collective outside a distributed run")

    monkeypatch.setattr(torch.distributed, "all_reduce", refuse)
    params = _params()
    plan = fs.plan(params, fs.Mesh({"x": 1}))
    sparams = fs.shard(params, plan)
    opt = adafactor()
    opt.update_(fs.shard(_grads(params, 0), plan), opt.init(sparams), sparams)


def test_update_writes_in_place_and_keeps_factors_small():
    params = {"w": torch.ones(6, 4), "b": torch.ones(3)}
    sparams = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1})))
    opt = adafactor()
    state = opt.init(sparams)
    assert state.row["w"].shape == (6, 1)
    assert state.col["w"].shape == (1, 4)
    assert state.variance["w"] is None
    assert state.row["b"] is None
    assert state.variance["b"].flat.data.numel() == 3  # no buffer for the matrix's elements
    before = (sparams["w"].flat.data.data_ptr(), state.row["w"].data_ptr())
    new_params, new_state = opt.update_(sparams, state, sparams)
    assert (new_params["w"].flat.data.data_ptr(), new_state.row["w"].data_ptr()) == before
    assert not torch.equal(new_params["w"].local, torch.ones(6, 4))


def _full_per_path(per_rank: list[Any]) -> dict[str, torch.Tensor]:
    """Every sharded leaf reassembled from every rank's flat buffers (one process), by path."""
    out: dict[str, torch.Tensor] = {}
    flats = [flats_of(t) for t in per_rank]
    for i, flat in enumerate(flats[0]):
        gathered = torch.stack([f[i].data for f in flats])
        for slot, leaf in zip(flat.layout.slots, unpack_gathered(flat.layout, gathered)):
            out[slot.path] = leaf
    return out


def _simulate(rule: _Adafactor, grads: list[Any], states: list[Any], sparams: list[Any]) -> None:
    """One update on every simulated rank, each phase's partial sums added over the ranks."""
    steps = [rule.steps(g, s, p) for g, s, p in zip(grads, states, sparams)]
    partials = [next(s, None) for s in steps]
    while partials[0] is not None:
        assert all(p is not None for p in partials)
        total = torch.stack(partials).sum(0)  # pyright: ignore[reportArgumentType]
        partials = [_send(s, total.clone()) for s in steps]
    assert all(p is None for p in partials)


def _send(steps: Any, total: torch.Tensor) -> torch.Tensor | None:
    try:
        return steps.send(total)
    except StopIteration:
        return None


@st.composite
def sharded_cases(draw: st.DrawFn) -> tuple[Any, fs.Plan]:
    params = draw(tensor_trees(dtypes=(torch.float32,), max_leaves=6))
    mesh = draw(meshes(max_size=4))
    rules = draw(rules_for(params, mesh))
    return params, fs.plan(params, mesh, rules=rules, units=draw(units_for(params)))


@settings(max_examples=25)
@given(sharded_cases())
def test_simulated_ranks_equal_torch_on_any_mesh_and_specs(case):
    """Every rank of a drawn mesh and specs in one process, sums added across them == torch."""
    params, plan = case
    rule = _Adafactor(SCHEDULE, -0.8, None, 1e-3, 1.0, 0.1, False)
    ranks = range(plan.mesh.size)
    sparams = [shard_for_rank(params, plan, r) for r in ranks]
    states = [rule.init(s) for s in sparams]
    for step in range(3):
        grads = [trainable(shard_for_rank(_grads(params, step), plan, r)) for r in ranks]
        _simulate(rule, grads, states, sparams)
    for r in ranks:  # the replicated factors agree on every rank
        for a, b in zip(fs.tree.leaves(states[0].row), fs.tree.leaves(states[r].row)):
            assert torch.equal(a, b)
    ours = _full_per_path(sparams)
    for path, (ref, _) in zip(_paths(params), _torch_reference(params, "schedule_wd", steps=3)):
        torch.testing.assert_close(
            ours[path], ref, rtol=1e-5, atol=1e-5, msg=lambda m, p=path: f"{p} on {plan.mesh}: {m}"
        )


MESHES = {
    "fsdp2": ({"fsdp": 2}, "full_shard", []),
    "fsdp4": ({"fsdp": 4}, "full_shard", []),
    "hybrid2x2": ({"dp": 2, "fsdp": 2}, "hybrid_shard", []),
    "specs2x2": (
        {"dp": 2, "fsdp": 2},
        "full_shard",
        [
            ("w", fs.P(None, "fsdp")),
            ("blocks/*/w", fs.P("dp", "fsdp")),
            ("t", fs.P(None, "fsdp", "dp")),
        ],
    ),
}


def _train_on_ranks(mesh_name: str, name: str) -> tuple[dict[str, Any], list[tuple[int, Any]]]:
    """Trains on this rank's shards; returns the unsharded params and state, and the all-reduces."""
    axes, strategy, rules = MESHES[mesh_name]
    params = _params()
    plan = fs.plan(params, fs.Mesh(axes), rules=rules, units=["blocks/*"], strategy=strategy)
    opt = adafactor(**CONFIGS[name][0])
    sparams = fs.shard(params, plan)
    state = opt.init(sparams)
    calls: list[tuple[int, Any]] = []
    real = collectives.all_reduce

    def counting(buf: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append((buf.numel(), args[1]))
        return real(buf, *args, **kwargs)

    collectives.all_reduce = counting
    try:
        for step in range(STEPS):
            grads = trainable(fs.shard(_grads(params, step), plan, verify=False))
            sparams, state = opt.update_(grads, state, sparams)
    finally:
        collectives.all_reduce = real
    return _unshard_all(sparams, state), calls


@pytest.mark.parametrize(
    ("world", "mesh_name", "name"),
    [
        (2, "fsdp2", "schedule_wd"),
        (2, "fsdp2", "maximize_eps_d"),
        (4, "fsdp4", "schedule_wd"),
        (4, "hybrid2x2", "schedule_wd"),
        (4, "specs2x2", "maximize_eps_d"),
    ],
)
def test_ranks_equal_one_process_torch(pools, world, mesh_name, name):
    """W ranks (gloo) == torch.optim.Adafactor in one process; two all-reduces a step, over the mesh."""
    axes = tuple(MESHES[mesh_name][0])
    for full, calls in pools.run(world, _train_on_ranks, mesh_name, name):
        _assert_equals_reference(_params(), full, name, rtol=1e-5, atol=1e-7)
        assert len(calls) == 2 * STEPS
        assert all(got == axes for _, got in calls)
        assert calls[1][0] == len(_paths(_params()))  # the second phase: one number per leaf


def test_frozen_leaves_are_untouched_and_have_no_state():
    """A frozen base (LoRA-like) keeps its values and gets None state; the rest == torch."""
    params = {"base": torch.randn(4, 3), "lora": torch.randn(3, 2), "bias": torch.randn(3)}
    plan = fs.plan(params, fs.Mesh({"x": 1}), frozen=["base"])
    sparams = fs.shard(params, plan)
    opt = adafactor(**CONFIGS["schedule_wd"][0])
    state = opt.init(sparams)
    assert state.row["base"] is None
    assert state.col["base"] is None
    assert state.variance["base"] is None
    for step in range(STEPS):
        grads = trainable(fs.shard(_grads(params, step), plan))
        assert grads["base"] is None
        sparams, state = opt.update_(grads, state, sparams)
    assert torch.equal(sparams["base"].local, params["base"])
    rest = {"lora": params["lora"], "bias": params["bias"]}
    full = _unshard_all(sparams, state)
    del full["params"]["base"]
    _assert_equals_reference(rest, full, "schedule_wd", rtol=0, atol=0)


def test_integer_leaves_are_not_updated():
    params = {"w": torch.randn(3, 2), "n": torch.arange(4)}
    plan = fs.plan(params, fs.Mesh({"x": 1}))
    sparams = fs.shard(params, plan)
    opt = adafactor()
    state = opt.init(sparams)
    assert state.row["n"] is None
    assert state.variance["n"] is None
    sparams, _ = opt.update_(fs.shard(params, plan), state, sparams)
    assert torch.equal(sparams["n"].local, torch.arange(4))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1.0}, "learning rate"),
        ({"lr": float("nan")}, "learning rate"),
        ({"beta2_decay": 0.5}, "beta2_decay"),
        ({"beta2_decay": float("-inf")}, "beta2_decay"),
        ({"eps": (-1.0, 1e-3)}, r"eps\[0\]"),
        ({"eps": (None, -1.0)}, r"eps\[1\]"),
        ({"eps": (1e-30,)}, "eps must be a pair"),
        ({"d": 0.5}, "adafactor: d"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"maximize": "yes"}, "maximize"),
    ],
)
def test_bad_hyperparameters_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        adafactor(**kwargs)


def test_a_schedule_returning_a_bad_rate_names_the_update():
    params = {"w": torch.ones(2, 2)}
    sparams = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1})))
    opt = adafactor(lr=lambda n: -1.0)
    with pytest.raises(ValueError, match=r"schedule returned -1\.0 for update 0"):
        opt.update_(sparams, opt.init(sparams), sparams)


def test_grads_or_state_of_other_params_are_refused():
    params = {"w": torch.ones(2, 3), "b": torch.ones(3)}
    plan = fs.plan(params, fs.Mesh({"x": 1}))
    sparams = fs.shard(params, plan)
    opt = adafactor()
    other = {"w": torch.ones(3, 2), "b": torch.ones(3)}
    other_sparams = fs.shard(other, fs.plan(other, fs.Mesh({"x": 1})))
    with pytest.raises(ValueError, match="grads is not sharded like params"):
        opt.update_(other_sparams, opt.init(sparams), sparams)
    with pytest.raises(ValueError, match=r"w: the Adafactor state does not fit"):
        opt.update_(sparams, opt.init(other_sparams), sparams)


def _save_then_step(directory: str) -> tuple[Any, Any]:
    """Two updates on this world's ranks, save, then a third; the state saved and the result."""
    params = _params()
    plan = fs.plan(params, fs.Mesh({"fsdp": fs.world_size()}), units=["blocks/*"])
    sparams = fs.shard(params, plan)
    opt = adafactor(**CONFIGS["schedule_wd"][0])
    state = opt.init(sparams)
    for step in range(2):
        sparams, state = opt.update_(fs.shard(_grads(params, step), plan), state, sparams)
    fs.checkpoint.save(directory, {"params": sparams, "opt": state}, step=2)
    saved = _unshard({"params": sparams, "opt": state})
    sparams, state = opt.update_(fs.shard(_grads(params, 2), plan), state, sparams)
    return saved, _unshard_all(sparams, state)


def _load_then_step(directory: str) -> tuple[Any, Any]:
    """Loads into another world's shards of other values, then the third update."""
    params = _params()
    plan = fs.plan(params, fs.Mesh({"fsdp": fs.world_size()}))
    sparams = fs.shard(fs.tree.map(torch.zeros_like, params), plan)
    opt = adafactor(**CONFIGS["schedule_wd"][0])
    loaded = fs.checkpoint.load(directory, like={"params": sparams, "opt": opt.init(sparams)})
    sparams, state = loaded["params"], loaded["opt"]
    assert isinstance(state, AdafactorState)
    assert int(state.count) == 2
    got = _unshard({"params": sparams, "opt": state})
    sparams, state = opt.update_(fs.shard(_grads(params, 2), plan), state, sparams)
    return got, _unshard_all(sparams, state)


def test_checkpoint_saved_on_two_ranks_resumes_on_one(pools, tmp_path):
    """Save the state on W=2, load it on W=1 (other plan): equal state, and the next update agrees."""
    directory = str(tmp_path / "ckpt")
    saved, stepped = pools.run(2, _save_then_step, directory)[0]
    loaded, resumed = pools.run(1, _load_then_step, directory)[0]
    assert_trees_close(loaded, saved, rtol=0, atol=0)
    assert_trees_close(resumed, stepped, rtol=1e-5, atol=1e-7)


def test_the_flat_layout_is_refused_with_the_fix():
    params = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    sp = fs.shard(params, fs.plan(params, fs.Mesh({"x": 1}), layout="flat"))
    with pytest.raises(
        ValueError, match=r"adafactor: unit '<root>' is in the flat layout.*layout='leaf'"
    ):
        fs.optim.adafactor(lr=0.01).init(sp)
