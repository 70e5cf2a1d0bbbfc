"""LoRA on a frozen, sharded Hugging Face Llama: the base costs 1/W of its bytes per rank.

Run on two CPU processes (needs ``pip install 'funcshard[hf]'``):

    torchrun --standalone --nproc-per-node 2 examples/lora.py

The model is built on the meta device, so no rank ever holds it whole; every
``q_proj`` and ``v_proj`` gets a low-rank adapter (``W x + B A x``, ``B`` zero at
the start) and every base weight is frozen. ``apply.materialize`` initializes
the model with its own code one submodule at a time, keeping this rank's
shards; ``fs.plan(..., frozen=apply.frozen)`` shards the frozen base like the
rest (gathered per layer, in bf16 under mixed precision) but gives it no
gradient and no optimizer state, so AdamW state exists only for the adapters.
Every ``--eval-every`` steps the held-out loss is evaluated with ``fs.forward``
(no gradients, each layer gathered once), and at the end a few tokens are
decoded greedily through it.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import funcshard as fs


class LoRALinear(nn.Module):
    """``base(x) + scale * B(A(x))`` with ``base`` frozen; ``B`` starts at zero."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base
        self.base.weight.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, device=base.weight.device))
        self.lora_b = nn.Parameter(torch.empty(base.out_features, rank, device=base.weight.device))
        self.scale = alpha / rank
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * (x @ self.lora_a.T @ self.lora_b.T)


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    """A meta-device Llama with adapters on every q_proj and v_proj, everything else frozen."""
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq + args.generate,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        for p in model.parameters():
            p.requires_grad_(False)
        for layer in model.model.layers:
            attn: Any = layer.self_attn
            attn.q_proj = LoRALinear(attn.q_proj, args.rank, 2.0 * args.rank)
            attn.v_proj = LoRALinear(attn.v_proj, args.rank, 2.0 * args.rank)
    return model


def batch(args: argparse.Namespace, step: int, rank: int, world: int) -> torch.Tensor:
    """This rank's rows of the global batch: sequences where x[t] = (x[t-1] + 3) mod vocab.

    The global batch (``world * batch`` rows) depends only on ``step``, so runs on
    any number of ranks with the same global batch see the same data.
    """
    gen = torch.Generator().manual_seed(1_000_003 * step + 17)
    start = torch.randint(0, args.vocab, (world * args.batch, 1), generator=gen)
    rows = (start + 3 * torch.arange(args.seq)) % args.vocab
    return rows[rank * args.batch : (rank + 1) * args.batch]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--lr", type=float, default=5e-2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rank", type=int, default=4, help="LoRA rank")
    parser.add_argument("--generate", type=int, default=4, help="tokens decoded at the end")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    args = parser.parse_args(argv)

    fs.init()
    world, me = fs.world_size(), fs.rank()
    params, apply = fs.interop.functionalize(build_model(args), units=["LlamaDecoderLayer"])
    plan = fs.plan(params, fs.Mesh({"fsdp": world}), units=apply.units, frozen=apply.frozen)
    sparams = apply.materialize(plan, seed=0)  # the model's own init, the same for every W
    mp = (
        fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if args.precision == "bf16"
        else None
    )
    opt = fs.optim.adamw(lr=args.lr)
    state = opt.init(sparams)  # moments for the adapters only: the base is frozen

    def loss_fn(p: Any, ids: torch.Tensor) -> torch.Tensor:
        return apply(p, input_ids=ids, labels=ids).loss

    step = fs.value_and_grad(loss_fn, plan, mixed_precision=mp)
    evaluate = fs.forward(loss_fn, plan, mixed_precision=mp)
    logits = fs.forward(lambda p, ids: apply(p, input_ids=ids).logits, plan, mixed_precision=mp)
    held_out = batch(args, -1, me, world)
    losses, evals = [], []
    for t in range(args.steps):
        loss, grads = step(sparams, batch(args, t, me, world))
        sparams, state = opt.update_(grads, state, sparams)
        losses.append(float(loss))
        if (t + 1) % args.eval_every == 0 or t + 1 == args.steps:
            evals.append(float(evaluate(sparams, held_out)))
            if me == 0:
                print(f"step {t + 1:3d}  train loss {loss:.3f}  held-out loss {evals[-1]:.3f}")
    ids = batch(args, -2, 0, 1)[:1, :4]
    for _ in range(args.generate):  # greedy decoding, every rank the same prompt
        ids = torch.cat([ids, logits(sparams, ids)[:, -1:].argmax(-1)], dim=1)
    if me == 0:
        print(f"greedy continuation of {ids[0, :4].tolist()}: {ids[0, 4:].tolist()}")
    frozen_bytes = sum(
        x.padded.numel() * x.padded.element_size() for x in fs.tree.leaves(sparams) if x.frozen
    )
    return {
        "losses": losses,
        "evals": evals,
        "generated": ids[0].tolist(),
        "frozen_bytes": frozen_bytes,
        "optimizer_bytes": fs.testing.held_bytes(state),
        "params": fs.unshard(sparams),
    }


if __name__ == "__main__":
    main()
