"""A Hugging Face LlamaForCausalLM, functionalized and trained sharded, equals the model trained in one process.

The model is built from a tiny ``LlamaConfig`` (nothing is downloaded), with tied
embeddings and one frozen norm inside a decoder layer. The reference trains the
``nn.Module`` itself with ``torch.optim`` on every rank's batch; a failure names the
step whose mean loss differs or the first parameter path that differs.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import funcshard as fs
from funcshard.interop import functionalize
from funcshard.testing import assert_trees_close
from tests.interop.hf_configs import tiny_llama_config

transformers = pytest.importorskip("transformers", reason="Hugging Face is the `hf` extra")

pytestmark = pytest.mark.interop

FP32_TOL: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-6}
VOCAB, SEQ, BATCH, STEPS, WORLD = 64, 8, 2, 3, 2


def llama(seed: int = 0, *, frozen: bool = True) -> Any:
    """A 2-layer LlamaForCausalLM of hidden size 32, weights drawn from ``seed``."""
    config = tiny_llama_config(vocab=VOCAB, positions=SEQ)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    if frozen:
        model.model.layers[0].post_attention_layernorm.weight.requires_grad_(False)
    return model


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def test_paths_units_and_state_of_a_llama():
    params, apply = functionalize(llama(), units=["LlamaDecoderLayer"])
    paths = fs.tree.leaf_paths(params)
    assert "model/layers/1/self_attn/q_proj/weight" in paths
    assert isinstance(params["model"]["layers"], list)
    assert "lm_head/weight" not in paths  # tied to model/embed_tokens/weight: one leaf
    assert apply.frozen == ("model/layers/0/post_attention_layernorm/weight",)
    assert apply.units == ("model/layers/*",)
    assert fs.tree.leaf_paths(apply.state) == [
        "model/rotary_emb/inv_freq",
        "model/rotary_emb/original_inv_freq",
    ]


def test_bound_serves_state_dict_save_dcp_and_save_pretrained_of_a_llama(tmp_path):
    """Inside apply.bound: the module's and apply's state dict, save_dcp and save_pretrained.

    Reference: the model's own state dict before functionalize, and what ``dcp.load`` and
    Hugging Face's ``from_pretrained`` read back.
    """
    import warnings

    import torch.distributed.checkpoint as dcp

    model = llama()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    params, apply = functionalize(model, units=["LlamaDecoderLayer"])
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=apply.units, frozen=apply.frozen)
    with apply.bound(params) as module:
        assert torch.equal(module.get_parameter("lm_head.weight"), expected["lm_head.weight"])
        from_module = module.state_dict()
        from_apply = apply.state_dict(params)
        dcp_dir = fs.checkpoint.save_dcp(tmp_path / "dcp", params, apply=apply)
        hf_dir = apply.save_pretrained(fs.shard(params, plan), tmp_path / "hf")
    for got in (from_module, from_apply):
        assert sorted(got) == sorted(expected)
        assert all(torch.equal(got[k], v) for k, v in expected.items())
    back = {k: torch.zeros_like(v) for k, v in expected.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(back, checkpoint_id=dcp_dir)
    assert all(torch.equal(back[k], v) for k, v in expected.items())
    loaded = transformers.LlamaForCausalLM.from_pretrained(hf_dir).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())


def test_a_unit_class_a_llama_lacks_is_an_error_listing_its_classes():
    with pytest.raises(
        ValueError, match=r"'GPT2Block' names no submodule of LlamaForCausalLM"
    ) as e:
        functionalize(llama(), units=["GPT2Block"])
    assert "LlamaDecoderLayer" in str(e.value)


def test_a_hub_kernel_attention_is_refused_whatever_is_installed():
    """A Hub kernel is code transformers downloads and runs; set as transformers sets it once
    the kernel loaded (the config's field), so the test needs neither the kernel nor the network."""
    model = llama()
    model.config._attn_implementation_internal = "kernels-community/flash-attn"
    with pytest.raises(
        ValueError,
        match=r"LlamaForCausalLM's config has attn_implementation 'kernels-community/flash-attn', "
        r"a kernel from the Hugging Face Hub: .* whether or not the kernels package is installed\. "
        r"Fix: build the model with attn_implementation=\"sdpa\" \(or \"eager\"\)",
    ):
        functionalize(model, units=["LlamaDecoderLayer"])
    inner = llama()
    inner.model.config = copy.copy(inner.config)
    inner.model.config._experts_implementation_internal = "someone/moe-kernel"
    with pytest.raises(
        ValueError,
        match=r"LlamaForCausalLM's config \(of its submodule 'model', LlamaModel\) has "
        r"experts_implementation 'someone/moe-kernel'",
    ):
        functionalize(inner)


def test_apply_equals_the_model_and_its_gradients():
    """The model's own loss (labels=...) and autograd gradients, through apply and torch.func."""
    model = llama()
    reference = copy.deepcopy(model)
    params, apply = functionalize(model, units=["LlamaDecoderLayer"])
    ids = tokens(0)
    out = reference(input_ids=ids, labels=ids)
    out.loss.backward()
    grads, loss = torch.func.grad_and_value(lambda p: apply(p, input_ids=ids, labels=ids).loss)(
        params
    )
    torch.testing.assert_close(loss, out.loss.detach(), **FP32_TOL)
    by_name = {n.replace(".", "/"): p.grad for n, p in reference.named_parameters()}
    for path, grad in zip(fs.tree.leaf_paths(grads), fs.tree.leaves(grads)):
        if path not in apply.frozen:  # autograd leaves a frozen parameter's .grad None
            torch.testing.assert_close(grad, by_name[path], **FP32_TOL, msg=path)


def _train_sharded(strategy: Any, remat: bool) -> tuple[list[torch.Tensor], Any]:
    params, apply = functionalize(llama(), units=["LlamaDecoderLayer"], remat=remat)
    plan = fs.plan(
        params,
        fs.Mesh({"fsdp": fs.world_size()}),
        units=apply.units,
        frozen=apply.frozen,
        strategy=strategy,
    )
    sparams = fs.shard(params, plan)
    opt = fs.optim.adamw(lr=1e-2, weight_decay=0.1)
    state = opt.init(sparams)

    def loss_fn(p: Any, ids: torch.Tensor) -> torch.Tensor:
        return apply(p, input_ids=ids, labels=ids).loss

    step = fs.value_and_grad(loss_fn, plan)
    losses = []
    for t in range(STEPS):
        loss, grads = step(sparams, tokens(100 * t + fs.rank()))
        sparams, state = opt.update_(grads, state, sparams)
        losses.append(loss)
    return losses, fs.unshard(sparams)


@pytest.mark.parametrize(
    ("strategy", "remat"), [("full_shard", False), ("shard_grad_op", False), ("full_shard", True)]
)
def test_sharded_llama_trains_like_the_model_in_one_process(pools, strategy, remat):
    """W=2, one unit per decoder layer: per-step mean loss and final params equal torch.optim.AdamW."""
    results = pools.run(WORLD, _train_sharded, strategy, remat)
    model = llama()
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1
    )
    frozen = model.model.layers[0].post_attention_layernorm.weight.detach().clone()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker rank
    try:
        for t in range(STEPS):
            batches = [tokens(100 * t + r) for r in range(WORLD)]
            loss = torch.stack([model(input_ids=b, labels=b).loss for b in batches]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            mean = torch.stack([losses[t] for losses, _ in results]).mean()
            torch.testing.assert_close(mean, loss.detach(), **FP32_TOL, msg=f"step {t}")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(model.model.layers[0].post_attention_layernorm.weight, frozen)
    reference, _ = functionalize(model)
    for _, final in results:
        assert_trees_close(final, reference, **FP32_TOL)


def bert() -> Any:
    """A 2-layer BertForMaskedLM of width 32 whose embeddings (and the tied decoder) are frozen."""
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config)
    model.bert.embeddings.requires_grad_(False)
    return model


BF16 = fs.MixedPrecision(torch.bfloat16, torch.float32)


def _bf16(params: Any) -> Any:
    return fs.tree.map(lambda t: t.bfloat16() if t.is_floating_point() else t, params)


def _train_bert_bf16() -> tuple[list[torch.Tensor], Any]:
    params, apply = functionalize(bert(), units=["BertLayer"])
    plan = fs.plan(
        params, fs.Mesh({"fsdp": fs.world_size()}), units=apply.units, frozen=apply.frozen
    )
    sparams = fs.shard(params, plan)
    opt = fs.optim.adamw(lr=1e-2)
    state = opt.init(sparams)
    step = fs.value_and_grad(
        lambda p, ids: apply(p, input_ids=ids, labels=ids).loss, plan, mixed_precision=BF16
    )
    losses = []
    for t in range(STEPS):
        loss, grads = step(sparams, tokens(100 * t + fs.rank()))
        sparams, state = opt.update_(grads, state, sparams)
        losses.append(loss)
    return losses, fs.unshard(sparams)


def test_bert_with_frozen_embeddings_trains_in_bf16_like_one_process(pools):
    """Frozen leaves are cast to param_dtype on gather like trainable ones (once, the embeddings
    stayed fp32 and the first matmul failed). The reference computes every micro-batch in bf16
    from the fp32 params, as each rank does, so only the fp32 sums over ranks differ in order:
    the tolerance of tests/test_value_and_grad.py's bf16 cases."""
    results = pools.run(WORLD, _train_bert_bf16)
    params, apply = functionalize(bert())
    frozen = set(apply.frozen)
    leaves, treedef = fs.tree.flatten(params)
    paths = fs.tree.leaf_paths(params)
    leaves = [x.detach().clone().requires_grad_() for x in leaves]
    opt = torch.optim.AdamW([x for p, x in zip(paths, leaves) if p not in frozen], lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker rank
    try:
        for t in range(STEPS):
            full = fs.tree.unflatten(treedef, [x.detach() for x in leaves])
            loss, grads = fs.testing.reference_value_and_grad(
                lambda p, ids: apply(_bf16(p), input_ids=ids, labels=ids).loss,
                full,
                [(tokens(100 * t + r),) for r in range(WORLD)],
            )
            for path, x, g in zip(paths, leaves, fs.tree.leaves(grads)):
                x.grad = None if path in frozen else g.clone()
            opt.step()
            mean = torch.stack([losses[t] for losses, _ in results]).float().mean()
            torch.testing.assert_close(mean, loss.float(), rtol=1e-4, atol=1e-5, msg=f"step {t}")
    finally:
        torch.set_num_threads(threads)
    reference = fs.tree.unflatten(treedef, [x.detach() for x in leaves])
    for _, final in results:
        assert_trees_close(final, reference, rtol=1e-4, atol=1e-5)
        for path, got, first in zip(paths, fs.tree.leaves(final), fs.tree.leaves(params)):
            if path in frozen:
                assert torch.equal(got, first), f"frozen {path} changed"
