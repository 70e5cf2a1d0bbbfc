"""torchtitan's llama3 (fused QKV) and funcshard, checkpointing each other's runs; run on every rank.

The model is torchtitan 0.3's ``Llama3Model`` built from a tiny config (nothing is
downloaded) with ``fuse_qkv=True``: each attention's ``FusedQKVLinear`` holds one
``wqkv`` and checkpoints it as ``wq``/``wk``/``wv`` through its state-dict hooks.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from torch import nn

import funcshard as fs
from funcshard.interop import functionalize

DIM, HEADS, KV_HEADS, VOCAB, LAYERS = 16, 4, 2, 32, 2


def build(seed: int) -> nn.Module:
    """torchtitan's llama3 with fused QKV, its weights drawn from ``seed``."""
    with warnings.catch_warnings():  # what torchtitan's imports say of torch's APIs it uses
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
        from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    config = Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=_build_llama3_layers(
            fuse_qkv=True,
            n_layers=LAYERS,
            dim=DIM,
            n_heads=HEADS,
            n_kv_heads=KV_HEADS,
            hidden_dim=32,
            rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=16, theta=10000.0),
            attn_backend="flex",
        ),
    )
    torch.manual_seed(seed)
    model = config.build()
    with torch.no_grad():  # distinct values everywhere (some inits are constant)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + p.numel())))
    return model


def fsdp2(model: nn.Module) -> nn.Module:
    """``fully_shard`` on each transformer block, then the root, as torchtitan's FSDP does."""
    from torch.distributed.fsdp import fully_shard

    layers = model.get_submodule("layers")
    for layer in layers.values() if isinstance(layers, nn.ModuleDict) else layers.children():
        fully_shard(layer)
    fully_shard(model)
    return model


def whole(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of a plain or FSDP2 module as a full tensor, by dotted name."""
    out = {}
    for name, p in model.named_parameters():
        full = getattr(p, "full_tensor", None)
        out[name] = (p if full is None else full()).detach().clone()
    return out


def round_trips(directory: str) -> dict[str, Any]:
    """funcshard saves, torchtitan loads (its model code, and FSDP2); FSDP2 saves, funcshard loads.

    Returns per check the names whose values are not bit for bit equal (``[]``: all are).
    """
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpointer.base import ModelWrapper

    warnings.filterwarnings("ignore", "torch.distributed is disabled")
    model = build(seed=0)
    stock = {k: v.clone() for k, v in model.state_dict().items()}  # wq/wk/wv, torchtitan's keys
    trained = whole(model)
    params, apply = functionalize(model, units=["layers/*"])
    plan = fs.plan(params, fs.Mesh({"fsdp": fs.world_size()}), units=apply.units)
    sparams = fs.shard(params, plan)
    del params
    out: dict[str, Any] = {}

    # funcshard's state dict: torchtitan's keys and values
    got = apply.state_dict(fs.unshard(sparams))
    out["keys"] = sorted(set(got) ^ set(stock))
    out["state_dict"] = _differ(got, stock)
    with apply.bound(fs.unshard(sparams)) as module:
        out["bound"] = _differ(module.state_dict(), stock)

    # funcshard -> torchtitan's model code (unsharded) and FSDP2, both through ModelWrapper
    saved = os.path.join(directory, "funcshard")
    fs.checkpoint.save_dcp(saved, sparams, apply=apply)
    for name, target in (("to_torchtitan", build(seed=1)), ("to_fsdp2", fsdp2(build(seed=2)))):
        wrapper = ModelWrapper(target)
        state = wrapper.state_dict()
        dcp.load(state, checkpoint_id=saved)
        wrapper.load_state_dict(state)
        out[name] = _differ(whole(target), trained)

    # FSDP2 (torchtitan's model, other weights) -> funcshard
    source = fsdp2(build(seed=3))
    expected = whole(source)
    written = os.path.join(directory, "fsdp2")
    dcp.save(ModelWrapper(source).state_dict(), checkpoint_id=written)
    like = fs.shard(fs.tree.map(torch.zeros_like, fs.unshard(sparams)), plan)
    loaded = fs.unshard(fs.checkpoint.load_dcp(written, like, apply=apply))
    by_name = {
        name: leaf
        for path, leaf in zip(fs.tree.leaf_paths(loaded), fs.tree.leaves(loaded))
        for name in _names(apply, path)
    }
    out["from_fsdp2"] = _differ(by_name, expected)
    return out


def _names(apply: Any, path: str) -> tuple[str, ...]:
    return next(leaf.names for leaf in apply._leaves if leaf.path == path)


def _differ(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    return sorted(
        k
        for k in expected
        if k not in got or got[k].dtype != expected[k].dtype or not torch.equal(got[k], expected[k])
    )
