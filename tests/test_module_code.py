"""A functionalized module's parameters outside apply's calls: placeholders, bindings, re-entry.

See [Note: module code outside the call] in funcshard/_src/interop/binding.py. The
training equalities are in tests/test_conformance.py; here, every way to reach a
stale value is refused at its first use with an error naming the parameter, its
unit and the fix, and the bindings leave nothing behind. A failure names the
construct.
"""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as checkpoint_utils
from torch import nn

import funcshard as fs
from funcshard._src.interop.placeholders import Placeholder
from funcshard.interop import StateDictHookError, UnboundParameterError, functionalize


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(h))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return h


def _functionalized() -> tuple[Net, Any, Any]:
    net = Net()
    params, apply = functionalize(net, units=[Block])
    return net, params, apply


@pytest.mark.parametrize(
    ("use", "op"),
    [
        (lambda net: net(torch.ones(2, 4)), "aten.t"),
        (lambda net: net.state_dict(), "aten.detach"),
        (lambda net: net.double(), "aten._to_copy"),
        (lambda net: copy.deepcopy(net), "aten"),
        (lambda net: net.blocks[1].fc.weight.sum(), "aten.sum"),
    ],
    ids=["call", "state_dict", "to", "deepcopy", "read"],
)
def test_the_module_outside_apply_raises_naming_the_parameter_and_the_fix(use: Any, op: str):
    net, _, _ = _functionalized()
    with pytest.raises(UnboundParameterError) as e:
        use(net)
    message = str(e.value)
    assert re.search(r"Net's parameter '[\w.]+' \((unit 'blocks/\d'|the root unit)\)", message)
    assert f"by {op}" in message
    if op == "aten.detach":  # torch's state_dict: the message says so and names the fix
        assert re.search(
            r"was read by Linear\.state_dict\(\) of module 'inp', outside apply", message
        )
        assert "Fix: apply.state_dict(fs.unshard(sparams))" in message
        return
    assert "was read outside apply" in message
    assert "Fix: run the module through apply(params, ...)" in message


def test_metadata_of_the_placeholders_still_reads():
    """shape, dtype, device and requires_grad, as HF's model.dtype / model.device read them."""
    net, params, _ = _functionalized()
    weight = net.get_submodule("blocks.0.fc").weight
    assert isinstance(weight, nn.Parameter)
    assert weight.shape == params["blocks"][0]["fc"]["weight"].shape
    assert (weight.dtype, weight.device.type, weight.requires_grad) == (torch.float32, "cpu", True)
    assert "Placeholder('blocks.0.fc.weight'" in repr(weight)


def test_bound_runs_the_module_on_the_leaves_and_leaves_placeholders_after():
    net, params, apply = _functionalized()
    x = torch.ones(2, 4)
    with apply.bound(params) as module:
        assert module is net
        out = net(x)
    torch.testing.assert_close(out, apply(params, x))
    with pytest.raises(UnboundParameterError):
        net(x)
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=apply.units)
    bound = apply.bound(fs.shard(params, plan))
    with pytest.raises(ValueError, match="sharded leaf"):
        bound.__enter__()


def test_bound_serves_state_dict_get_parameter_save_dcp_and_save_pretrained(tmp_path: Any):
    """Inside apply.bound every call the docs suggest works on a plain two-layer Sequential.

    Reference: the module's own state dict before functionalize; torch's ``get_parameter``
    (which checks ``isinstance(p, nn.Parameter)``) and ``dcp.load`` of what save_dcp wrote.
    """
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    expected = {k: v.clone() for k, v in net.state_dict().items()}
    params, apply = functionalize(net, units=[nn.Linear])
    sparams = fs.shard(params, fs.plan(params, fs.Mesh({"fsdp": 1}), units=apply.units))
    x = torch.ones(2, 3)
    with apply.bound(params) as module:
        weight = module.get_parameter("0.weight")
        assert isinstance(weight, nn.Parameter)
        assert torch.equal(weight, expected["0.weight"])
        from_apply = apply.state_dict(params)
        from_module = module.state_dict()
        dcp_dir = fs.checkpoint.save_dcp(tmp_path / "dcp", params, apply=apply)
        hf_dir = apply.save_pretrained(sparams, tmp_path / "hf")
    trainable = fs.tree.map(lambda t: t.detach().requires_grad_(), params)
    with apply.bound(trainable) as module:  # gradients reach the leaf through the bound view
        (grad,) = torch.autograd.grad(module(x).sum(), [trainable[0]["weight"]])
    assert grad.shape == (4, 3)
    assert bool(grad.abs().sum() > 0)
    for got in (from_apply, from_module, load_file(Path(hf_dir) / "model.safetensors")):
        assert sorted(got) == sorted(expected)
        assert all(torch.equal(got[k], v) for k, v in expected.items())
    back = {k: torch.zeros_like(v) for k, v in expected.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(back, checkpoint_id=dcp_dir)
    assert all(torch.equal(back[k], v) for k, v in expected.items())
    assert isinstance(net.get_submodule("0")._parameters["weight"], Placeholder)


def test_a_state_dict_hook_that_raises_is_named_with_a_fix():
    """A hook's error names the module path, the hook and a fix, not torch's internals."""

    def needs_values(module: Any, state_dict: Any, prefix: str, local_metadata: Any) -> None:
        state_dict[prefix + "scale"] = state_dict[prefix + "weight"].abs().max().item() * 1

    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    net[1].register_state_dict_post_hook(needs_values)
    params, apply = functionalize(net)
    with pytest.raises(StateDictHookError) as e:
        apply.state_layout()
    message = str(e.value)
    assert message.startswith("1: the state-dict hook ")
    assert "needs_values raised" in message
    assert "Fix: make the hook work on shapes alone" in message
    with apply.bound(params) as module:  # on live values the same hook runs
        assert "1.scale" in module.state_dict()


def test_a_module_functionalized_twice_is_an_error_naming_the_fix():
    net, _, _ = _functionalized()
    with pytest.raises(ValueError, match=r"functionalized already .*copy.deepcopy\(model\) first"):
        functionalize(net)


class _Rerun(torch.autograd.Function):
    """A recompute funcshard does not know: reruns the module in backward (as old Megatron did)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, module: nn.Module) -> torch.Tensor:
        ctx.module = module
        ctx.save_for_backward(x)
        with torch.no_grad():
            return module(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            out = ctx.module(x)
        (dx,) = torch.autograd.grad(out, x, grad)
        return dx, None


class CustomRecompute(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = _Rerun.apply(h, block)
        return h


def test_a_recompute_that_is_not_torch_checkpoint_is_refused_in_backward():
    params, apply = functionalize(CustomRecompute(), units=[Block])
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=apply.units)
    step = fs.value_and_grad(lambda p, x: apply(p, x).square().mean(), plan)
    with pytest.raises(UnboundParameterError, match=r"was read in backward, after apply returned"):
        step(fs.shard(params, plan), torch.ones(2, 4))


def test_torch_checkpoint_is_restored_after_apply_and_after_an_error():
    names = ("_checkpoint_without_reentrant_generator", "CheckpointFunction")
    before = [getattr(checkpoint_utils, n) for n in names]
    _, params, apply = _functionalized()
    apply(params, torch.ones(2, 4))
    with pytest.raises(ValueError, match="structure"):
        apply({"not": "these params"}, torch.ones(2, 4))

    class Failing(Block):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("inside the unit")

    net = Net()
    net.blocks[0] = Failing()
    params, apply = functionalize(net, units=[Block])
    with pytest.raises(RuntimeError, match="inside the unit"):
        apply(params, torch.ones(2, 4))
    assert [getattr(checkpoint_utils, n) for n in names] == before
    assert "_compiled_call_impl" not in vars(net.blocks[1])


class Reentrant(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).detach()  # nothing that requires grad enters the checkpoint
        for block in self.blocks:
            h = checkpoint_utils.checkpoint(block, h, use_reentrant=True)
        return h + self.inp(x)


def test_a_reentrant_checkpoint_keeps_its_semantics_without_inputs_that_need_grad():
    """As torch's reentrant kind: the warning, and no gradient for the parameters inside."""
    model = Reentrant()
    reference = copy.deepcopy(model)
    params, apply = functionalize(model, units=[Block])
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=apply.units)
    step = fs.value_and_grad(lambda p, x: apply(p, x).square().mean(), plan)
    x = torch.ones(2, 4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _, grads = step(fs.shard(params, plan), x)
        reference(x).square().mean().backward()
    assert sum("None of the inputs have requires_grad=True" in str(w.message) for w in seen) == 4
    full = fs.unshard(grads)
    assert torch.count_nonzero(full["blocks"][0]["fc"]["weight"]) == 0
    assert reference.get_submodule("blocks.0.fc").weight.grad is None
    torch.testing.assert_close(full["inp"]["weight"], reference.inp.weight.grad)


def test_broadcast_state_outside_a_distributed_run_does_nothing_and_checks_src():
    bn = nn.BatchNorm1d(2)
    _, apply = functionalize(bn)
    apply.broadcast_state()
    assert torch.equal(apply.state["running_mean"], torch.zeros(2))


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


class Attentive(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Attention(), Attention()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_multihead_attentions_fast_path_runs_in_an_evaluation(monkeypatch: pytest.MonkeyPatch):
    """fs.forward in eval mode takes nn.MultiheadAttention's fused path, equal to the module's."""
    model = Attentive().eval()
    reference = copy.deepcopy(model)
    calls: list[int] = []
    fused = torch._native_multi_head_attention

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return fused(*args, **kwargs)

    monkeypatch.setattr(torch, "_native_multi_head_attention", counting)
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(x)
    assert len(calls) == 2  # the reference took the fast path
    params, apply = functionalize(model, units=[Attention])
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=apply.units)
    out = fs.forward(lambda p, x: apply(p, x), plan)(fs.shard(params, plan), x)
    assert len(calls) == 4
    torch.testing.assert_close(out, expected)


def test_references_kept_outside_the_module_read_the_placeholder():
    """A list, a partial and an optimizer made before functionalize hold the placeholder now."""
    import functools

    net = nn.Linear(3, 2)
    kept, linear = [net.weight], functools.partial(nn.functional.linear, weight=net.weight)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, weight_decay=0.1)
    before = net.weight.detach().clone()
    params, _ = functionalize(net)
    assert torch.equal(params["weight"], before)  # the leaf keeps the values
    with pytest.raises(UnboundParameterError, match="read outside apply"):
        _ = kept[0] + 1
    with pytest.raises(UnboundParameterError, match=r"Linear's parameter 'weight'"):
        linear(torch.ones(3))
    assert opt.param_groups[0]["params"][0] is net.weight  # the optimizer's is the placeholder


def test_a_hook_on_a_placeholder_is_refused_naming_the_parameter():
    net = nn.Linear(3, 2)
    functionalize(net)
    with pytest.raises(UnboundParameterError, match=r"'weight' .* got a hook \(register_hook\)"):
        net.weight.register_hook(lambda g: g)
    with pytest.raises(UnboundParameterError, match="register_post_accumulate_grad_hook"):
        net.bias.register_post_accumulate_grad_hook(lambda p: None)


@pytest.mark.parametrize(
    ("build", "said"),
    [
        (
            lambda: nn.Embedding(4, 2, sparse=True),
            r"submodule '<the module>' \(Embedding\) has sparse=True",
        ),
        (lambda: nn.EmbeddingBag(4, 2, sparse=True), r"\(EmbeddingBag\) has sparse=True"),
    ],
)
def test_what_functionalize_cannot_own_is_refused_before_any_step(build: Any, said: str):
    with pytest.raises(ValueError, match=said):
        functionalize(build())


def test_a_parameter_written_in_forward_is_refused_in_a_one_rank_step():
    """Also where the write would persist (one rank): the same program refuses at every W."""

    class Clips(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                self.lin.weight.clamp_(-0.1, 0.1)
            return self.lin(x)

    params, apply = functionalize(nn.Sequential(Clips()), units=[Clips])
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=apply.units)
    step = fs.value_and_grad(lambda p, x: apply(p, x).sum(), plan)
    with pytest.raises(fs.ParameterWriteError, match=r"0/lin/bias, 0/lin/weight: they share"):
        step(fs.shard(params, plan), torch.ones(2))


def test_a_module_changed_after_functionalize_is_refused_at_the_next_apply():
    """A replaced submodule or parameter, an added one, or requires_grad flipped: named, never run."""
    changes: dict[str, Any] = {
        "submodule '0' was replaced": lambda net: net.__setitem__(0, nn.Linear(2, 2)),
        "parameter '1.weight' was replaced": lambda net: setattr(
            net[1], "weight", nn.Parameter(torch.ones(1, 2))
        ),
        "a parameter was added to '1'": lambda net: net[1].register_parameter(
            "extra", nn.Parameter(torch.ones(1))
        ),
        "'0.weight' had requires_grad set to False": lambda net: net[0].requires_grad_(False),
    }
    for said, change in changes.items():
        net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        params, apply = functionalize(net, units=[nn.Linear])
        change(net)
        with pytest.raises(UnboundParameterError, match=re.escape(said)):
            apply(params, torch.ones(2))


def test_a_module_registered_at_two_paths_is_bound_once_and_keeps_its_placeholders():
    """T5's shape: one module object under two names trains as one, and holds placeholders after."""
    shared = nn.Linear(2, 2)
    net = nn.Sequential(shared, nn.Sequential(shared, nn.Tanh()), nn.Linear(2, 1))
    reference = copy.deepcopy(net)
    params, apply = functionalize(net)
    assert torch.equal(apply(params, torch.ones(2)), reference(torch.ones(2)))
    with pytest.raises(UnboundParameterError):
        _ = shared.weight + 1  # the object under both names
    assert set(apply.state_dict(params)) == set(reference.state_dict())


def test_gradients_are_read_from_the_grads_tree_not_the_module():
    net = nn.Linear(2, 2)
    functionalize(net)
    with pytest.raises(UnboundParameterError, match=r"clip_by_global_norm"):
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)


def test_a_complex_parameter_is_refused_naming_the_fix():
    net = nn.Linear(2, 2)
    net.weight = nn.Parameter(torch.ones(2, 2, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"'weight' is complex .*view_as_real"):
        functionalize(net)
    with pytest.raises(ValueError, match=r"w: a complex leaf"):
        fs.plan({"w": torch.ones(2, dtype=torch.complex64, requires_grad=True)}, fs.Mesh({"x": 1}))


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_a_module_compiled_as_a_whole_is_refused_naming_the_fix():
    net = nn.Linear(2, 2)
    net.compile()
    with pytest.raises(ValueError, match=r"compiled as a whole .* compile its units"):
        functionalize(net)
