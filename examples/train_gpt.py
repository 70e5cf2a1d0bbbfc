"""Train a small GPT, written as pure functions over a parameter pytree, fully sharded over ranks.

Run on two CPU processes (the progress bar is tqdm's, ``--plot`` draws with
matplotlib: ``pip install 'funcshard[examples]'``):

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --plot loss.png

Each block is one unit (gathered just before it runs, freed after, re-gathered in
backward); the embedding and head form the root unit. The data is a synthetic
language in which most tokens follow from the one before, so the loss falls
from log(vocab) = 5.5 towards the entropy of the noise.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import torch
import torch.nn.functional as F
from tqdm import tqdm

import funcshard as fs
from funcshard import P


@dataclass(frozen=True)
class Config:
    vocab: int = 256
    width: int = 128
    heads: int = 4
    layers: int = 4
    seq: int = 64
    batch: int = 8  # per rank


# the strategies that differ from full_shard only on a mesh of several axes, and why
MESH_OF_TWO_AXES = {
    "hybrid_shard": "shards over the last mesh axis and replicates over the others",
    "partial_reshard": "keeps a copy sharded over the last mesh axis from forward to backward",
    "hybrid_shard_optimizer": "keeps a copy sharded over the last mesh axis for the step",
}


def init_params(cfg: Config, gen: torch.Generator) -> dict[str, Any]:
    """GPT parameters: token and position embeddings, pre-norm blocks, a final norm and the head."""

    def dense(n_in: int, n_out: int) -> torch.Tensor:
        return torch.randn(n_in, n_out, generator=gen) / math.sqrt(n_in)

    def norm() -> dict[str, torch.Tensor]:
        return {"scale": torch.ones(cfg.width), "bias": torch.zeros(cfg.width)}

    def block() -> dict[str, Any]:
        return {
            "ln1": norm(),
            "attn": {
                "wqkv": dense(cfg.width, 3 * cfg.width),
                "wo": dense(cfg.width, cfg.width) / math.sqrt(2 * cfg.layers),
            },
            "ln2": norm(),
            "mlp": {
                "w1": dense(cfg.width, 4 * cfg.width),
                "b1": torch.zeros(4 * cfg.width),
                "w2": dense(4 * cfg.width, cfg.width) / math.sqrt(2 * cfg.layers),
            },
        }

    return {
        "embed": {
            "tokens": 0.02 * torch.randn(cfg.vocab, cfg.width, generator=gen),
            "pos": 0.02 * torch.randn(cfg.seq, cfg.width, generator=gen),
        },
        "blocks": [block() for _ in range(cfg.layers)],
        "head": {"ln": norm(), "w": dense(cfg.width, cfg.vocab)},
    }


def layer_norm(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], p["scale"], p["bias"])


def block(p: dict[str, Any], h: torch.Tensor, heads: int) -> torch.Tensor:
    """One pre-norm transformer block with causal self-attention."""
    b, s, d = h.shape
    q, k, v = (layer_norm(p["ln1"], h) @ p["attn"]["wqkv"]).split(d, dim=-1)
    q, k, v = (t.reshape(b, s, heads, d // heads).transpose(1, 2) for t in (q, k, v))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
    h = h + a @ p["attn"]["wo"]
    return h + F.gelu(layer_norm(p["ln2"], h) @ p["mlp"]["w1"] + p["mlp"]["b1"]) @ p["mlp"]["w2"]


def loss_fn(
    params: dict[str, Any], tokens: torch.Tensor, targets: torch.Tensor, heads: int
) -> torch.Tensor:
    """Mean next-token cross-entropy. Blocks are units; embedding and head are used directly (root unit)."""
    h = params["embed"]["tokens"][tokens] + params["embed"]["pos"][: tokens.shape[1]]
    for blk in params["blocks"]:
        h = fs.call(block, blk, h, heads)
    logits = layer_norm(params["head"]["ln"], h) @ params["head"]["w"]
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def batch(cfg: Config, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic sequences: x[t] = perm[x[t-1]] (a fixed permutation), 1 in 10 tokens random instead."""
    perm = torch.randperm(cfg.vocab, generator=torch.Generator().manual_seed(1234))
    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.empty(cfg.batch, cfg.seq + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, cfg.vocab, (cfg.batch,), generator=gen)
    noise = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen)
    random = torch.rand(cfg.batch, cfg.seq + 1, generator=gen) < 0.1
    for t in range(1, cfg.seq + 1):
        x[:, t] = torch.where(random[:, t], noise[:, t], perm[x[:, t - 1]])
    return x[:, :-1], x[:, 1:]


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--layers", type=int, default=Config.layers)
    parser.add_argument("--width", type=int, default=Config.width)
    parser.add_argument("--seq", type=int, default=Config.seq)
    parser.add_argument(
        "--batch", type=int, default=Config.batch, help="sequences per rank and step"
    )
    parser.add_argument(
        "--strategy",
        default="full_shard",
        choices=get_args(fs.sharding.Strategy),
    )
    parser.add_argument(
        "--bf16", action="store_true", help="gather and compute in bfloat16, reduce in float32"
    )
    parser.add_argument(
        "--mesh",
        default=None,
        help="named mesh axes, e.g. dp=2,fsdp=2 (default: fsdp over every rank)",
    )
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--explain", action="store_true", help="print the plan")
    parser.add_argument(
        "--plot", type=Path, help="save the loss curve (mean over ranks, smoothed) as a PNG here"
    )
    args = parser.parse_args(argv)
    if args.plot is not None:
        _require_matplotlib()  # before training, not after it
    cfg = Config(layers=args.layers, width=args.width, seq=args.seq, batch=args.batch)

    fs.init()
    rank, world = fs.rank(), fs.world_size()
    device = fs.device()  # cuda:LOCAL_RANK under NCCL, the CPU under gloo
    mesh = _mesh(parser, args.mesh, world)
    if args.strategy in MESH_OF_TWO_AXES and len(mesh.axis_names) < 2:
        parser.error(
            f"{args.strategy} {MESH_OF_TWO_AXES[args.strategy]}, so it needs two axes (on one "
            f"it is full_shard): pass e.g. --mesh dp=2,fsdp={world // 2 or 1}"
        )
    params = init_params(cfg, torch.Generator().manual_seed(0))  # the same on every rank
    mp = (
        fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if args.bf16
        else None
    )
    plan = fs.plan(
        params,
        mesh,
        rules=[("embed/pos", P(None, mesh.axis_names[-1]))],
        units=["blocks/*"],
        strategy=args.strategy,
        # the run's precision and backend, so that explain() gives the bytes it will hold
        cost=fs.cost.CostModel(
            mixed_precision=mp, backend="nccl" if torch.cuda.is_available() else "gloo"
        ),
    )
    if args.explain and rank == 0:
        print(plan.explain())
    sparams = fs.shard(params, plan, device=device)
    del params
    warmup = fs.optim.linear_schedule(args.lr / 10, args.lr, transition_steps=9)
    opt = fs.optim.chain(
        fs.optim.clip_by_global_norm(1.0),  # scales the gradients; state[0].norm: before
        # no decay for norms, biases and embeddings
        fs.optim.adamw(lr=warmup, weight_decay=0.1, mask=fs.optim.decay_mask_default),
    )
    state = opt.init(sparams)
    # gradients are done with after each update: the next step may reuse their buffers
    step = fs.value_and_grad(loss_fn, plan, mixed_precision=mp, donate_grads=True)

    losses: list[float] = []
    smoothed: list[float] = []  # the loss over every rank's batch, smoothed over steps
    start = time.perf_counter()
    log = not sys.stdout.isatty()  # a terminal gets tqdm's bar, a log a line every tenth of the run
    bar = tqdm(range(args.steps), disable=rank != 0 or log, file=sys.stdout, unit="step")
    for i in bar:
        tokens, targets = (t.to(device) for t in batch(cfg, i, rank))
        loss, grads = step(sparams, tokens, targets, cfg.heads)
        sparams, state = opt.update_(grads, state, sparams)
        norm = state[0].norm
        losses.append(float(loss))
        mean = fs.mean_over_ranks(float(loss))  # each rank's loss is of its own batch
        smoothed.append(mean if not smoothed else 0.9 * smoothed[-1] + 0.1 * mean)
        if rank == 0:
            rate = (i + 1) * cfg.batch * cfg.seq * world / (time.perf_counter() - start)
            text = f"loss {smoothed[-1]:.3f}, grad-norm {float(norm):.2f}, {rate:,.0f} tokens/s"
            bar.set_postfix_str(text, refresh=False)
            if log and ((i + 1) % max(1, args.steps // 10) == 0 or i + 1 == args.steps):
                print(f"step {i + 1}/{args.steps}  {text}", flush=True)
    bar.close()
    if rank == 0:
        held = sum(
            leaf.padded.numel() * leaf.padded.element_size() for leaf in fs.tree.leaves(sparams)
        )
        print(
            f"loss {smoothed[0]:.3f} -> {smoothed[-1]:.3f} (mean over ranks, smoothed) over "
            f"{args.steps} steps on {world} rank(s); "
            f"rank 0 holds {held / 2**20:.2f} MiB of parameters; "
            f"peak gathered {step.stats.peak_gathered_bytes / 2**20:.2f} MiB"
        )
        if args.plot is not None:
            _plot(smoothed, args.plot, f"{world} rank(s), {args.strategy}")
            print(f"loss curve saved to {args.plot}")
    return losses


def _mesh(parser: argparse.ArgumentParser, text: str | None, world: int) -> fs.Mesh:
    """``--mesh dp=2,fsdp=2`` as a mesh of ``world`` ranks (default: ``fsdp`` over all of them)."""
    if text is None:
        return fs.Mesh({"fsdp": world})
    axes: dict[str, int] = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not name.strip() or not size.strip().isdigit() or int(size) < 1:
            parser.error(f"--mesh {text!r}: write named axes as name=size, e.g. dp=2,fsdp=2")
        axes[name.strip()] = int(size)
    if math.prod(axes.values()) != world:
        parser.error(f"--mesh {text!r} has {math.prod(axes.values())} ranks, the run has {world}")
    return fs.Mesh(axes)


def _require_matplotlib() -> None:
    """Exits with status 2 and one line saying what to install when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401  # pyright: ignore[reportUnusedImport]
    except ImportError:
        print("train_gpt.py: --plot needs matplotlib: pip install matplotlib", file=sys.stderr)
        raise SystemExit(2) from None


def _plot(smoothed: list[float], path: Path, title: str) -> None:
    """Writes the smoothed loss per step to ``path`` (PNG, drawn off-screen)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(1, len(smoothed) + 1), smoothed)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over ranks, smoothed)")
    ax.set_title(f"train_gpt.py: {title}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


if __name__ == "__main__":
    main()
