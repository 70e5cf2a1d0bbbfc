"""The benchmark's GPT: pure functions over a pytree (funcshard) and the same math as an nn.Module (PyTorch).

Token and position embeddings, pre-norm blocks with causal self-attention and a
GELU MLP, a final norm and an LM head, cross-entropy. Both forms start from the
same initial tensors and compute the same function, so every mode follows the
same loss trajectory.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import funcshard as fs

BLOCK_LEAVES = ("ln1_scale", "ln1_bias", "wqkv", "wo", "ln2_scale", "ln2_bias", "w1", "b1", "w2")


@dataclass(frozen=True)
class Config:
    """Model and batch sizes (batch is per rank)."""

    vocab: int = 8192
    width: int = 512
    heads: int = 8
    layers: int = 8
    seq: int = 256
    batch: int = 2

    def to_json(self) -> dict[str, int]:
        return asdict(self)


TINY = Config(vocab=64, width=32, heads=2, layers=2, seq=16, batch=2)

# --size: GPTs of about 8M, 34M (the default Config) and 126M parameters, and the deep
# narrow model where each unit's fixed cost (hooks, gathers, bookkeeping) dominates
SIZES = {
    "8m": Config(vocab=4096, width=256, heads=4, layers=8),
    "34m": Config(),
    "126m": Config(vocab=26624, width=768, heads=12, layers=12),
    "deep": Config(vocab=256, width=128, heads=2, layers=96, seq=64, batch=2),
}
# what --tiny runs for each size: the same shape, in seconds
TINY_SIZES = {
    "8m": TINY,
    "34m": TINY,
    "126m": Config(vocab=128, width=64, heads=2, layers=2, seq=16, batch=2),
    "deep": Config(vocab=64, width=32, heads=2, layers=12, seq=16, batch=2),
}


def param_count(cfg: Config) -> int:
    """The GPT's parameter count under ``cfg``.

    >>> [f"{param_count(c) / 1e6:.1f}M" for c in SIZES.values()]
    ['8.5M', '33.7M', '126.1M', '19.0M']
    """
    w, v, s, layers = cfg.width, cfg.vocab, cfg.seq, cfg.layers
    block = 2 * w + 3 * w * w + w * w + 2 * w + 4 * w * w + 4 * w + 4 * w * w
    return v * w + s * w + layers * block + 2 * w + w * v


def init_params(cfg: Config, seed: int = 0) -> dict[str, Any]:
    """The parameter pytree every mode starts from."""
    gen = torch.Generator().manual_seed(seed)

    def dense(n_in: int, n_out: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(n_in, n_out, generator=gen) * (scale / math.sqrt(n_in))

    def block() -> dict[str, torch.Tensor]:
        out_scale = 1 / math.sqrt(2 * cfg.layers)
        return {
            "ln1_scale": torch.ones(cfg.width),
            "ln1_bias": torch.zeros(cfg.width),
            "wqkv": dense(cfg.width, 3 * cfg.width),
            "wo": dense(cfg.width, cfg.width, out_scale),
            "ln2_scale": torch.ones(cfg.width),
            "ln2_bias": torch.zeros(cfg.width),
            "w1": dense(cfg.width, 4 * cfg.width),
            "b1": torch.zeros(4 * cfg.width),
            "w2": dense(4 * cfg.width, cfg.width, out_scale),
        }

    return {
        "embed": {
            "tokens": 0.02 * torch.randn(cfg.vocab, cfg.width, generator=gen),
            "pos": 0.02 * torch.randn(cfg.seq, cfg.width, generator=gen),
        },
        "blocks": [block() for _ in range(cfg.layers)],
        "head": {
            "ln_scale": torch.ones(cfg.width),
            "ln_bias": torch.zeros(cfg.width),
            "w": dense(cfg.width, cfg.vocab),
        },
    }


def block_fn(p: dict[str, torch.Tensor], h: torch.Tensor, heads: int) -> torch.Tensor:
    """One pre-norm transformer block."""
    b, s, d = h.shape
    x = F.layer_norm(h, (d,), p["ln1_scale"], p["ln1_bias"])
    q, k, v = (x @ p["wqkv"]).split(d, dim=-1)
    q, k, v = (t.reshape(b, s, heads, d // heads).transpose(1, 2) for t in (q, k, v))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
    h = h + a @ p["wo"]
    x = F.layer_norm(h, (d,), p["ln2_scale"], p["ln2_bias"])
    return h + F.gelu(x @ p["w1"] + p["b1"]) @ p["w2"]


def head_loss(p: dict[str, torch.Tensor], h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    x = F.layer_norm(h, h.shape[-1:], p["ln_scale"], p["ln_bias"])
    return F.cross_entropy((x @ p["w"]).flatten(0, 1).float(), targets.flatten())


def loss_fn(
    params: dict[str, Any], tokens: torch.Tensor, targets: torch.Tensor, heads: int
) -> torch.Tensor:
    """The pure loss: blocks are funcshard units, embeddings and head the root unit."""
    h = params["embed"]["tokens"][tokens] + params["embed"]["pos"][: tokens.shape[1]]
    for blk in params["blocks"]:
        h = fs.call(block_fn, blk, h, heads)
    return head_loss(params["head"], h, targets)


class Block(nn.Module):
    """A block as a module (the unit PyTorch FSDP wraps)."""

    def __init__(self, p: dict[str, torch.Tensor], heads: int) -> None:
        super().__init__()
        self.heads = heads
        for name in BLOCK_LEAVES:
            setattr(self, name, nn.Parameter(p[name].clone()))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return block_fn({name: getattr(self, name) for name in BLOCK_LEAVES}, h, self.heads)


class GPT(nn.Module):
    """The same GPT as a module tree, from the same tensors."""

    def __init__(self, params: dict[str, Any], heads: int) -> None:
        super().__init__()
        self.tokens = nn.Parameter(params["embed"]["tokens"].clone())
        self.pos = nn.Parameter(params["embed"]["pos"].clone())
        self.blocks = nn.ModuleList(Block(p, heads) for p in params["blocks"])
        self.ln_scale = nn.Parameter(params["head"]["ln_scale"].clone())
        self.ln_bias = nn.Parameter(params["head"]["ln_bias"].clone())
        self.w = nn.Parameter(params["head"]["w"].clone())

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.tokens[tokens] + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return head_loss(
            {"ln_scale": self.ln_scale, "ln_bias": self.ln_bias, "w": self.w}, h, targets
        )


def batch(
    cfg: Config, step: int, rank: int, *, ranks: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of ``step``; with ``ranks`` > 1, the batches of ranks ``rank .. rank+ranks-1`` concatenated."""
    parts = []
    for r in range(rank, rank + ranks):
        gen = torch.Generator().manual_seed(1_000_003 * step + r)
        parts.append(torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=gen))
    seq = torch.cat(parts)
    return seq[:, :-1], seq[:, 1:]
