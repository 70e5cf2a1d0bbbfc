"""Small models as pure functions over parameter pytrees, for equivalence tests.

A :class:`Model` names its shape and which subtrees are units; ``loss_fn`` goes
through ``fs.call`` exactly for those, so the same function runs sharded (under a
step) and as the single-process reference (where ``fs.call`` is a plain call).
Sizes are small and may be uneven on purpose (``width=6`` over 4 ranks), and the
head has a scalar leaf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

import funcshard as fs

Grouping = Literal["per_block", "all_blocks", "none"]


@dataclass(frozen=True)
class Model:
    """A small MLP or transformer and its unit grouping."""

    kind: Literal["mlp", "transformer"] = "transformer"
    vocab: int = 11
    width: int = 6
    hidden: int = 10
    layers: int = 2
    heads: int = 2
    seq: int = 5
    batch: int = 3
    grouping: Grouping = "per_block"
    embed_unit: bool = False
    head_unit: bool = False
    remat: bool = False

    @property
    def units(self) -> list[str]:
        """Unit patterns for ``fs.plan`` matching what ``loss_fn`` passes to ``fs.call``."""
        units = {"per_block": ["blocks/*"], "all_blocks": ["blocks"], "none": []}[self.grouping]
        return units + (["embed"] if self.embed_unit else []) + (["head"] if self.head_unit else [])

    def init(self, seed: int) -> dict[str, Any]:
        """Parameters drawn from a generator seeded with ``seed``."""
        gen = torch.Generator().manual_seed(seed)

        def dense(n_in: int, n_out: int) -> torch.Tensor:
            return torch.randn(n_in, n_out, generator=gen) / math.sqrt(n_in)

        def block() -> dict[str, Any]:
            if self.kind == "mlp":
                return {
                    "w": dense(self.width, self.width),
                    "b": 0.1 * torch.randn(self.width, generator=gen),
                }
            return {
                "norm": {
                    "scale": 1 + 0.1 * torch.randn(self.width, generator=gen),
                    "bias": torch.zeros(self.width),
                },
                "attn": {
                    "wqkv": dense(self.width, 3 * self.width),
                    "wo": dense(self.width, self.width),
                },
                "mlp": {
                    "w1": dense(self.width, self.hidden),
                    "b1": torch.zeros(self.hidden),
                    "w2": dense(self.hidden, self.width),
                },
            }

        return {
            "embed": {"tokens": torch.randn(self.vocab, self.width, generator=gen)},
            "blocks": [block() for _ in range(self.layers)],
            "head": {"w": dense(self.width, self.vocab), "temp": torch.tensor(1.3)},
        }

    def batch_for(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One (tokens, targets) batch drawn from ``seed``."""
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, self.vocab, (self.batch, self.seq), generator=gen)
        targets = torch.randint(0, self.vocab, (self.batch, self.seq), generator=gen)
        return tokens, targets

    def loss_fn(self, params: Any, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of next-token logits; units go through ``fs.call``."""
        h = self._maybe_call(_embed, params["embed"], tokens, unit=self.embed_unit)
        if self.grouping == "all_blocks":
            h = fs.call(self._blocks, params["blocks"], h, remat=self.remat)
        else:
            for blk in params["blocks"]:
                h = self._maybe_call(self._block, blk, h, unit=self.grouping == "per_block")
        return self._maybe_call(_head_loss, params["head"], h, targets, unit=self.head_unit)

    def _maybe_call(self, fn: Any, p: Any, *args: Any, unit: bool) -> Any:
        return fs.call(fn, p, *args, remat=self.remat) if unit else fn(p, *args)

    def _blocks(self, blocks: list[Any], h: torch.Tensor) -> torch.Tensor:
        for blk in blocks:
            h = self._block(blk, h)
        return h

    def _block(self, p: Any, h: torch.Tensor) -> torch.Tensor:
        if self.kind == "mlp":
            return torch.tanh(h @ p["w"] + p["b"]) + h
        x = F.layer_norm(h, (self.width,), p["norm"]["scale"], p["norm"]["bias"])
        q, k, v = (x @ p["attn"]["wqkv"]).split(self.width, dim=-1)
        b, s, _ = x.shape
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + a.transpose(1, 2).reshape(b, s, self.width) @ p["attn"]["wo"]
        x = F.layer_norm(h, (self.width,), p["norm"]["scale"], p["norm"]["bias"])
        return h + F.gelu(x @ p["mlp"]["w1"] + p["mlp"]["b1"]) @ p["mlp"]["w2"]


def _embed(p: Any, tokens: torch.Tensor) -> torch.Tensor:
    return F.embedding(tokens, p["tokens"])


def _head_loss(p: Any, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = (h @ p["w"]) * p["temp"]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
