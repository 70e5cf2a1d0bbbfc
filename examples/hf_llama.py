"""Shard and train a Hugging Face LlamaForCausalLM with funcshard, with no per-layer code.

Run on two CPU processes (needs ``pip install 'funcshard[hf]'``):

    torchrun --standalone --nproc-per-node 2 examples/hf_llama.py

The model is built from a small ``LlamaConfig`` with random weights (nothing is
downloaded). ``fs.interop.functionalize`` splits it into a parameter pytree and a
pure ``apply``; every ``LlamaDecoderLayer`` is a unit, gathered just before its
forward and freed after, while the tied embedding, the final norm and the rotary
buffers form the root. The loss is the model's own (``labels=...``). The data is a
synthetic language in which most tokens follow from the one before, so the loss
falls from log(vocab) towards the entropy of the noise. With ``--save DIR``,
``apply.save_pretrained`` writes the trained weights as ``from_pretrained`` loads them
(every rank takes part; rank 0 writes).
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import funcshard as fs


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    """A Llama of the given size with weights drawn from seed 0: the same on every rank."""
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def batch(args: argparse.Namespace, step: int, rank: int) -> torch.Tensor:
    """Sequences where x[t] = perm[x[t-1]] (a fixed permutation), 1 token in 10 random instead."""
    perm = torch.randperm(args.vocab, generator=torch.Generator().manual_seed(1234))
    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.empty(args.batch, args.seq, dtype=torch.long)
    x[:, 0] = torch.randint(0, args.vocab, (args.batch,), generator=gen)
    noise = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    random = torch.rand(args.batch, args.seq, generator=gen) < 0.1
    for t in range(1, args.seq):
        x[:, t] = torch.where(random[:, t], noise[:, t], perm[x[:, t - 1]])
    return x


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--strategy",
        default="full_shard",
        choices=["full_shard", "shard_grad_op", "shard_optimizer", "no_shard", "hybrid_shard"],
    )
    parser.add_argument("--explain", action="store_true", help="print the plan")
    parser.add_argument("--save", help="save the trained model here (apply.save_pretrained)")
    args = parser.parse_args(argv)

    fs.init()
    rank, world = fs.rank(), fs.world_size()
    params, apply = fs.interop.functionalize(build_model(args), units=["LlamaDecoderLayer"])
    plan = fs.plan(
        params,
        fs.Mesh({"fsdp": world}),
        units=apply.units,
        frozen=apply.frozen,
        strategy=args.strategy,
    )
    if args.explain and rank == 0:
        print(plan.explain())
    sparams = fs.shard(params, plan)
    del params
    opt = fs.optim.chain(
        fs.optim.clip_by_global_norm(1.0),
        fs.optim.adamw(
            lr=fs.optim.linear_schedule(args.lr / 10, args.lr, transition_steps=9),
            weight_decay=0.1,
            mask=fs.optim.decay_mask_default,  # not the norms or the embeddings
        ),
    )
    state = opt.init(sparams)

    def loss_fn(p: Any, input_ids: torch.Tensor) -> torch.Tensor:
        return apply(p, input_ids=input_ids, labels=input_ids).loss

    step = fs.value_and_grad(loss_fn, plan)
    losses: list[float] = []
    start = time.perf_counter()
    for i in range(args.steps):
        ids = batch(args, i, rank)
        loss, grads = step(sparams, ids)
        sparams, state = opt.update_(grads, state, sparams)
        losses.append(float(loss))
        mean = fs.mean_over_ranks(float(loss))  # each rank's loss is of its own batch
        if rank == 0 and (i + 1) % max(1, args.steps // 10) == 0:
            rate = (i + 1) * ids.numel() * world / (time.perf_counter() - start)
            print(
                f"step {i + 1}/{args.steps}  loss {mean:.3f} (mean over ranks)  "
                f"{rate:,.0f} tokens/s",
                flush=True,
            )
    if rank == 0:
        print(
            f"loss {losses[0]:.3f} -> {losses[-1]:.3f} (log vocab {math.log(args.vocab):.3f}) "
            f"over {args.steps} steps on {world} rank(s)"
        )
    if args.save:  # collective: one flat buffer gathered at a time, rank 0 writes
        apply.save_pretrained(sparams, args.save)
        if rank == 0:
            print(f"saved to {args.save}")
    return losses


if __name__ == "__main__":
    main()
