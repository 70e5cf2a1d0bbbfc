"""fs.interop.functionalize: any nn.Module as a params tree and a pure apply, sharded with no per-layer code.

The reference is the module itself: its own forward and autograd gradients in one
process, and for training the module trained with ``torch.optim`` on every rank's
batch. A failure names the leaf path that differs, or the error that was expected.
"""

from __future__ import annotations

import copy
import re
from collections import OrderedDict
from typing import Any, cast

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import funcshard as fs
from funcshard.interop import functionalize
from funcshard.testing import assert_trees_close

FP32_TOL: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-6}
VOCAB, WIDTH, HIDDEN, SEQ, BATCH = 11, 8, 16, 5, 3


class Block(nn.Module):
    """A pre-norm MLP block; ``gain`` is tied to the root module's ``gain`` (borrowed by the unit)."""

    def __init__(self, gain: nn.Parameter) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, WIDTH)
        self.gain = gain

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.gain * self.fc2(F.gelu(self.fc1(self.norm(h))))


class TinyLM(nn.Module):
    """Embedding tied to the head, blocks in a ModuleList, a frozen scale and two buffers."""

    pos: torch.Tensor

    def __init__(self, layers: int = 2, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.gain = nn.Parameter(torch.full((WIDTH,), 0.5))
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList([Block(self.gain) for _ in range(layers)])
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(WIDTH), requires_grad=False)
        self.register_buffer("pos", 0.1 * torch.randn(SEQ, WIDTH))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long), persistent=False)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied: one leaf, the sum of both gradients

    def block(self, i: int) -> Block:
        return cast(Block, self.blocks[i])

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        logits = self.head(h * self.scale)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
        torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen),
    )


# -- the tree -------------------------------------------------------------------------


def test_paths_follow_module_names_with_lists_for_module_lists():
    """Paths are named_parameters names with '/'; ModuleList is a list; ties are one leaf, buffers none."""
    model = TinyLM(layers=11)
    embed = model.embed.weight.data_ptr()  # the parameter object becomes its placeholder
    params, apply = functionalize(model)
    assert isinstance(params["blocks"], list)
    assert len(params["blocks"]) == 11
    paths = fs.tree.leaf_paths(params)
    assert paths[:5] == [
        "blocks/0/fc1/bias",
        "blocks/0/fc1/weight",
        "blocks/0/fc2/bias",
        "blocks/0/fc2/weight",
        "blocks/0/norm/bias",
    ]
    assert paths[6].startswith(
        "blocks/1/"
    )  # a list keeps 1 before 10 (dict keys would sort "10" first)
    assert paths[-3:] == ["embed/weight", "gain", "scale"]
    assert "head/weight" not in paths
    assert "blocks/0/gain" not in paths
    assert apply.frozen == ("scale",)  # a leaf, planned frozen: sharded, no gradient
    assert fs.tree.leaf_paths(apply.state) == ["calls", "pos"]
    assert params["embed"]["weight"].data_ptr() == embed  # a view, not a copy
    assert not params["embed"]["weight"].requires_grad


def test_entries_without_parameters_are_none_in_lists():
    """A Sequential keeps its indices: entries without leaves are None (an empty node)."""
    net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    params, _ = functionalize(net)
    assert isinstance(params, list)
    assert params[1] is None
    assert fs.tree.leaf_paths(params) == ["0/bias", "0/weight", "2/bias", "2/weight"]


def test_apply_equals_the_module_with_tied_gradients_summed():
    """Forward equals the module's; torch.func gradients equal autograd's, the tied leaf's included."""
    model = TinyLM()
    reference = copy.deepcopy(model)
    params, apply = functionalize(model, units=[Block])
    tokens, targets = batch(0)
    loss = reference(tokens, targets)
    loss.backward()
    grads, value = torch.func.grad_and_value(lambda p: apply(p, tokens, targets))(params)
    torch.testing.assert_close(value, loss.detach(), rtol=0, atol=0)
    expected = {
        "embed/weight": reference.embed.weight.grad,  # embedding and head uses, summed
        "gain": reference.gain.grad,  # root use plus both blocks (borrowed inside the units)
        "blocks/1/fc1/weight": reference.block(1).fc1.weight.grad,
    }
    by_path = dict(zip(fs.tree.leaf_paths(grads), fs.tree.leaves(grads)))
    for path, grad in expected.items():
        torch.testing.assert_close(by_path[path], grad, **FP32_TOL)
    assert reference.scale.grad is None


def test_state_dict_round_trips_into_the_module():
    """apply.state_dict(params) has the module's keys (tied and buffers too) and loads into it."""
    model = TinyLM()
    keys = sorted(model.state_dict())
    params, apply = functionalize(model)
    changed = fs.tree.map(lambda t: t + 1, params)
    state = apply.state_dict(changed)
    assert sorted(state) == keys
    fresh = TinyLM(seed=1)
    fresh.load_state_dict(state)
    tokens, targets = batch(1)
    torch.testing.assert_close(fresh(tokens, targets), apply(changed, tokens, targets))


# -- units ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "units",
    [[Block], ["Block"], ["blocks/*"], [re.compile(r"^blocks/\d+$")]],
    ids=["class", "class-name", "glob", "regex"],
)
def test_units_by_class_name_glob_or_regex(units):
    """Every way of naming the blocks gives the same unit subtrees and one plan pattern."""
    params, apply = functionalize(TinyLM(), units=units)
    assert apply.unit_paths == ("blocks/0", "blocks/1")
    assert apply.units == ("blocks/*",)
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=apply.units)
    assert [u.name for u in plan.units] == ["<root>", "blocks/0", "blocks/1"]


def test_some_entries_of_a_list_keep_exact_paths():
    params, apply = functionalize(TinyLM(layers=3), units=["blocks/1"])
    assert apply.units == ("blocks/1",)
    assert [u.name for u in fs.plan(params, fs.Mesh({"fsdp": 1}), units=apply.units).units] == [
        "<root>",
        "blocks/1",
    ]


def test_a_unit_class_the_module_lacks_is_an_error_naming_its_classes():
    with pytest.raises(
        ValueError, match=r"units\[0\] 'LlamaDecoderLayer' names no submodule of TinyLM"
    ) as e:
        functionalize(TinyLM(), units=["LlamaDecoderLayer"])
    assert "Classes here: Block, Embedding, LayerNorm, Linear, ModuleList, TinyLM" in str(e.value)
    with pytest.raises(ValueError, match=r"class Conv2d names no submodule"):
        functionalize(TinyLM(), units=[nn.Conv2d])


@pytest.mark.parametrize(
    ("units", "message"),
    [
        (["Block", "blocks/0/fc1"], r"units overlap: 'blocks/0/fc1' .* and 'blocks/0'"),
        ([TinyLM], r"matches the module itself"),
        (["ModuleList", "Block"], r"units overlap"),
        ("Block", r"units must be a list"),
        ([3], r"must be an nn.Module class, a class name"),
    ],
)
def test_malformed_units_are_errors(units, message):
    with pytest.raises((ValueError, TypeError), match=message):
        functionalize(TinyLM(), units=units)


def test_a_unit_without_trainable_parameters_is_an_error():
    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with pytest.raises(ValueError, match=r"'ReLU' matches only submodules without trainable"):
        functionalize(net, units=["ReLU"])


def test_a_tied_parameter_used_outside_its_unit_is_an_error():
    """A unit's leaf is full only inside its forward: a tie to another unit or to the root is refused."""
    model = TinyLM()
    model.block(1).fc1.weight = model.block(0).fc1.weight
    with pytest.raises(
        ValueError,
        match=r"tied parameter 'blocks.0.fc1.weight' \(a leaf of unit 'blocks/0'\) is also used as "
        r"'blocks.1.fc1.weight', unit 'blocks/1'",
    ):
        functionalize(model, units=[Block])
    with pytest.raises(ValueError, match=r"'blocks.1.fc1.weight', outside every unit"):
        functionalize(model, units=["blocks/0"])
    # the leaf in the root unit: the unit of blocks/1 borrows it, as it borrows `gain`
    expected = model(*batch(0))
    params, apply = functionalize(model, units=["blocks/1"])
    assert "blocks/1/fc1/weight" not in fs.tree.leaf_paths(params)
    torch.testing.assert_close(apply(params, *batch(0)), expected)


# -- shared memory -------------------------------------------------------------------------


class Views(nn.Module):
    def __init__(self, a: slice, b: slice) -> None:
        super().__init__()
        base = torch.arange(12.0)
        self.a = nn.Parameter(base[a])
        self.b = nn.Parameter(base[b])


def test_overlapping_views_of_one_storage_are_an_error():
    """Two different tensors sharing part of their memory cannot be independent leaves."""
    with pytest.raises(
        ValueError,
        match=r"trainable 'a' and trainable 'b' are different tensors that share memory \(bytes \[0, 24\) and \[12, 36\)",
    ):
        functionalize(Views(slice(0, 6), slice(3, 9)))


def test_identical_views_are_one_leaf_and_disjoint_views_two():
    params, _ = functionalize(Views(slice(0, 6), slice(0, 6)))
    assert fs.tree.leaf_paths(params) == ["a"]
    params, _ = functionalize(Views(slice(0, 6), slice(6, 12)))  # a fused weight split in two
    assert fs.tree.leaf_paths(params) == ["a", "b"]


# -- apply's errors ---------------------------------------------------------------------


def test_apply_refuses_another_structure_and_sharded_leaves_outside_a_step():
    params, apply = functionalize(TinyLM(), units=[Block])
    with pytest.raises(
        ValueError, match=r"params do not have the structure functionalize returned"
    ):
        apply({"embed": params["embed"]}, *batch(0))
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=apply.units)
    with pytest.raises(ValueError, match=r"gain: apply got a sharded leaf outside a step"):
        apply(fs.shard(params, plan), *batch(0))
    with pytest.raises(ValueError, match=r"gain: state_dict got a sharded leaf outside a step"):
        apply.state_dict(fs.shard(params, plan))


@pytest.mark.parametrize(
    ("plan_units", "message"),
    [
        ([], r"in the root unit, but functionalize made it part of unit 'blocks/0'"),
        (["blocks"], r"in unit 'blocks', but functionalize made it part of unit 'blocks/0'"),
    ],
)
def test_a_plan_with_other_units_is_an_error_naming_apply_units(plan_units, message):
    params, apply = functionalize(TinyLM(), units=[Block])
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=plan_units, frozen=apply.frozen)
    step = fs.value_and_grad(lambda p, *b: apply(p, *b), plan)
    with pytest.raises(ValueError, match=message + r".*units=apply.units"):
        step(fs.shard(params, plan), *batch(0))


@pytest.mark.parametrize("units", [[], ["blocks/*"]])
def test_a_plan_that_trains_a_frozen_parameter_is_an_error_naming_apply_frozen(units):
    """requires_grad=False is never silently trained: the plan must freeze what the module froze."""
    model = TinyLM()
    model.get_parameter("blocks.0.fc1.weight").requires_grad_(False)  # in a unit, not the root
    params, apply = functionalize(model, units=[Block])
    plan = fs.plan(
        params, fs.Mesh({"fsdp": 1}), units=apply.units, frozen=["scale"] if units else []
    )
    step = fs.value_and_grad(lambda p, *b: apply(p, *b), plan)
    leaf = "blocks/0/fc1/weight" if units else "scale"
    with pytest.raises(
        ValueError, match=rf"{leaf}: the plan makes this leaf trainable.*frozen=apply.frozen"
    ):
        step(fs.shard(params, plan), *batch(0))
    wrong = fs.plan(params, fs.Mesh({"fsdp": 1}), units=apply.units, frozen=[*apply.frozen, "gain"])
    step = fs.value_and_grad(lambda p, *b: apply(p, *b), wrong)
    with pytest.raises(ValueError, match=r"gain: the plan makes this leaf frozen"):
        step(fs.shard(params, wrong), *batch(0))


class Out(OrderedDict):
    """An output container funcshard's tree does not flatten (like a Hugging Face ModelOutput)."""


class Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> Out:
        return Out(h=torch.tanh(self.fc(h)))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.layers = nn.ModuleList([Wrapped(), Wrapped()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)["h"]
        return x.square().mean()


def _stack_grads() -> Any:
    model = Stack()
    params, apply = functionalize(model, units=[Wrapped])
    plan = fs.plan(params, fs.Mesh({"fsdp": fs.world_size()}), units=apply.units)
    step = fs.value_and_grad(lambda p, x: apply(p, x), plan)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(fs.rank()))
    _, grads = step(fs.shard(params, plan), x)
    return fs.unshard(grads)


def test_unit_outputs_in_unknown_containers_are_regathered_for_backward(pools):
    """A unit returning an OrderedDict subclass: its tensors still re-gather the unit before backward."""
    results = pools.run(2, _stack_grads)
    model = Stack()
    xs = [torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    torch.stack([model(x) for x in xs]).mean().backward()
    expected = {name.replace(".", "/"): p.grad for name, p in model.named_parameters()}
    by_path = dict(zip(fs.tree.leaf_paths(results[0]), fs.tree.leaves(results[0])))
    assert by_path.keys() == expected.keys()
    for path, grad in expected.items():
        torch.testing.assert_close(by_path[path], grad, **FP32_TOL, msg=path)


# -- sharded training equals the module trained in one process ------------------------------


def _optimizers(kind: str, model: nn.Module) -> tuple[fs.optim.Optimizer, torch.optim.Optimizer]:
    trainable = [p for p in model.parameters() if p.requires_grad]
    if kind == "adamw":
        return fs.optim.adamw(lr=0.01, weight_decay=0.1), torch.optim.AdamW(
            trainable, lr=0.01, weight_decay=0.1
        )
    return fs.optim.sgd(lr=0.1, momentum=0.9), torch.optim.SGD(trainable, lr=0.1, momentum=0.9)


def _train_sharded(strategy: Any, optimizer: str, steps: int) -> tuple[list[torch.Tensor], Any]:
    model = TinyLM()
    params, apply = functionalize(model, units=[Block])
    plan = fs.plan(
        params,
        fs.Mesh({"fsdp": fs.world_size()}),
        units=apply.units,
        frozen=apply.frozen,
        strategy=strategy,
    )
    sparams = fs.shard(params, plan)
    opt, _ = _optimizers(optimizer, model)
    state = opt.init(sparams)
    step = fs.value_and_grad(lambda p, tokens, targets: apply(p, tokens, targets), plan)
    losses = []
    for t in range(steps):
        loss, grads = step(sparams, *batch(100 * t + fs.rank()))
        sparams, state = opt.update_(grads, state, sparams)
        losses.append(loss)
    return losses, fs.unshard(sparams)


@pytest.mark.parametrize(
    ("strategy", "optimizer"), [("full_shard", "adamw"), ("shard_grad_op", "sgd")]
)
def test_sharded_training_equals_the_module_trained_in_one_process(pools, strategy, optimizer):
    """W=2, units = the blocks: losses and final params equal torch.optim on the module itself."""
    steps, world = 3, 2
    results = pools.run(world, _train_sharded, strategy, optimizer, steps)
    model = TinyLM()
    _, ref_opt = _optimizers(optimizer, model)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker rank
    try:
        for t in range(steps):
            loss = torch.stack([model(*batch(100 * t + r)) for r in range(world)]).mean()
            ref_opt.zero_grad()
            loss.backward()
            ref_opt.step()
            mean = torch.stack([losses[t] for losses, _ in results]).mean()
            torch.testing.assert_close(mean, loss.detach(), **FP32_TOL)
    finally:
        torch.set_num_threads(threads)
    assert model.scale.grad is None  # frozen: read before its Parameter becomes a placeholder
    reference, _ = functionalize(model)
    for _, final in results:
        assert_trees_close(final, reference, **FP32_TOL)


class _Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.lin(x))


@pytest.mark.parametrize(("remat", "runs"), [(False, 1), (True, 2)])
def test_remat_runs_each_unit_forward_again_in_backward(remat, runs):
    net = nn.Sequential(_Counting(), _Counting())
    params, apply = functionalize(net, units=[_Counting], remat=remat)
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=apply.units)
    step = fs.value_and_grad(lambda p, x: apply(p, x).sum(), plan)
    _, grads = step(fs.shard(params, plan), torch.ones(2, 3))
    assert [m.calls for m in net] == [runs, runs]
    expected = torch.func.grad(lambda p: apply(p, torch.ones(2, 3)).sum())(params)
    assert_trees_close(fs.unshard(grads), expected)
