"""Hugging Face gradient checkpointing and caches under functionalize: remat instead, or a clear refusal.

HF's checkpointing recomputes a layer in backward through the module's own
(stale) weights, after funcshard's ``functional_call`` has put them back, so
``functionalize`` turns it into funcshard's remat, or refuses it. The reference is
the same model without HF checkpointing, trained with ``torch.optim`` in one
process on every rank's batch; models are built from tiny configs (nothing is
downloaded). A failure names the step, the leaf path, or the flag that differs.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import funcshard as fs
from funcshard.interop import functionalize
from funcshard.testing import assert_trees_close
from tests.interop.hf_configs import tiny_llama_config

transformers = pytest.importorskip("transformers", reason="Hugging Face is the `hf` extra")

pytestmark = pytest.mark.interop

FP32_TOL: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-6}
VOCAB, SEQ, BATCH, STEPS, WORLD = 64, 8, 2, 3, 2
T5_VOCAB, T5_SRC, T5_TGT = 32, 6, 5
MISSING = "<no instance attribute>"


def llama(seed: int = 0) -> Any:
    """A 2-layer LlamaForCausalLM of hidden size 32 with tied embeddings, weights drawn from ``seed``."""
    config = tiny_llama_config(vocab=VOCAB, positions=SEQ)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config)


def t5(seed: int = 0) -> Any:
    """A 2+2-layer T5ForConditionalGeneration of d_model 16, without dropout (ranks draw alike)."""
    config = transformers.T5Config(
        d_model=16,
        num_layers=2,
        num_heads=2,
        vocab_size=T5_VOCAB,
        d_ff=32,
        d_kv=8,
        num_decoder_layers=2,
        decoder_start_token_id=0,
        pad_token_id=0,
        dropout_rate=0.0,
    )
    torch.manual_seed(seed)
    return transformers.T5ForConditionalGeneration(config)


def enable_hf_checkpointing(model: Any) -> None:
    """``model.gradient_checkpointing_enable()``, which newer transformers deprecate (a FutureWarning)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable()


def cache_of(out: Any) -> Any:
    """The output's cache (``past_key_values`` until transformers 5 named it ``cache``)."""
    return out.get("cache", out.get("past_key_values"))


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def seq2seq(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randint(1, T5_VOCAB, (BATCH, T5_SRC), generator=gen),
        torch.randint(1, T5_VOCAB, (BATCH, T5_TGT), generator=gen),
    )


def flags(model: Any) -> dict[str, Any]:
    """Every module's own ``gradient_checkpointing`` (or its absence) and ``config.use_cache``."""
    out: dict[str, Any] = {
        name: vars(m).get("gradient_checkpointing", MISSING) for name, m in model.named_modules()
    }
    out["config.use_cache"] = model.config.use_cache
    return out


def step_once(model: Any, **functionalize_kwargs: Any) -> tuple[torch.Tensor, Any, Any]:
    """One step at W=1 (in this process) of the model's loss on ``tokens(0)``."""
    params, apply = functionalize(model, **functionalize_kwargs)
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=apply.units, frozen=apply.frozen)
    step = fs.value_and_grad(lambda p, ids: apply(p, input_ids=ids, labels=ids).loss, plan)
    loss, grads = step(fs.shard(params, plan), tokens(0))
    return loss, fs.unshard(grads), apply


def autograd_grads(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n.replace(".", "/"): p.grad for n, p in model.named_parameters()}


def assert_grads_equal(grads: Any, expected: dict[str, torch.Tensor]) -> None:
    paths = fs.tree.leaf_paths(grads)
    assert set(paths) <= expected.keys()
    for path, grad in zip(paths, fs.tree.leaves(grads)):
        torch.testing.assert_close(grad, expected[path], **FP32_TOL, msg=path)


# -- translated into remat ------------------------------------------------------------------


def test_hf_checkpointing_never_runs_inside_apply_and_the_flags_come_back():
    """In a step, HF's checkpoint function is never called (forward or recompute); flags restored."""
    model = llama()
    enable_hf_checkpointing(model)
    calls: list[str] = []
    for name, m in model.named_modules():
        if getattr(m, "gradient_checkpointing", False):
            m._gradient_checkpointing_func = lambda *a, _n=name, **k: calls.append(_n)
    before = flags(model)
    seen: list[bool] = []
    layer = model.model.layers[0]
    layer.register_forward_pre_hook(lambda m, args: seen.append(m.gradient_checkpointing))
    loss, grads, _ = step_once(model, units=["LlamaDecoderLayer"])
    assert calls == []
    # off while apply runs; the recompute runs the layer's __call__ again, hooks included,
    # as HF's own checkpointing does
    assert seen == [False, False]
    assert flags(model) == before
    reference = llama()
    ref_loss, expected = autograd_grads(reference, tokens(0))
    torch.testing.assert_close(loss, ref_loss, **FP32_TOL)
    assert_grads_equal(grads, expected)


class BoomError(Exception):
    pass


@pytest.mark.parametrize("at", ["forward", "recompute", "apply"])
def test_flags_come_back_when_apply_raises(at):
    """An error in a unit's forward, in its recompute (backward) or in a plain apply: flags as they were."""
    model = llama()
    enable_hf_checkpointing(model)
    before = flags(model)
    params, apply = functionalize(model, units=["LlamaDecoderLayer"])
    calls = []

    def boom(*_: Any) -> None:
        calls.append(None)
        if len(calls) == (2 if at == "recompute" else 1):
            raise BoomError(at)

    model.model.layers[1].mlp.register_forward_pre_hook(boom)
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=apply.units, frozen=apply.frozen)
    step = fs.value_and_grad(lambda p, ids: apply(p, input_ids=ids, labels=ids).loss, plan)
    ids = tokens(0)
    run = (
        (lambda: apply(params, input_ids=ids, labels=ids))
        if at == "apply"
        else (lambda: step(fs.shard(params, plan), ids))
    )
    with pytest.raises(BoomError):
        run()
    assert flags(model) == before


def _train_llama(hf_checkpointing: bool) -> tuple[list[torch.Tensor], Any, Any]:
    model = llama()
    if hf_checkpointing:
        enable_hf_checkpointing(model)
    before = flags(model)
    params, apply = functionalize(model, units=["LlamaDecoderLayer"])
    plan = fs.plan(
        params, fs.Mesh({"fsdp": fs.world_size()}), units=apply.units, frozen=apply.frozen
    )
    sparams = fs.shard(params, plan)
    opt = fs.optim.adamw(lr=1e-2, weight_decay=0.1)
    state = opt.init(sparams)
    step = fs.value_and_grad(lambda p, ids: apply(p, input_ids=ids, labels=ids).loss, plan)
    losses, first = [], None
    for t in range(STEPS):
        loss, grads = step(sparams, tokens(100 * t + fs.rank()))
        first = fs.unshard(grads) if first is None else first
        sparams, state = opt.update_(grads, state, sparams)
        losses.append(loss)
    assert flags(model) == before
    return losses, first, fs.unshard(sparams)


def test_llama_with_hf_checkpointing_trains_like_the_model_without_it(pools):
    """W=2, gradient_checkpointing_enable() then functionalize: step-0 grads, losses, final params equal.

    The reference is the model without HF checkpointing, trained with torch.optim.AdamW
    in one process; before the fix the recompute read the module's stale weights and the
    gradients of the second step on differed.
    """
    results = pools.run(WORLD, _train_llama, True)
    model = llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker rank
    try:
        for t in range(STEPS):
            batches = [tokens(100 * t + r) for r in range(WORLD)]
            loss = torch.stack([model(input_ids=b, labels=b).loss for b in batches]).mean()
            opt.zero_grad()
            loss.backward()
            if t == 0:
                expected = {
                    n.replace(".", "/"): p.grad.clone() for n, p in model.named_parameters()
                }
                for _, grads, _ in results:
                    assert_grads_equal(grads, expected)
            opt.step()
            mean = torch.stack([losses[t] for losses, _, _ in results]).mean()
            torch.testing.assert_close(mean, loss.detach(), **FP32_TOL, msg=f"step {t}")
    finally:
        torch.set_num_threads(threads)
    reference, _ = functionalize(model)
    for _, _, final in results:
        assert_trees_close(final, reference, **FP32_TOL)


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.lin(x))


class OldStyleStack(nn.Module):
    """Older transformers: the stack holds the flag and checkpoints each layer it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Counting(), Counting()])
        self.gradient_checkpointing = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return x.sum()


def test_a_checkpointing_stack_whose_layers_are_units_is_rematerialized_by_funcshard():
    """Old style (the flag on the stack): each unit runs twice (remat), its own checkpoint never."""
    net = OldStyleStack()
    params, apply = functionalize(net, units=[Counting])
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=apply.units)
    step = fs.value_and_grad(lambda p, x: apply(p, x), plan)
    _, grads = step(fs.shard(params, plan), torch.ones(2, 3))
    assert [m.calls for m in net.layers] == [2, 2]
    assert net.gradient_checkpointing is True
    expected = torch.func.grad(lambda p: apply(p, torch.ones(2, 3)))(params)
    assert_trees_close(fs.unshard(grads), expected)


# -- refused ----------------------------------------------------------------------------


@pytest.mark.parametrize("units", [[], ["LlamaMLP"], ["model/layers/0"]])
def test_a_checkpointed_layer_no_unit_holds_is_refused_naming_the_fix(units):
    """units=[] (or units inside or beside the layers): the message names the layer and both fixes."""
    model = llama()
    enable_hf_checkpointing(model)
    with pytest.raises(ValueError, match=r"remat=True") as e:
        functionalize(model, units=units)
    message = str(e.value)
    assert "model.gradient_checkpointing_disable()" in message
    assert "'model/layers/1'" in message
    assert "LlamaDecoderLayer" in message


def test_an_old_style_stack_whose_layers_are_not_units_is_refused():
    with pytest.raises(ValueError, match=r"'<OldStyleStack>'.*remat=True"):
        functionalize(OldStyleStack())


def test_checkpointing_enabled_after_functionalize_is_an_error_not_wrong_gradients():
    """remat=False, then gradient_checkpointing_enable(): apply and a step refuse, naming the fix."""
    model = llama()
    params, apply = functionalize(model, units=["LlamaDecoderLayer"])
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=apply.units, frozen=apply.frozen)
    step = fs.value_and_grad(lambda p, ids: apply(p, input_ids=ids, labels=ids).loss, plan)
    enable_hf_checkpointing(model)
    before = flags(model)
    fix = r"remat=True.*model\.gradient_checkpointing_disable\(\)"
    with pytest.raises(ValueError, match=fix):
        step(fs.shard(params, plan), tokens(0))
    with pytest.raises(ValueError, match=fix):
        apply(params, input_ids=tokens(0), labels=tokens(0))
    assert flags(model) == before
    with torch.no_grad():  # HF would not checkpoint here either: nothing to refuse
        apply(params, input_ids=tokens(0))
    model.eval()
    apply(params, input_ids=tokens(0))


def test_checkpointing_enabled_after_functionalize_with_remat_is_rematerialized():
    """remat=True already recomputes every layer: enabling HF checkpointing later changes nothing."""
    model = llama()
    params, apply = functionalize(model, units=["LlamaDecoderLayer"], remat=True)
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=apply.units, frozen=apply.frozen)
    step = fs.value_and_grad(lambda p, ids: apply(p, input_ids=ids, labels=ids).loss, plan)
    enable_hf_checkpointing(model)
    stale = fs.tree.map(lambda t: 1.5 * t, params)  # differs from the module's own weights
    loss, grads = step(fs.shard(stale, plan), tokens(0))
    reference = llama()
    reference.load_state_dict(apply.state_dict(stale))
    ref_loss, expected = autograd_grads(reference, tokens(0))
    torch.testing.assert_close(loss, ref_loss, **FP32_TOL)
    assert_grads_equal(fs.unshard(grads), expected)


# -- caches in a rematerialized step ---------------------------------------------------------


def _train_t5(remat: bool, hf_checkpointing: bool) -> tuple[list[torch.Tensor], Any]:
    model = t5()
    if hf_checkpointing:
        enable_hf_checkpointing(model)
    before = flags(model)
    params, apply = functionalize(model, units=["T5Block"], remat=remat)
    plan = fs.plan(
        params, fs.Mesh({"fsdp": fs.world_size()}), units=apply.units, frozen=apply.frozen
    )
    sparams = fs.shard(params, plan)
    opt = fs.optim.adamw(lr=1e-2, weight_decay=0.1)
    state = opt.init(sparams)
    step = fs.value_and_grad(lambda p, x, y: apply(p, input_ids=x, labels=y).loss, plan)
    losses = []
    for t in range(STEPS):
        loss, grads = step(sparams, *seq2seq(100 * t + fs.rank()))
        sparams, state = opt.update_(grads, state, sparams)
        losses.append(loss)
    assert flags(model) == before
    return losses, fs.unshard(sparams)


@pytest.mark.parametrize(("remat", "hf_checkpointing"), [(True, False), (False, True)])
def test_t5_with_remat_trains_like_the_model_in_one_process(pools, remat, hf_checkpointing):
    """W=2, units=T5Block rematerialized: the decoder's cache would be filled again in the recompute.

    Before the fix: CheckpointError (a different number of tensors saved). The reference
    is the model trained with torch.optim.AdamW in one process, without HF checkpointing.
    """
    results = pools.run(WORLD, _train_t5, remat, hf_checkpointing)
    model = t5()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each worker rank
    try:
        for t in range(STEPS):
            batches = [seq2seq(100 * t + r) for r in range(WORLD)]
            loss = torch.stack([model(input_ids=x, labels=y).loss for x, y in batches]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            mean = torch.stack([losses[t] for losses, _ in results]).mean()
            torch.testing.assert_close(mean, loss.detach(), **FP32_TOL, msg=f"step {t}")
    finally:
        torch.set_num_threads(threads)
    reference, _ = functionalize(model)
    for _, final in results:
        assert_trees_close(final, reference, **FP32_TOL)


def test_caches_stay_on_outside_a_rematerialized_step():
    """Plain apply (nothing recomputes) returns the decoder's cache as the model does."""
    model = t5()
    reference = copy.deepcopy(model)
    params, apply = functionalize(model, units=["T5Block"], remat=True)
    x, y = seq2seq(0)
    with torch.no_grad():
        out = apply(params, input_ids=x, labels=y)
        expected = reference(input_ids=x, labels=y)
    assert cache_of(expected) is not None
    assert cache_of(out) is not None
    torch.testing.assert_close(out.loss, expected.loss, **FP32_TOL)


def test_a_cache_asked_for_in_a_rematerialized_step_is_refused_naming_the_fix():
    """use_cache=True under remat would come back empty: refused, as it cannot be served."""
    params, apply = functionalize(t5(), units=["T5Block"], remat=True)
    plan = fs.plan(params, fs.Mesh({"fsdp": 1}), units=apply.units)
    x, y = seq2seq(0)
    step = fs.value_and_grad(lambda p: apply(p, input_ids=x, labels=y, use_cache=True).loss, plan)
    with pytest.raises(ValueError, match=r"use_cache=True in a training step with remat.*Fix"):
        step(fs.shard(params, plan))
