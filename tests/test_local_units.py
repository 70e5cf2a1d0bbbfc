"""Units on a mesh of one rank: no autograd node of their own, gradients held as autograd's tensors.

See [Note: local-only calls] in ``execute/call_record.py`` and [Note: gradients held as
leaves] in ``shard/sharded.py``. Every value is compared with the unsharded
``torch.func`` reference; the structure (which gradients are held as leaves,
which graph nodes exist) is checked beside it, so a change that copies again or
that brings the node back fails here.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import funcshard as fs
from funcshard._src.shard.layout import layouts
from funcshard._src.shard.sharded import FlatShard, concatenate_leaves, flats_of
from funcshard.testing import assert_trees_close, reference_value_and_grad
from tests.models import Model

MODEL = Model(kind="transformer", vocab=13, width=8, hidden=12, layers=3)
ONE = fs.Mesh({"fsdp": 1})


def _setup(model: Model = MODEL, **plan_kwargs: Any) -> tuple[Any, Any, Any]:
    params = model.init(0)
    plan = fs.plan(params, ONE, units=model.units, **plan_kwargs)
    return params, plan, fs.shard(params, plan)


def _full(grads: Any) -> Any:
    return fs.tree.map(lambda g: g.local.clone(), grads)


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op", "no_shard"])
@pytest.mark.parametrize("remat", [False, True])
def test_a_one_rank_step_holds_autograds_gradients_and_equals_the_reference(strategy, remat):
    model = Model(kind="transformer", vocab=13, width=8, hidden=12, layers=3, remat=remat)
    params, plan, sparams = _setup(model, strategy=strategy)
    batch = model.batch_for(1)
    loss, grads = fs.value_and_grad(model.loss_fn, plan)(sparams, *batch)
    trained = [f for f in flats_of(grads) if f.layout.dtype.is_floating_point]
    assert trained
    assert all(f.leaves is not None for f in trained)
    # each held gradient is a tensor of its own, not a view into anything
    assert all(t._base is None and t.is_contiguous() for f in trained for t in f.leaves or ())
    ref_loss, ref_grads = reference_value_and_grad(model.loss_fn, params, [batch])
    torch.testing.assert_close(loss, ref_loss)
    assert_trees_close(_full(grads), ref_grads, rtol=1e-5, atol=1e-6)


def test_a_local_call_adds_no_autograd_node_and_registers_no_hook():
    """The call's output leads straight to the leaves' AccumulateGrad nodes, as in plain torch."""
    _params, plan, sparams = _setup()
    seen: list[str] = []

    def loss_fn(p: Any, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = p["embed"]["tokens"][tokens]
        out = fs.call(lambda blk, x: x @ blk["attn"]["wo"], p["blocks"][0], h)
        stack = [out.grad_fn]
        while stack:
            node = stack.pop()
            if node is None:
                continue
            seen.append(type(node).__name__)
            stack.extend(n for n, _ in node.next_functions)
        return out.sum() + p["head"]["temp"]

    fs.value_and_grad(loss_fn, plan)(sparams, *MODEL.batch_for(0))
    assert "AccumulateGrad" in seen
    assert not any("Gather" in name for name in seen), seen


def test_several_micro_batches_and_a_unit_called_twice_reduce_into_one_buffer():
    """Gradients that add up (accumulation, weight sharing) come in a flat buffer, and are right."""
    params, plan, sparams = _setup()
    batches = [MODEL.batch_for(i) for i in range(3)]
    _, grads = fs.value_and_grad(MODEL.loss_fn, plan).accumulate(sparams, batches)
    assert all(f.leaves is None for f in flats_of(grads))
    _, ref = reference_value_and_grad(MODEL.loss_fn, params, batches)
    assert_trees_close(_full(grads), ref, rtol=1e-5, atol=1e-6)

    def twice(p: Any, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = p["embed"]["tokens"][tokens]
        for blk in [p["blocks"][0], p["blocks"][0], *p["blocks"][1:]]:
            h = fs.call(MODEL._block, blk, h)
        return (h @ p["head"]["w"]).logsumexp(-1).mean() * p["head"]["temp"]

    batch = MODEL.batch_for(2)
    _, grads = fs.value_and_grad(twice, plan)(sparams, *batch)
    _, ref = reference_value_and_grad(twice, params, [batch])
    assert_trees_close(_full(grads), ref, rtol=1e-5, atol=1e-6)


def test_mixed_precision_on_one_rank_is_not_local_and_still_right():
    params, plan, sparams = _setup()
    step = fs.value_and_grad(
        MODEL.loss_fn, plan, mixed_precision=fs.MixedPrecision(param_dtype=torch.bfloat16)
    )
    batch = MODEL.batch_for(3)
    _, grads = step(sparams, *batch)
    assert all(f.leaves is None for f in flats_of(grads) if f.layout.unit != "<root>")
    _, ref = reference_value_and_grad(MODEL.loss_fn, params, [batch])
    assert_trees_close(_full(grads), ref, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("make", ["adamw", "adamw_foreach", "lion", "sgd_nesterov_wd"])
def test_optimizers_update_from_held_leaves_as_from_the_flat_buffer(make):
    """The same step from grads held as leaves and from the same grads read as one buffer."""
    optimizer = {
        "adamw": lambda: fs.optim.adamw(lr=1e-2, weight_decay=0.1),
        "adamw_foreach": lambda: fs.optim.adamw(lr=1e-2, weight_decay=0.1, fused=False),
        "lion": lambda: fs.optim.lion(lr=1e-3, weight_decay=0.1),
        "sgd_nesterov_wd": lambda: fs.optim.sgd(
            lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1
        ),
    }[make]
    results = []
    for materialize in (False, True):
        _, plan, sparams = _setup()
        opt = optimizer()
        state = opt.init(sparams)
        step = fs.value_and_grad(MODEL.loss_fn, plan)
        for i in range(3):
            _, grads = step(sparams, *MODEL.batch_for(i))
            before = _full(grads) if materialize else None  # reads every buffer: concatenates
            assert all((f.leaves is None) == materialize for f in flats_of(grads))
            sparams, state = opt.update_(grads, state, sparams)
            if before is not None:  # grads are only read by the update
                assert_trees_close(_full(grads), before, rtol=0, atol=0)
        results.append(_full(sparams))
    assert_trees_close(results[0], results[1], rtol=1e-6, atol=1e-7)


def test_a_held_gradient_shard_reads_as_its_concatenation_once():
    _, _plan, sparams = _setup()
    flat = sparams["blocks"][0]["mlp"]["w1"].flat
    leaves = [torch.randn(s.shape) for s in flat.layout.slots]
    held = FlatShard.of_leaves(flat.layout, leaves, 0)
    assert held.nbytes == flat.layout.nbytes
    assert held.leaves is not None
    expected = torch.cat([t.reshape(-1) for t in leaves])
    torch.testing.assert_close(held.data, expected, rtol=0, atol=0)
    assert held.leaves is None
    assert held.data is held.data
    assert torch.equal(concatenate_leaves(flat.layout, leaves), expected)


def test_a_donated_held_shard_hands_over_nothing_and_is_dead():
    _, _plan, sparams = _setup()
    layout = sparams["head"]["w"].flat.layout
    held = FlatShard.of_leaves(layout, [torch.zeros(s.shape) for s in layout.slots], 0)
    assert held.donate() is None
    assert held.donated
    with pytest.raises(fs.DonatedError, match="donated"):
        held.data  # noqa: B018
    with pytest.raises(fs.DonatedError):
        held.leaves  # noqa: B018
    with pytest.raises(fs.DonatedError):
        held.nbytes  # noqa: B018
    read = FlatShard.of_leaves(layout, [torch.ones(s.shape) for s in layout.slots], 0)
    data = read.data
    assert read.donate() is data  # read as one buffer: that buffer is handed over


def test_a_failed_one_rank_step_leaves_no_gradient_behind():
    """An error mid-backward, then a good step: its gradients are the reference's alone."""
    params, plan, sparams = _setup()
    step = fs.value_and_grad(MODEL.loss_fn, plan)

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom in backward")

    def failing(p: Any, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = fs.call(MODEL._block, p["blocks"][0], p["embed"]["tokens"][tokens])
        h = Boom.apply(h)  # raises after the later blocks' gradients were accumulated
        for blk in p["blocks"][1:]:
            h = fs.call(MODEL._block, blk, h)
        return (h @ p["head"]["w"]).logsumexp(-1).mean()

    with pytest.raises(RuntimeError, match="boom in backward"):
        fs.value_and_grad(failing, plan)(sparams, *MODEL.batch_for(0))
    batch = MODEL.batch_for(4)
    _, grads = step(sparams, *batch)
    _, ref = reference_value_and_grad(MODEL.loss_fn, params, [batch])
    assert_trees_close(_full(grads), ref, rtol=1e-5, atol=1e-6)


def test_clipping_and_the_finiteness_check_read_held_leaves_without_concatenating():
    """chain(skip_nonfinite(), clip, adamw) from held leaves equals the same from one buffer."""
    results, norms = [], []
    for materialize in (False, True):
        params, plan, sparams = _setup()
        opt = fs.optim.chain(
            fs.optim.skip_nonfinite(), fs.optim.clip_by_global_norm(0.05), fs.optim.adamw(lr=1e-2)
        )
        state = opt.init(sparams)
        step = fs.value_and_grad(MODEL.loss_fn, plan)
        for i in range(2):
            batch = MODEL.batch_for(i)
            _, grads = step(sparams, *batch)
            if i == 0:
                _, ref = reference_value_and_grad(MODEL.loss_fn, params, [batch])
                ref_norm = torch.stack([g.norm() for g in fs.tree.leaves(ref)]).norm()
            if materialize:
                _full(grads)
            assert fs.optim.all_finite(grads)
            sparams, state = opt.update_(grads, state, sparams)
            assert all((f.leaves is None) == materialize for f in flats_of(grads))
        norms.append(fs.optim.clip_by_global_norm(grads, 1e9)[1])
        results.append(_full(sparams))
    assert_trees_close(results[0], results[1], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(norms[0], norms[1], rtol=1e-6, atol=0)
    _, plan, sparams = _setup()
    _, grads = fs.value_and_grad(MODEL.loss_fn, plan)(sparams, *MODEL.batch_for(0))
    _, clipped_norm = fs.optim.clip_by_global_norm(grads, 1e9)
    torch.testing.assert_close(clipped_norm, ref_norm.to(clipped_norm.dtype), rtol=1e-5, atol=0)
    held = next(f.leaves for f in flats_of(grads) if f.leaves is not None)
    held[0].view(-1)[0] = float("inf")
    assert not fs.optim.all_finite(grads)


def test_a_gradient_given_for_two_leaves_is_held_once_per_leaf():
    """Clipping scales held leaves in place: one tensor for two leaves would be scaled twice."""
    from funcshard._src.shard.sharded import held_leaves

    _, _, sparams = _setup()
    layout = sparams["blocks"][0]["norm"]["bias"].flat.layout
    g = torch.ones(layout.slots[0].shape)
    same = [g if s.shape == g.shape else torch.zeros(s.shape) for s in layout.slots]
    held = held_leaves(layout, same, torch.device("cpu"))
    assert len({id(t) for t in held}) == len(held)
    assert held[0] is g  # the first use keeps autograd's tensor


def test_per_leaf_views_of_a_buffer_whose_leaves_are_split_are_refused():
    """whole_leaves is for one-rank groups: a shard of a two-rank plan holds parts of leaves."""
    plan = fs.plan(MODEL.init(0), fs.Mesh({"fsdp": 2}), units=MODEL.units)
    split = next(lt for lt in layouts(plan) if lt.unit == "blocks/0")
    with pytest.raises(ValueError, match="unit 'blocks/0': its leaves are not whole on this rank"):
        FlatShard(split, torch.zeros(split.numel), 0).whole_leaves()
