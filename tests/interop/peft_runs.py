"""A tiny Llama with peft LoRA adapters, trained sharded and saved for ``PeftModel.from_pretrained``; on every rank."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

import funcshard as fs
from funcshard.interop import functionalize
from tests.interop.hf_configs import tiny_llama_config

VOCAB, SEQ = 64, 8


def base(seed: int) -> Any:
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(tiny_llama_config(vocab=VOCAB, positions=SEQ))


def lora(seed: int) -> Any:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False
    )
    return get_peft_model(base(seed), config)


def round_trips(directory: str) -> dict[str, Any]:
    """LoRA trained one SGD step, then saved by save_pretrained and save_dcp and loaded back.

    Returns, per path, the parameter names not bit for bit equal to the trained ones.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        # peft reads transformers' older name of the flag (transformers 5 warns)
        warnings.filterwarnings("ignore", ".*is_gradient_checkpointing.* is deprecated")
        return _round_trips(directory)


def _round_trips(directory: str) -> dict[str, Any]:
    from peft import PeftModel

    params, apply = functionalize(lora(seed=0), units=["LlamaDecoderLayer"])
    plan = fs.plan(
        params, fs.Mesh({"fsdp": fs.world_size()}), units=apply.units, frozen=apply.frozen
    )
    sparams = fs.shard(params, plan)
    del params
    opt = fs.optim.sgd(lr=0.1)
    gen = torch.Generator().manual_seed(fs.rank())
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    step = fs.value_and_grad(lambda p, x: apply(p, input_ids=x, labels=x).loss, plan)
    _, grads = step(sparams, ids)
    sparams, _ = opt.update_(grads, opt.init(sparams), sparams)
    full = fs.unshard(sparams)
    trained = {k: v.detach().clone() for k, v in apply.state_dict(full).items()}
    out: dict[str, Any] = {"adapters": sorted(k for k in trained if "lora_" in k)}

    saved = apply.save_pretrained(sparams, os.path.join(directory, "peft"))
    out["files"] = sorted(os.listdir(saved))
    loaded = PeftModel.from_pretrained(base(seed=0), saved).state_dict()
    out["save_pretrained"] = _differ(loaded, trained)

    dcp_dir = fs.checkpoint.save_dcp(os.path.join(directory, "dcp"), sparams, apply=apply)
    like = fs.shard(fs.tree.map(torch.zeros_like, full), plan)
    back = fs.unshard(fs.checkpoint.load_dcp(dcp_dir, like, apply=apply))
    out["dcp"] = _differ(apply.state_dict(back), trained)
    return out


def _differ(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    return sorted(
        k for k in expected if k not in got or not torch.equal(got[k].detach(), expected[k])
    )
