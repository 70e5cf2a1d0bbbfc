"""Plan and shard a small GPT's parameters over two CPU processes, then check the round trip.

Run: ``torchrun --standalone --nproc-per-node 2 examples/shard_demo.py``.
"""

from __future__ import annotations

import torch

import funcshard as fs
from funcshard import P


def init_params(
    gen: torch.Generator, *, vocab: int = 512, width: int = 64, layers: int = 4
) -> dict:
    def dense(n_in: int, n_out: int) -> torch.Tensor:
        return torch.randn(n_in, n_out, generator=gen) / n_in**0.5

    def block() -> dict:
        return {
            "attn": {"wqkv": dense(width, 3 * width), "wo": dense(width, width)},
            "mlp": {"w1": dense(width, 4 * width), "w2": dense(4 * width, width)},
            "norm1": torch.ones(width),
            "norm2": torch.ones(width),
        }

    return {
        "embed": torch.randn(vocab, width, generator=gen) * 0.02,
        "blocks": [block() for _ in range(layers)],
        "head": {"norm": torch.ones(width), "w": dense(width, vocab)},
    }


def main() -> None:
    fs.init()
    mesh = fs.Mesh({"fsdp": fs.world_size()})
    params = init_params(torch.Generator().manual_seed(0))
    plan = fs.plan(params, mesh, rules=[("blocks/*/mlp/w2", P("fsdp", None))], units=["blocks/*"])
    if fs.rank() == 0:
        print(plan.explain())
    sparams = fs.shard(params, plan)
    local = sum(
        leaf.padded.numel() * leaf.padded.element_size() for leaf in fs.tree.leaves(sparams)
    )
    total = sum(t.numel() * t.element_size() for t in fs.tree.leaves(params))
    print(
        f"rank {fs.rank()}: holds {local:,} of {total:,} parameter bytes ({local / total:.1%})",
        flush=True,
    )
    full = fs.unshard(sparams)
    same = all(torch.equal(a, b) for a, b in zip(fs.tree.leaves(full), fs.tree.leaves(params)))
    print(f"rank {fs.rank()}: unshard(shard(params)) == params: {same}", flush=True)
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
