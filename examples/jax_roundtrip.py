"""Train with funcshard, then evaluate the very same parameters in JAX: the same loss and gradients.

Run on two CPU processes (needs ``pip install 'funcshard[jax]'``):

    torchrun --standalone --nproc-per-node 2 examples/jax_roundtrip.py

A small language model (embedding, pre-norm MLP blocks, head) is written twice, as a
pure torch function trained fully sharded and as a pure JAX function. After
training, every rank gathers the parameters and hands them to JAX without a copy
(``fs.interop.to_jax``); ``plan.to_jax_shardings`` places them on a JAX mesh of as
many host devices as there are ranks, where device r holds exactly what rank r
holds (checked against ``to_jax`` of the rank's own shards). ``jax.jit`` then
computes the loss and its gradients, which come back as tensors
(``fs.interop.from_jax``) and match funcshard's to fp32 precision.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

import torch
import torch.nn.functional as F

import funcshard as fs
from funcshard import P


def init_params(args: argparse.Namespace) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)

    def dense(n_in: int, n_out: int) -> torch.Tensor:
        return torch.randn(n_in, n_out, generator=gen) / math.sqrt(n_in)

    def block() -> dict[str, Any]:
        ln = {"scale": torch.ones(args.width), "bias": torch.zeros(args.width)}
        return {
            "ln": ln,
            "w1": dense(args.width, 4 * args.width),
            "b1": torch.zeros(4 * args.width),
            "w2": dense(4 * args.width, args.width) / math.sqrt(2 * args.layers),
        }

    return {
        "embed": 0.1 * torch.randn(args.vocab, args.width, generator=gen),
        "blocks": [block() for _ in range(args.layers)],
        "head": dense(args.width, args.vocab),
    }


def block(p: dict[str, Any], h: torch.Tensor) -> torch.Tensor:
    x = F.layer_norm(h, h.shape[-1:], p["ln"]["scale"], p["ln"]["bias"], eps=1e-5)
    return h + F.gelu(x @ p["w1"] + p["b1"]) @ p["w2"]


def loss_fn(params: dict[str, Any], tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; each block is a unit, embedding and head the root unit."""
    h = params["embed"][tokens]
    for blk in params["blocks"]:
        h = fs.call(block, blk, h)
    return F.cross_entropy((h @ params["head"]).flatten(0, 1), targets.flatten())


def jax_loss_fn(params: Any, tokens: Any, targets: Any) -> Any:
    """The same model in JAX (exact GELU, biased variance in the norm, as torch)."""
    import jax
    import jax.numpy as jnp

    h = params["embed"][tokens]
    for p in params["blocks"]:
        mean = h.mean(-1, keepdims=True)
        var = jnp.square(h - mean).mean(-1, keepdims=True)
        x = (h - mean) / jnp.sqrt(var + 1e-5) * p["ln"]["scale"] + p["ln"]["bias"]
        h = h + jax.nn.gelu(x @ p["w1"] + p["b1"], approximate=False) @ p["w2"]
    logp = jax.nn.log_softmax(h @ params["head"])
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def batch(args: argparse.Namespace, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences where x[t] = perm[x[t-1]], 1 token in 10 random instead."""
    perm = torch.randperm(args.vocab, generator=torch.Generator().manual_seed(1234))
    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.empty(args.batch, args.seq + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, args.vocab, (args.batch,), generator=gen)
    noise = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
    random = torch.rand(args.batch, args.seq + 1, generator=gen) < 0.1
    for t in range(1, args.seq + 1):
        x[:, t] = torch.where(random[:, t], noise[:, t], perm[x[:, t - 1]])
    return x[:, :-1], x[:, 1:]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args(argv)

    fs.init()
    rank, world = fs.rank(), fs.world_size()
    # one JAX host device per rank, so that the JAX mesh has the shape of funcshard's
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={world}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np

    mesh = fs.Mesh({"fsdp": world})
    plan = fs.plan(
        init_params(args), mesh, rules=[("blocks/*/w1", P(None, "fsdp"))], units=["blocks/*"]
    )
    sparams = fs.shard(init_params(args), plan)
    opt = fs.optim.adamw(lr=args.lr, weight_decay=0.01)
    state = opt.init(sparams)
    step = fs.value_and_grad(loss_fn, plan)
    losses: list[float] = []
    for i in range(args.steps):
        loss, grads = step(sparams, *batch(args, i, rank))
        sparams, state = opt.update_(grads, state, sparams)
        losses.append(float(loss))

    # funcshard's loss and gradients on held-out batches (one per rank), then the same in JAX
    held_out = [batch(args, 10_000, r) for r in range(world)]
    loss, grads = step(sparams, *held_out[rank])
    torch_loss = _mean(loss)
    torch_grads = fs.unshard(grads)
    full = fs.unshard(sparams)

    jax_mesh = jax.sharding.Mesh(np.array(jax.devices()[:world]).reshape(mesh.shape), ("fsdp",))
    shardings = plan.to_jax_shardings(jax_mesh)
    jparams = jax.device_put(fs.interop.to_jax(full), shardings)  # to_jax shares full's memory
    mine = fs.interop.to_jax(sparams)  # this rank's shards, as JAX arrays
    for got, want in zip(
        jax.tree.leaves(fs.interop.from_jax(jparams, rank=rank)), jax.tree.leaves(mine)
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    def mean_loss(p: Any, batches: Any) -> Any:
        return sum(jax_loss_fn(p, t, y) for t, y in batches) / len(batches)

    replicated = jax.sharding.NamedSharding(jax_mesh, jax.sharding.PartitionSpec())
    batches = jax.device_put(fs.interop.to_jax(held_out), replicated)
    value_and_grad = jax.jit(jax.value_and_grad(mean_loss), in_shardings=(shardings, replicated))
    jax_loss, jax_grads = value_and_grad(jparams, batches)
    back = fs.interop.from_jax(jax.device_put(jax_grads, jax.devices()[0]))
    grad_error = max(
        float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
        for a, b in zip(fs.tree.leaves(back), fs.tree.leaves(torch_grads))
    )
    if rank == 0:
        print(
            f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {args.steps} steps on {world} rank(s)\n"
            f"held-out loss: funcshard {torch_loss:.6f}, JAX {float(jax_loss):.6f}; "
            f"largest relative gradient difference {grad_error:.1e}"
        )
    return {
        "losses": losses,
        "torch_loss": torch_loss,
        "jax_loss": float(jax_loss),
        "grad_error": grad_error,
    }


def _mean(loss: torch.Tensor) -> float:
    """The mean of every rank's loss (the loss funcshard's gradients belong to)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return float(loss)
    total = loss.detach().clone().reshape(1)
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


if __name__ == "__main__":
    main()
