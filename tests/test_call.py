"""fs.call and the step around it: misuse is a clear error; reuse, remat and output dtypes work."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import funcshard as fs
from funcshard.testing import assert_trees_close, reference_value_and_grad


def params_():
    gen = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(5, 4, generator=gen),
        "blocks": [
            {"w": torch.randn(4, 4, generator=gen), "b": torch.randn(4, generator=gen)}
            for _ in range(2)
        ],
    }


def layer(p, h):
    return torch.tanh(h @ p["w"] + p["b"])


def step_for(loss_fn, **kwargs):
    params = params_()
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=["blocks/*"])
    return fs.value_and_grad(loss_fn, plan, **kwargs), fs.shard(params, plan)


X = torch.tensor([0, 3, 1])


def run(loss_fn, **kwargs):
    step, sparams = step_for(loss_fn, **kwargs)
    return step(sparams, X)


def test_call_outside_a_step_is_a_plain_call():
    p = params_()["blocks"][0]
    h = torch.ones(2, 4)
    assert torch.equal(fs.call(layer, p, h), layer(p, h))


@pytest.mark.parametrize(
    ("loss_fn", "message"),
    [
        (
            lambda p, x: fs.call(layer, p["blocks"], p["embed"][x]).sum(),
            r"fs.call got leaves of 2 units \['blocks/0', 'blocks/1'\] \(\['blocks/0/b', 'blocks/0/w', 'blocks/1/b', 'blocks/1/w'\]\); pass exactly one unit's subtree \(units: \['<root>', 'blocks/0', 'blocks/1'\]\)",
        ),
        (
            lambda p, x: fs.call(lambda w, h: h @ w, p["blocks"][0]["w"], p["embed"][x]).sum(),
            r"fs.call got 1 of the 2 leaves of unit 'blocks/0' \(missing \['blocks/0/b'\]\); pass the unit's whole subtree",
        ),
        (
            lambda p, x: fs.call(lambda e, i: e[i], p["embed"], x).sum(),
            r"fs.call got a leaf of the root unit: root-unit leaves are full tensors inside loss_fn; use them directly, or name their subtree in plan\(units=...\)",
        ),
        (
            lambda p, x: fs.call(
                layer, {"w": torch.eye(4), "b": torch.zeros(4)}, p["embed"][x]
            ).sum(),
            r"fs.call got a Tensor at 'b' where a unit's leaves should be: pass a subtree of the params that the step gave loss_fn",
        ),
        (
            lambda p, x: fs.call(layer, [p["blocks"][0], p["blocks"][0]], p["embed"][x]).sum(),
            r"\['blocks/0/b', 'blocks/0/w'\] given twice",
        ),
    ],
    ids=["two-units", "part-of-a-unit", "root-leaf", "foreign-tensor", "leaf-twice"],
)
def test_call_with_something_that_is_not_one_unit(loss_fn, message):
    with pytest.raises(ValueError, match=message):
        run(loss_fn)


def test_nested_call():
    def outer(p, h, inner):
        return fs.call(layer, inner, layer(p, h))

    def loss_fn(p, x):
        return fs.call(outer, p["blocks"][0], p["embed"][x], p["blocks"][1]).sum()

    with pytest.raises(
        RuntimeError,
        match=r"nested fs.call: unit 'blocks/1' was called inside the function of unit 'blocks/0'; units cannot nest",
    ):
        run(loss_fn)


@pytest.mark.parametrize(
    ("use", "what", "error"),
    [
        (lambda w, h: h @ w, "__rmatmul__|matmul", TypeError),
        (lambda w, h: w @ h.T, "__matmul__", TypeError),
        (lambda w, h: torch.tanh(w), "tanh", TypeError),
        (lambda w, h: w.sum(), r"\.sum", AttributeError),
        (lambda w, h: w[0], "__getitem__", TypeError),
        (lambda w, h: w + 1, "__add__", TypeError),
    ],
)
def test_unit_leaf_used_outside_every_call(use, what, error):
    def loss_fn(p, x):
        return use(p["blocks"][1]["w"], p["embed"][x]).sum()

    with pytest.raises(
        error,
        match=rf"blocks/1/w: ({what}).* on a sharded leaf of unit 'blocks/1'. Inside loss_fn, use unit leaves through fs.call\(fn, <the unit's subtree>, ...\)",
    ):
        run(loss_fn)


def test_sharded_leaf_passed_to_call_outside_a_step():
    _, sparams = step_for(lambda p, x: None)
    with pytest.raises(
        ValueError, match=r"fs.call got the sharded leaf 'blocks/0/b' outside a step"
    ):
        fs.call(layer, sparams["blocks"][0], torch.ones(4))


@pytest.mark.parametrize(
    ("loss_fn", "kwargs", "error", "message"),
    [
        (
            lambda p, x: p["embed"][x],
            {},
            TypeError,
            r"loss_fn must return a floating-point scalar tensor as the loss, got a torch.float32 tensor of shape \(3, 4\)",
        ),
        (
            lambda p, x: (p["embed"][x].sum(), 1),
            {},
            TypeError,
            r"got a tuple; to return \(loss, aux\), pass has_aux=True",
        ),
        (
            lambda p, x: p["embed"][x].sum(),
            {"has_aux": True},
            TypeError,
            r"has_aux=True: loss_fn must return \(loss, aux\), got Tensor",
        ),
        (
            lambda p, x: torch.tensor(1.0),
            {},
            ValueError,
            r"the loss does not depend on any parameter",
        ),
    ],
)
def test_bad_losses(loss_fn, kwargs, error, message):
    with pytest.raises(error, match=message):
        run(loss_fn, **kwargs)


def test_step_refuses_params_of_another_plan_or_unsharded():
    step, sparams = step_for(lambda p, x: p["embed"][x].sum())
    with pytest.raises(
        TypeError,
        match=r"blocks/0/b: the step needs sharded params \(from fs.shard\), got a Tensor",
    ):
        step(params_(), X)
    other = fs.plan(params_(), fs.Mesh({"fsdp": 1}), units=["blocks"])
    with pytest.raises(
        ValueError,
        match=r"unit 'blocks': the params were sharded with another plan or rank than this step's \(plan fingerprint [0-9a-f]{16}\); shard them with this plan",
    ):
        step(fs.shard(params_(), other), X)
    with pytest.raises(ValueError, match="do not have the plan's tree structure"):
        step({"embed": sparams["embed"]}, X)


def test_step_inside_a_step():
    step, sparams = step_for(lambda p, x: p["embed"][x].sum())

    def loss_fn(p, x):
        step(sparams, x)
        return p["embed"][x].sum()

    outer, outer_params = step_for(loss_fn)
    with pytest.raises(RuntimeError, match="a step was called inside another step's loss_fn"):
        outer(outer_params, X)


def test_a_failed_step_leaves_nothing_gathered():
    step, sparams = step_for(
        lambda p, x: fs.call(lambda b, h: 1 / 0, p["blocks"][0], p["embed"][x])
    )
    with pytest.raises(ZeroDivisionError):
        step(sparams, X)
    assert all(u.state.value == "sharded" and u.holders == 0 for u in step._runtimes())
    assert (
        fs.call(layer, params_()["blocks"][0], torch.ones(4)) is not None
    )  # no step context left behind


def reuse_loss(p: Any, x: torch.Tensor) -> torch.Tensor:
    """blocks/0 used twice in one forward (weight tying across depth)."""
    h = p["embed"][x]
    h = fs.call(layer, p["blocks"][0], h)
    h = fs.call(layer, p["blocks"][1], h)
    h = fs.call(layer, p["blocks"][0], h)
    return (h**2).mean()


def remat_loss(p: Any, x: torch.Tensor) -> torch.Tensor:
    h = p["embed"][x]
    for blk in p["blocks"]:
        h = fs.call(layer, blk, h, remat=True)
    return (h**2).mean()


def _train_one(loss_fn: Any, strategy: Any) -> Any:
    params = params_()
    plan = fs.plan(
        params, fs.Mesh({"fsdp": fs.world_size()}), units=["blocks/*"], strategy=strategy
    )
    step = fs.value_and_grad(loss_fn, plan)
    loss, grads = step(fs.shard(params, plan), X + fs.rank())
    return loss, fs.unshard(grads)


@pytest.mark.parametrize("loss_fn", [reuse_loss, remat_loss], ids=["reuse", "remat"])
@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op"])
def test_reuse_and_remat_give_the_reference_gradients(pools, loss_fn, strategy):
    results = pools.run(2, _train_one, loss_fn, strategy)
    ref_loss, ref_grads = reference_value_and_grad(loss_fn, params_(), [(X,), (X + 1,)])
    torch.testing.assert_close(torch.stack([r[0] for r in results]).mean(), ref_loss)
    for _, grads in results:
        assert_trees_close(grads, ref_grads)


def test_remat_recomputes_the_unit_in_backward():
    calls = []

    def counted(p, h):
        calls.append(torch.is_grad_enabled())
        return layer(p, h)

    for remat, expected in [(False, 2), (True, 4)]:
        calls.clear()

        def loss_fn(p, x, remat=remat):
            h = p["embed"][x]
            for blk in p["blocks"]:
                h = fs.call(counted, blk, h, remat=remat)
            return h.sum()

        run(loss_fn)
        assert len(calls) == expected


def test_output_dtype_casts_call_outputs():
    seen = []

    def loss_fn(p, x):
        h = fs.call(
            lambda b, h: (seen.append(b["w"].dtype), layer(b, h))[1], p["blocks"][0], p["embed"][x]
        )
        seen.append(h.dtype)
        return h.float().sum()

    mp = fs.MixedPrecision(param_dtype=torch.bfloat16, output_dtype=torch.float16)
    run(loss_fn, mixed_precision=mp)
    assert seen == [torch.bfloat16, torch.float16]
    with pytest.raises(
        TypeError, match=r"MixedPrecision.param_dtype must be a floating torch.dtype or None"
    ):
        fs.MixedPrecision(param_dtype=torch.int32)


def _held_gradients(strategy: Any, donate: bool) -> tuple[bool, bool, str]:
    """Keeps the first step's gradients and runs three more steps and updates."""
    params = params_()
    plan = fs.plan(
        params, fs.Mesh({"fsdp": fs.world_size()}), units=["blocks/*"], strategy=strategy
    )
    step = fs.value_and_grad(
        lambda p, x: fs.call(layer, p["blocks"][0], p["embed"][x]).sum(),
        plan,
        donate_grads=donate,
        bucket_bytes=0,  # a bucket's gradients are one new buffer: donation is per unit
    )
    sparams = fs.shard(params, plan)
    opt = fs.optim.sgd(lr=0.1)
    state = opt.init(sparams)
    _, held = step(sparams, X)
    if donate:
        first_buffer = held["blocks"][0]["w"].flat.data.data_ptr()
    kept = fs.tree.map(lambda g: g.local.clone(), held)  # what the held tree says now
    sparams, state = opt.update_(held, state, sparams)
    _, grads = step(sparams, X)
    reused = donate and grads["blocks"][0]["w"].flat.data.data_ptr() == first_buffer
    for _ in range(2):
        sparams, state = opt.update_(grads, state, sparams)
        _, grads = step(sparams, X)
    try:
        unchanged = all(
            torch.equal(g.local, k) for g, k in zip(fs.tree.leaves(held), fs.tree.leaves(kept))
        )
        error = ""
    except fs.DonatedError as e:
        unchanged, error = False, str(e)
    return reused, unchanged, error


@pytest.mark.parametrize("strategy", ["full_shard", "no_shard"])
def test_a_held_gradient_tree_is_never_written_by_later_steps(pools, strategy):
    """Reference: the held tree's own values, cloned when it was returned; mesh of one rank and W=2."""
    assert _held_gradients(strategy, False) == (False, True, "")
    assert pools.run(2, _held_gradients, strategy, False) == [(False, True, "")] * 2


@pytest.mark.parametrize("strategy", ["full_shard", "no_shard"])
def test_donated_gradients_are_reused_and_raise_when_read(pools, strategy):
    """donate_grads=True: the next call writes into the returned buffers, and the old tree is dead.

    On a mesh of one rank the gradients are autograd's own tensors, with no buffer to
    write into (docs/executor.md, "Local-only units"): the old tree is dead all the same.
    """
    for world, (reused, unchanged, error) in [
        (1, _held_gradients(strategy, True)),
        *((2, r) for r in pools.run(2, _held_gradients, strategy, True)),
    ]:
        assert reused == (world > 1)
        assert not unchanged
        assert (
            "unit 'blocks/0': this tree's buffers were donated (a step with donate_grads=True"
            in error
        )
