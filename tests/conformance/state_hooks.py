"""Modules whose state-dict hooks compute on their parameters: a fused QKV saved as wq/wk/wv.

``FusedAttention`` follows torchtitan 0.3's ``FusedQKVLinear``: one ``wqkv`` linear
whose ``state_dict`` post-hook splits it into the stock ``wq``/``wk``/``wv`` keys
(a reshape by kv-head group), and whose ``load_state_dict`` pre-hook concatenates
them back. See [Note: state-dict hooks] in ``funcshard/_src/interop/state_hooks.py``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.conformance.rows import Row, features, mean_square, register

WIDTH, HEADS, KV_HEADS, HEAD_DIM = 8, 4, 2, 2


class FusedAttention(nn.Module):
    """Grouped-query self-attention with one fused ``wqkv``, checkpointed as ``wq``/``wk``/``wv``."""

    def __init__(self) -> None:
        super().__init__()
        self.per_kv = HEADS // KV_HEADS
        self.r = self.per_kv + 2
        self.wqkv = nn.Linear(WIDTH, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
        self.wo = nn.Linear(HEADS * HEAD_DIM, WIDTH)
        self.register_state_dict_post_hook(_split_qkv_on_save)
        self.register_load_state_dict_pre_hook(_merge_qkv_on_load)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.wqkv(x).view(b, s, KV_HEADS, self.r, HEAD_DIM)
        q, k, v = torch.split(qkv, [self.per_kv, 1, 1], dim=-2)
        q = q.reshape(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k = k.reshape(b, s, KV_HEADS, HEAD_DIM).repeat_interleave(self.per_kv, 2).transpose(1, 2)
        v = v.reshape(b, s, KV_HEADS, HEAD_DIM).repeat_interleave(self.per_kv, 2).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, HEADS * HEAD_DIM))


def _split_qkv_on_save(module: Any, state_dict: Any, prefix: str, local_metadata: Any) -> None:
    """torchtitan's ``_split_qkv_on_save``: ``wqkv`` -> ``wq``, ``wk``, ``wv`` (weight and bias)."""
    for param in ("weight", "bias"):
        fused = state_dict.pop(f"{prefix}wqkv.{param}")
        tail = fused.shape[1:]
        w = fused.reshape(KV_HEADS, module.r, HEAD_DIM, *tail)
        state_dict[f"{prefix}wq.{param}"] = w[:, : module.per_kv].reshape(-1, *tail).contiguous()
        state_dict[f"{prefix}wk.{param}"] = w[:, module.per_kv].reshape(-1, *tail).contiguous()
        state_dict[f"{prefix}wv.{param}"] = w[:, module.per_kv + 1].reshape(-1, *tail).contiguous()


def _merge_qkv_on_load(module: Any, state_dict: Any, prefix: str, *args: Any) -> None:
    """torchtitan's ``_merge_qkv_on_load``: ``wq``, ``wk``, ``wv`` -> ``wqkv``."""
    for param in ("weight", "bias"):
        keys = [f"{prefix}{w}.{param}" for w in ("wq", "wk", "wv")]
        if not all(k in state_dict for k in keys):
            continue
        wq, wk, wv = (state_dict.pop(k) for k in keys)
        tail = wq.shape[1:]
        q = wq.reshape(KV_HEADS, module.per_kv, HEAD_DIM, *tail)
        k = wk.reshape(KV_HEADS, 1, HEAD_DIM, *tail)
        v = wv.reshape(KV_HEADS, 1, HEAD_DIM, *tail)
        state_dict[f"{prefix}wqkv.{param}"] = torch.cat([q, k, v], dim=1).reshape(-1, *tail)


class FusedBlock(nn.Module):
    """A pre-norm attention block over :class:`FusedAttention`."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.attention = FusedAttention()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.attention(self.norm(h))


class FusedStack(nn.Module):
    """``inp`` and ``head`` in the root unit, two :class:`FusedBlock` units."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(FusedBlock() for _ in range(2))
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def fused() -> FusedStack:
    return FusedStack()


register(
    Row(
        "state/fused-qkv-hook",
        fused,
        units=(FusedBlock,),
        batch=features(4, 3, WIDTH),
        loss=mean_square,
        construct="a state-dict hook computing wq/wk/wv from a fused wqkv (torchtitan 0.3)",
        checkpoint_refused=(
            (
                "pretrained",
                r"blocks\.0\.attention: FusedAttention's state-dict hook .* computes .* from its "
                r"parameters, which save_pretrained .* does not write; save with "
                r"fs\.checkpoint\.save_dcp",
                "save_pretrained refused at save: names the hook, points to save_dcp",
            ),
        ),
    ),
)
