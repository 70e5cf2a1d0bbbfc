"""``apply.materialize``: a meta-device module initialized by its own code, one submodule at a time.

The values depend only on the seed and each submodule's name: the same at W=1
and W=2, for every strategy and unit grouping; the buffers (rotary
frequencies) equal those of the module built on the CPU; a tensor the module's
initialization does not set is an error naming it; the caller's RNG is
untouched; and no tensor larger than one submodule's is ever created.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import funcshard as fs
from funcshard.interop import functionalize
from tests.interop.hf_configs import tiny_llama_config
from tests.largest import Largest

transformers = pytest.importorskip("transformers", reason="Hugging Face is the `hf` extra")

pytestmark = pytest.mark.interop


def llama_config(tie: bool = True) -> Any:
    return tiny_llama_config(layers=3, positions=16, tied=tie)


def _meta_llama() -> Any:
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(llama_config())


def _materialized(
    units: list[str], strategy: Any, seed: int, layout: Any = "leaf"
) -> tuple[Any, Any]:
    """Worker body: materialize a meta Llama on this world; the whole tree and the buffers."""
    params, apply = functionalize(_meta_llama(), units=units)
    plan = fs.plan(
        params,
        fs.Mesh({"fsdp": fs.world_size()}),
        units=apply.units,
        strategy=strategy,
        layout=layout,
    )
    sparams = apply.materialize(plan, seed=seed)
    return fs.unshard(sparams), apply.state


def _equal_trees(a: Any, b: Any) -> None:
    assert fs.tree.leaf_paths(a) == fs.tree.leaf_paths(b)
    for path, x, y in zip(fs.tree.leaf_paths(a), fs.tree.leaves(a), fs.tree.leaves(b)):
        assert x.dtype == y.dtype, path
        assert torch.equal(x, y), path


def test_values_do_not_depend_on_world_size_strategy_or_units(pools):
    (reference, state), *_ = pools.run(1, _materialized, ["LlamaDecoderLayer"], "full_shard", 3)
    for world, units, strategy, layout in [
        (2, ["LlamaDecoderLayer"], "full_shard", "leaf"),
        (2, [], "shard_grad_op", "leaf"),
        (2, ["LlamaDecoderLayer"], "no_shard", "leaf"),
        (2, ["LlamaDecoderLayer"], "full_shard", "flat"),
    ]:
        for tree, buffers in pools.run(world, _materialized, units, strategy, 3, layout):
            _equal_trees(tree, reference)
            _equal_trees(buffers, state)
    other, _ = pools.run(1, _materialized, [], "full_shard", 4)[0]
    assert not torch.equal(  # another seed, other values
        other["model"]["layers"][0]["mlp"]["up_proj"]["weight"],
        reference["model"]["layers"][0]["mlp"]["up_proj"]["weight"],
    )


def test_the_module_initializes_as_its_own_code_says():
    """Norms are ones, linears N(0, initializer_range), buffers equal a CPU-built model's."""
    params, apply = functionalize(_meta_llama(), units=["LlamaDecoderLayer"])
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=apply.units)
    torch.manual_seed(1234)  # on a machine without a GPU, its seed waits for CUDA to start
    before, queued = torch.get_rng_state(), torch.cuda._lazy_seed_tracker.get_calls()
    full = fs.unshard(apply.materialize(plan, seed=0))
    assert torch.equal(torch.get_rng_state(), before)  # the caller's RNG is untouched
    assert torch.cuda._lazy_seed_tracker.get_calls() == queued  # and its GPUs' seed
    assert torch.equal(full["model"]["norm"]["weight"], torch.ones(32))
    weights = full["model"]["layers"][1]["mlp"]["down_proj"]["weight"]
    assert abs(float(weights.std()) - 0.02) < 0.003
    assert abs(float(weights.mean())) < 0.003
    real = transformers.LlamaForCausalLM(llama_config())
    torch.testing.assert_close(
        apply.state["model"]["rotary_emb"]["inv_freq"],
        real.model.rotary_emb.inv_freq,
        rtol=0,
        atol=0,
    )
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    loss = apply(full, input_ids=ids, labels=ids).loss
    assert abs(float(loss) - float(torch.log(torch.tensor(64.0)))) < 0.2  # near-uniform logits


class _Gain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gain = nn.Parameter(torch.full((4,), 0.5))  # set in __init__ only


def test_a_tensor_the_module_does_not_initialize_is_an_error_naming_it():
    with torch.device("meta"):
        module = _Gain()
    params, apply = functionalize(module)
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}))
    with pytest.raises(ValueError, match=r"gain: the module's initialization did not set"):
        apply.materialize(plan)


def test_tensors_with_values_keep_them():
    module = _Gain()  # real: nothing is meta, the values are kept
    expected = {"gain": module.gain.detach().clone(), "lin": module.lin.weight.detach().clone()}
    params, apply = functionalize(module)
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}))
    full = fs.unshard(apply.materialize(plan))
    assert torch.equal(full["gain"], expected["gain"])
    assert torch.equal(full["lin"]["weight"], expected["lin"])


def test_values_dropped_with_the_params_are_an_error_naming_the_tensor():
    """A real module's values live in the params functionalize returned; without them nothing is kept."""
    _params, apply = functionalize(_Gain())
    plan = fs.plan(_params, fs.Mesh({"fsdp": 1}))
    del _params
    with pytest.raises(ValueError, match=r"gain: this parameter had a value .* no longer hold it"):
        apply.materialize(plan)


def test_a_plan_of_other_params_is_an_error():
    _params, apply = functionalize(_meta_llama(), units=["LlamaDecoderLayer"])
    other, _ = functionalize(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"the plan is not for this module's params"):
        apply.materialize(fs.plan(other, fs.Mesh({"fsdp": 1})))


def test_no_tensor_larger_than_one_submodule_is_created():
    """At W=1 the shards are the whole model: the largest tensor is still one leaf (the embedding)."""
    params, apply = functionalize(_meta_llama(), units=["LlamaDecoderLayer"])
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=apply.units)
    with Largest() as seen:
        apply.materialize(plan)
    leaves = fs.tree.leaves(params)
    largest_leaf = max(t.numel() * t.element_size() for t in leaves)
    largest_buffer = max(layout_bytes(plan))  # the flat buffers this rank keeps
    assert seen.largest <= max(largest_leaf, largest_buffer)
    assert seen.largest < sum(t.numel() * t.element_size() for t in leaves) / 2


def layout_bytes(plan: fs.Plan) -> list[int]:
    from funcshard._src.shard.shard import plan_layouts

    return [layout.nbytes for layout in plan_layouts(plan)]
