"""Presets: the parameter pytrees of published models, built from shapes alone on the meta device.

A preset holds no weights: :meth:`Preset.params` returns tensors on the ``meta``
device with each leaf's real shape, so a 175B-parameter model costs a few
milliseconds and no memory, and ``fs.plan`` reads it like real parameters.

Leaf paths follow one vocabulary across models. Dense weights are ``(in, out)``
(``x @ w``), embedding tables ``(rows, hidden)``::

    embed/tokens                  (vocab, hidden); embed/pos (gpt), embed/norm (bloom)
    layers/<i>/attn_norm/scale    and .../bias where the model has LayerNorm biases
    layers/<i>/attn/wq wk wv wo   separate projections (llama, t5), with bq bk bv (qwen2), or
    layers/<i>/attn/wqkv bqkv wo bo   fused projection with biases (bloom, gpt_neox, gpt)
    layers/<i>/mlp_norm/...
    layers/<i>/mlp/w1 w3 w2       SwiGLU: gate, up, down (llama; Meta's names), or
    layers/<i>/mlp/w1 b1 w2 b2    GeLU MLP (bloom, gpt_neox, gpt); w1 w2 without biases (t5)
    layers/<i>/mlp/router         (hidden, experts), and mlp/experts/w13 (experts, hidden,
                                  2 * ffn) gate and up fused, mlp/experts/w2 (experts, ffn,
                                  hidden): a mixture of experts (mixtral), as transformers 5
                                  stores it
    norm/...                      the final norm
    head/w                        (hidden, vocab), only where the head is not tied to embed/tokens

T5 has ``encoder/layers/<i>``, ``decoder/layers/<i>`` (with ``cross_norm`` and
``cross`` for cross-attention), ``encoder/norm`` and ``decoder/norm``; the first
layer of each stack holds ``attn/rel_bias`` ``(32, n_heads)``, as in the reference
implementation.
"""

from __future__ import annotations

import difflib
import functools
import types
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from funcshard._src import tree
from funcshard._src.plan.model_config import ModelConfig

_T5_BUCKETS = 32  # relative_attention_num_buckets of every T5 v1.0 checkpoint


@dataclass(frozen=True)
class Preset:
    """A published model's parameter shapes.

    Attributes:
        name: the key in :data:`PRESETS`.
        config: the model's :class:`ModelConfig`.
        source: where the shapes come from (the public config and the paper).

    Example:
        >>> p = get_preset("llama-7b")
        >>> p.n_params, p.unit_pattern, p.largest_layer_params
        (6738415616, 'layers/*', 131072000)
        >>> p.params(dtype=torch.bfloat16)["layers"][0]["attn"]["wk"]
        tensor(..., device='meta', size=(4096, 4096), dtype=torch.bfloat16)
    """

    name: str
    config: ModelConfig
    source: str = ""

    def params(self, *, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """The parameter pytree: every leaf an uninitialised ``meta`` tensor of ``dtype``.

        Args:
            dtype: the dtype of every leaf.

        Returns:
            Nested dicts and lists of meta tensors; see the module docstring for paths.

        Raises:
            TypeError: ``dtype`` is not a ``torch.dtype``.
        """
        if not isinstance(dtype, torch.dtype):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise TypeError(f"{self.name}: dtype must be a torch.dtype, got {dtype!r}")
        return _build(self.config, dtype)

    @property
    def unit_pattern(self) -> str:
        """The unit pattern naming one transformer block per unit (both stacks for T5)."""
        return "*/layers/*" if self.config.encoder_decoder else "layers/*"

    @functools.cached_property
    def n_params(self) -> int:
        """Parameters in all, exactly (tied weights counted once)."""
        return sum(leaf.numel() for leaf in tree.leaves(self.params()))

    @functools.cached_property
    def largest_layer_params(self) -> int:
        """Parameters of the largest layer: DeepSpeed's ``largest_layer_params``.

        A layer is one weight with its bias (``wX`` with ``bX``, ``scale`` with
        ``bias``) or any other leaf alone: the parameters one ``nn.Module`` of the
        reference implementation holds directly, as DeepSpeed's ``model_to_params``
        counts them for ``largest_layer_memory = 4 * largest_layer_params``.
        """
        sizes: Counter[str] = Counter()
        paths, leaves, _ = tree.flatten_with_paths(self.params())
        for path, leaf in zip(paths, leaves):
            sizes[_layer_of(path)] += leaf.numel()
        return max(sizes.values())


def _layer_of(path: str) -> str:
    """The layer a leaf belongs to: weight ``wX`` and bias ``bX`` share one, as do ``scale`` and ``bias``."""
    parent, _, name = path.rpartition("/")
    if name in ("scale", "bias"):
        return f"{parent}/<norm>"
    if parent.endswith("/experts"):  # one module holds every expert's weights
        return parent
    return f"{parent}/<{name[1:]}>" if name[:1] in ("w", "b") else path


def _build(c: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    h, f = c.hidden, c.ffn_hidden
    separate = c.arch in ("llama", "t5")  # RMSNorm without bias, q/k/v apart, no biases
    biases = {"bq": c.attn_dim, "bk": c.kv_dim, "bv": c.kv_dim} if c.qkv_bias else {}

    def leaf(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta")

    def norm() -> dict[str, torch.Tensor]:
        return {"scale": leaf(h)} if separate else {"scale": leaf(h), "bias": leaf(h)}

    def attn(rel_bias: bool) -> dict[str, torch.Tensor]:
        if separate:
            out = {
                "wq": leaf(h, c.attn_dim),
                "wk": leaf(h, c.kv_dim),
                "wv": leaf(h, c.kv_dim),
                "wo": leaf(c.attn_dim, h),
            } | {name: leaf(n) for name, n in biases.items()}
            return out | ({"rel_bias": leaf(_T5_BUCKETS, c.n_heads)} if rel_bias else {})
        qkv = c.attn_dim + 2 * c.kv_dim
        return {"wqkv": leaf(h, qkv), "bqkv": leaf(qkv), "wo": leaf(c.attn_dim, h), "bo": leaf(h)}

    def mlp() -> dict[str, Any]:
        if c.moe:
            e = c.n_experts
            experts = {"w13": leaf(e, h, 2 * f), "w2": leaf(e, f, h)}
            return {"router": leaf(h, e), "experts": experts}
        if c.arch == "llama":
            return {"w1": leaf(h, f), "w3": leaf(h, f), "w2": leaf(f, h)}
        if c.arch == "t5":
            return {"w1": leaf(h, f), "w2": leaf(f, h)}
        return {"w1": leaf(h, f), "b1": leaf(f), "w2": leaf(f, h), "b2": leaf(h)}

    def block(i: int, *, cross: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"attn_norm": norm(), "attn": attn(c.arch == "t5" and i == 0)}
        if cross:
            out |= {"cross_norm": norm(), "cross": attn(False)}
        return out | {"mlp_norm": norm(), "mlp": mlp()}

    embed: dict[str, Any] = {"tokens": leaf(c.vocab, h)}
    if c.arch == "gpt":
        embed["pos"] = leaf(c.seq_len, h)
    if c.arch == "bloom":
        embed["norm"] = norm()
    if c.encoder_decoder:
        return {
            "embed": embed,
            "encoder": {"layers": [block(i) for i in range(c.n_encoder_layers)], "norm": norm()},
            "decoder": {
                "layers": [block(i, cross=True) for i in range(c.n_decoder_layers)],
                "norm": norm(),
            },
        }
    params: dict[str, Any] = {
        "embed": embed,
        "layers": [block(i) for i in range(c.n_layers)],
        "norm": norm(),
    }
    if not c.tied_embeddings:
        params["head"] = {"w": leaf(h, c.vocab)}
    return params


_PRESETS = (
    # ModelConfig(arch, n_layers, hidden, ffn_hidden, n_heads, n_kv_heads, head_dim, vocab,
    #             seq_len[, n_encoder_layers]), from each model's public config.json
    Preset(
        "llama-7b",
        ModelConfig("llama", 32, 4096, 11008, 32, 32, 128, 32000, 2048),
        "LLaMA (Touvron et al. 2023); HF huggyllama/llama-7b",
    ),
    Preset(
        "llama-13b",
        ModelConfig("llama", 40, 5120, 13824, 40, 40, 128, 32000, 2048),
        "LLaMA (Touvron et al. 2023); HF huggyllama/llama-13b",
    ),
    Preset(
        "llama-70b",
        ModelConfig("llama", 80, 8192, 28672, 64, 8, 128, 32000, 4096),
        "Llama 2 70B, grouped-query attention (Touvron et al. 2023b); HF meta-llama/Llama-2-70b-hf",
    ),
    Preset(
        "llama-3-8b",
        ModelConfig("llama", 32, 4096, 14336, 32, 8, 128, 128256, 8192),
        "Llama 3 8B (Grattafiori et al. 2024), 8,030,261,248 parameters; HF meta-llama/Meta-Llama-3-8B",
    ),
    Preset(
        "llama-3-70b",
        ModelConfig("llama", 80, 8192, 28672, 64, 8, 128, 128256, 8192),
        "Llama 3 70B (Grattafiori et al. 2024), 70,553,706,496 parameters; HF "
        "meta-llama/Meta-Llama-3-70B",
    ),
    Preset(
        "mistral-7b",
        ModelConfig("llama", 32, 4096, 14336, 32, 8, 128, 32000, 8192),
        "Mistral 7B v0.1 (Jiang et al. 2023), 7,241,732,096 parameters, trained on 8192-token "
        "contexts (config.json: 32768 positions, a 4096-token sliding window); HF "
        "mistralai/Mistral-7B-v0.1",
    ),
    Preset(
        "mixtral-8x7b",
        ModelConfig("llama", 32, 4096, 14336, 32, 8, 128, 32000, 32768, 0, 8, 2),
        "Mixtral 8x7B (Jiang et al. 2024), 8 experts, 2 per token: 46,702,792,704 parameters; HF "
        "mistralai/Mixtral-8x7B-v0.1",
    ),
    Preset(
        "qwen2.5-7b",
        ModelConfig("llama", 28, 3584, 18944, 28, 4, 128, 152064, 32768, qkv_bias=True),
        "Qwen2.5 7B (Qwen Team 2024), q/k/v biases, untied head: 7,615,616,512 parameters, "
        "pre-trained to 32768 tokens (config.json: 131072 positions); HF Qwen/Qwen2.5-7B",
    ),
    Preset(
        "bloom-7b",
        ModelConfig("bloom", 30, 4096, 16384, 32, 32, 128, 250880, 2048),
        "BLOOM 7B1 (BigScience 2022); HF bigscience/bloom-7b1",
    ),
    Preset(
        "gpt-neox-20b",
        ModelConfig("gpt_neox", 44, 6144, 24576, 64, 64, 96, 50432, 2048),
        "GPT-NeoX-20B (Black et al. 2022); HF EleutherAI/gpt-neox-20b",
    ),
    Preset(
        "t5-11b",
        ModelConfig("t5", 48, 1024, 65536, 128, 128, 128, 32128, 512, n_encoder_layers=24),
        "T5 v1.0 11B (Raffel et al. 2020), 24 encoder + 24 decoder layers; HF google-t5/t5-11b",
    ),
    Preset(
        "gpt-175b",
        ModelConfig("gpt", 96, 12288, 49152, 96, 96, 128, 50257, 2048),
        "GPT-3 175B (Brown et al. 2020, Table 2.1) on the GPT-2 vocabulary: 174.6B parameters, "
        "which the paper rounds to 175.0B",
    ),
)
PRESETS: Mapping[str, Preset] = types.MappingProxyType({p.name: p for p in _PRESETS})
"""The presets by lowercase name."""


def get_preset(name: str, /) -> Preset:
    """The preset called ``name`` (case-insensitive).

    Raises:
        ValueError: no such preset; the message suggests the closest name and lists all.

    Example:
        >>> get_preset("LLaMA-70B").config.n_kv_heads
        8
        >>> get_preset("llama3-8b")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: unknown preset 'llama3-8b'; did you mean 'llama-3-8b'? Known presets: ...
    """
    key = str(name).lower()
    if key in PRESETS:
        return PRESETS[key]
    closest = difflib.get_close_matches(key, list(PRESETS), n=1, cutoff=0.0)
    hint = f"; did you mean {closest[0]!r}?" if closest else ""
    raise ValueError(f"unknown preset {name!r}{hint} Known presets: {', '.join(PRESETS)}")
