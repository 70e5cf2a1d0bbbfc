"""Presets against Hugging Face transformers, instantiated on the meta device (nothing downloaded).

Each preset's config is written out here by hand from the model's public
config.json. The test maps every preset leaf path to the HF parameter name, and
checks the mapping is one-to-one onto ``named_parameters()`` (tied weights listed
once), that shapes agree (``nn.Linear`` stores ``(out, in)``, presets ``(in, out)``),
and that the counts and DeepSpeed's ``largest_layer_params`` agree. Small drawn
configs of every arch are checked the same way. A failure names the preset or
config and the first path that differs.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from funcshard._src import tree
from funcshard._src.plan.model_config import ModelConfig
from funcshard._src.plan.presets import PRESETS, Preset

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face models are the reference: pip install transformers"
)
transformers.logging.set_verbosity_error()  # small vocabularies make GPT-2's config warn

pytestmark = pytest.mark.interop


def hf_config(c: ModelConfig) -> Any:
    """The transformers config with ``c``'s shapes (the fields of each model's config.json)."""
    t = transformers
    if c.arch == "llama":  # Mixtral and Qwen2 are the llama layout with experts or qkv biases
        assert not (c.moe and c.qkv_bias), "no transformers model has both"
        cls = t.MixtralConfig if c.moe else t.Qwen2Config if c.qkv_bias else t.LlamaConfig
        moe = {"num_local_experts": c.n_experts, "num_experts_per_tok": c.experts_per_token}
        return cls(
            hidden_size=c.hidden,
            intermediate_size=c.ffn_hidden,
            num_hidden_layers=c.n_layers,
            num_attention_heads=c.n_heads,
            num_key_value_heads=c.n_kv_heads,
            head_dim=c.head_dim,
            vocab_size=c.vocab,
            max_position_embeddings=c.seq_len,
            tie_word_embeddings=False,
            **(moe if c.moe else {}),
        )
    if c.arch == "bloom":  # head_dim = hidden / n_head and the MLP is 4 * hidden
        assert (c.attn_dim, c.ffn_hidden, c.n_kv_heads) == (c.hidden, 4 * c.hidden, c.n_heads)
        return t.BloomConfig(
            hidden_size=c.hidden, n_layer=c.n_layers, n_head=c.n_heads, vocab_size=c.vocab
        )
    if c.arch == "gpt_neox":
        assert (c.attn_dim, c.n_kv_heads) == (c.hidden, c.n_heads)
        return t.GPTNeoXConfig(
            hidden_size=c.hidden,
            num_hidden_layers=c.n_layers,
            num_attention_heads=c.n_heads,
            intermediate_size=c.ffn_hidden,
            vocab_size=c.vocab,
            max_position_embeddings=c.seq_len,
            rotary_pct=0.25,
            use_parallel_residual=True,
            tie_word_embeddings=False,
        )
    if c.arch == "gpt":
        assert (c.attn_dim, c.n_kv_heads) == (c.hidden, c.n_heads)
        return t.GPT2Config(
            n_embd=c.hidden,
            n_layer=c.n_layers,
            n_head=c.n_heads,
            n_inner=c.ffn_hidden,
            n_positions=c.seq_len,
            vocab_size=c.vocab,
        )
    assert c.arch == "t5"
    assert c.n_kv_heads == c.n_heads
    return t.T5Config(
        d_model=c.hidden,
        d_ff=c.ffn_hidden,
        d_kv=c.head_dim,
        num_heads=c.n_heads,
        num_layers=c.n_encoder_layers,
        num_decoder_layers=c.n_decoder_layers,
        vocab_size=c.vocab,
        relative_attention_num_buckets=32,
        feed_forward_proj="relu",
        tie_word_embeddings=True,
    )


def hf_model(c: ModelConfig) -> torch.nn.Module:
    cls = {
        "llama": transformers.LlamaForCausalLM,
        "bloom": transformers.BloomForCausalLM,
        "gpt_neox": transformers.GPTNeoXForCausalLM,
        "gpt": transformers.GPT2LMHeadModel,
        "t5": transformers.T5ForConditionalGeneration,
    }[c.arch]
    if c.moe or c.qkv_bias:
        cls = transformers.AutoModelForCausalLM.from_config
    with torch.device("meta"):
        return cls(hf_config(c))


# Preset path (layer index as {i}) -> HF parameter name, per arch.
_BLOCK = {
    "llama": {
        "attn_norm/scale": "input_layernorm.weight",
        "attn/wq": "self_attn.q_proj.weight",
        "attn/wk": "self_attn.k_proj.weight",
        "attn/wv": "self_attn.v_proj.weight",
        "attn/wo": "self_attn.o_proj.weight",
        "mlp_norm/scale": "post_attention_layernorm.weight",
        "mlp/w1": "mlp.gate_proj.weight",
        "mlp/w3": "mlp.up_proj.weight",
        "mlp/w2": "mlp.down_proj.weight",
    },
    "bloom": {
        "attn_norm/scale": "input_layernorm.weight",
        "attn_norm/bias": "input_layernorm.bias",
        "attn/wqkv": "self_attention.query_key_value.weight",
        "attn/bqkv": "self_attention.query_key_value.bias",
        "attn/wo": "self_attention.dense.weight",
        "attn/bo": "self_attention.dense.bias",
        "mlp_norm/scale": "post_attention_layernorm.weight",
        "mlp_norm/bias": "post_attention_layernorm.bias",
        "mlp/w1": "mlp.dense_h_to_4h.weight",
        "mlp/b1": "mlp.dense_h_to_4h.bias",
        "mlp/w2": "mlp.dense_4h_to_h.weight",
        "mlp/b2": "mlp.dense_4h_to_h.bias",
    },
    "gpt": {
        "attn_norm/scale": "ln_1.weight",
        "attn_norm/bias": "ln_1.bias",
        "attn/wqkv": "attn.c_attn.weight",
        "attn/bqkv": "attn.c_attn.bias",
        "attn/wo": "attn.c_proj.weight",
        "attn/bo": "attn.c_proj.bias",
        "mlp_norm/scale": "ln_2.weight",
        "mlp_norm/bias": "ln_2.bias",
        "mlp/w1": "mlp.c_fc.weight",
        "mlp/b1": "mlp.c_fc.bias",
        "mlp/w2": "mlp.c_proj.weight",
        "mlp/b2": "mlp.c_proj.bias",
    },
}
_BLOCK["llama"] |= {
    f"attn/b{x}": f"self_attn.{x}_proj.bias" for x in "qkv"
} | {  # Qwen2's biases; Mixtral's MLP (transformers 5 fuses each expert's gate and up)
    "mlp/router": "mlp.gate.weight",
    "mlp/experts/w13": "mlp.experts.gate_up_proj",
    "mlp/experts/w2": "mlp.experts.down_proj",
}
# stored (out, in) by modules that are not nn.Linear: the preset's (in, out) swaps the last dims
_OUT_IN = ("mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj")
_BLOCK["gpt_neox"] = {
    k: v.replace("self_attention.", "attention.") for k, v in _BLOCK["bloom"].items()
}
_T5_ATTN = {"wq": "q", "wk": "k", "wv": "v", "wo": "o", "rel_bias": "relative_attention_bias"}
_NAMES: dict[str, dict[str, str]] = {
    "llama": {
        "embed/tokens": "model.embed_tokens.weight",
        "norm/scale": "model.norm.weight",
        "head/w": "lm_head.weight",
        **{f"layers/{{i}}/{k}": f"model.layers.{{i}}.{v}" for k, v in _BLOCK["llama"].items()},
    },
    "bloom": {
        "embed/tokens": "transformer.word_embeddings.weight",
        "embed/norm/scale": "transformer.word_embeddings_layernorm.weight",
        "embed/norm/bias": "transformer.word_embeddings_layernorm.bias",
        "norm/scale": "transformer.ln_f.weight",
        "norm/bias": "transformer.ln_f.bias",
        **{f"layers/{{i}}/{k}": f"transformer.h.{{i}}.{v}" for k, v in _BLOCK["bloom"].items()},
    },
    "gpt_neox": {
        "embed/tokens": "gpt_neox.embed_in.weight",
        "norm/scale": "gpt_neox.final_layer_norm.weight",
        "norm/bias": "gpt_neox.final_layer_norm.bias",
        "head/w": "embed_out.weight",
        **{
            f"layers/{{i}}/{k}": f"gpt_neox.layers.{{i}}.{v}" for k, v in _BLOCK["gpt_neox"].items()
        },
    },
    "gpt": {
        "embed/tokens": "transformer.wte.weight",
        "embed/pos": "transformer.wpe.weight",
        "norm/scale": "transformer.ln_f.weight",
        "norm/bias": "transformer.ln_f.bias",
        **{f"layers/{{i}}/{k}": f"transformer.h.{{i}}.{v}" for k, v in _BLOCK["gpt"].items()},
    },
    "t5": {
        "embed/tokens": "shared.weight",
        "encoder/norm/scale": "encoder.final_layer_norm.weight",
        "decoder/norm/scale": "decoder.final_layer_norm.weight",
        "encoder/layers/{i}/attn_norm/scale": "encoder.block.{i}.layer.0.layer_norm.weight",
        "encoder/layers/{i}/mlp_norm/scale": "encoder.block.{i}.layer.1.layer_norm.weight",
        "encoder/layers/{i}/mlp/w1": "encoder.block.{i}.layer.1.DenseReluDense.wi.weight",
        "encoder/layers/{i}/mlp/w2": "encoder.block.{i}.layer.1.DenseReluDense.wo.weight",
        "decoder/layers/{i}/attn_norm/scale": "decoder.block.{i}.layer.0.layer_norm.weight",
        "decoder/layers/{i}/cross_norm/scale": "decoder.block.{i}.layer.1.layer_norm.weight",
        "decoder/layers/{i}/mlp_norm/scale": "decoder.block.{i}.layer.2.layer_norm.weight",
        "decoder/layers/{i}/mlp/w1": "decoder.block.{i}.layer.2.DenseReluDense.wi.weight",
        "decoder/layers/{i}/mlp/w2": "decoder.block.{i}.layer.2.DenseReluDense.wo.weight",
        **{
            f"{stack}/layers/{{i}}/{sub}/{k}": f"{stack}.block.{{i}}.layer.{n}.{mod}.{v}.weight"
            for stack, sub, n, mod in [
                ("encoder", "attn", 0, "SelfAttention"),
                ("decoder", "attn", 0, "SelfAttention"),
                ("decoder", "cross", 1, "EncDecAttention"),
            ]
            for k, v in _T5_ATTN.items()
        },
    },
}


# transformers 5 calls GPT-NeoX's head lm_head; earlier versions, and the checkpoints, embed_out.
_RENAMED = {"embed_out.weight": "lm_head.weight"}


def hf_name(arch: str, path: str) -> str:
    """The HF parameter name of preset leaf ``path``."""
    index = re.search(r"/layers/(\d+)/|^layers/(\d+)/", path)
    i = next(g for g in index.groups() if g is not None) if index else ""
    key = re.sub(r"layers/\d+/", "layers/{i}/", path)
    return _NAMES[arch][key].format(i=i)


def hf_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape in the preset's ``(in, out)`` layout: ``nn.Linear`` weights reversed."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, param in model.named_parameters():
        owner = model.get_submodule(name.rpartition(".")[0])
        linear = isinstance(owner, torch.nn.Linear) and name.endswith(".weight")
        shape = tuple(param.shape)
        if name.endswith(_OUT_IN) and not linear:
            shape = (*shape[:-2], shape[-1], shape[-2])
        shapes[name] = tuple(reversed(shape)) if linear else shape
    return shapes


def deepspeed_largest_layer(model: torch.nn.Module) -> int:
    """DeepSpeed's ``model_to_params`` (deepspeed/runtime/zero/stage3.py): the largest direct count."""
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())


def assert_matches_hf(preset: Preset) -> None:
    model = hf_model(preset.config)
    expected = hf_shapes(model)
    paths, leaves, _ = tree.flatten_with_paths(preset.params())
    mapped: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path, leaf in zip(paths, leaves):
        name = hf_name(preset.config.arch, path)
        name = name if name in expected else _RENAMED.get(name, name)
        mapped[name] = (path, tuple(leaf.shape))
    assert len(mapped) == len(paths), f"{preset.name}: two leaves map to one HF name"
    assert sorted(mapped) == sorted(expected), f"{preset.name}: {set(mapped) ^ set(expected)}"
    for name, (path, shape) in mapped.items():
        assert shape == expected[name], (
            f"{preset.name}: {path} {shape} vs HF {name} {expected[name]}"
        )
    assert preset.n_params == sum(p.numel() for p in model.parameters())
    assert preset.largest_layer_params == deepspeed_largest_layer(model)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_matches_the_hugging_face_model(name: str):
    """Reference: transformers' model class for the arch, from the public config, on meta."""
    assert_matches_hf(PRESETS[name])


@st.composite
def hf_configs(draw: st.DrawFn) -> ModelConfig:
    """Small configs every HF class can express (its head_dim and MLP width rules respected)."""
    arch = draw(st.sampled_from(["llama", "bloom", "gpt_neox", "gpt", "t5"]))
    heads, head_dim = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    kv = draw(st.sampled_from([k for k in range(1, heads + 1) if heads % k == 0]))
    kv = kv if arch == "llama" else heads
    # LlamaConfig wants hidden % heads == 0 even with head_dim given; T5 is free
    hidden = {"llama": heads * draw(st.integers(1, 4)), "t5": draw(st.integers(1, 12))}.get(
        arch, heads * head_dim
    )
    ffn = 4 * hidden if arch == "bloom" else draw(st.integers(1, 24))
    n_layers = draw(st.integers(2 if arch == "t5" else 1, 4))
    n_enc = draw(st.integers(1, n_layers - 1)) if arch == "t5" else 0
    vocab, seq_len = draw(st.integers(1, 40)), draw(st.integers(1, 16))
    shape = (n_layers, hidden, ffn, heads, kv, head_dim, vocab, seq_len)
    variant = draw(st.sampled_from(["dense", "moe", "qkv_bias"])) if arch == "llama" else "dense"
    experts = draw(st.integers(1, 4)) if variant == "moe" else 0
    return ModelConfig(
        arch,  # pyright: ignore[reportArgumentType]
        *shape,
        n_encoder_layers=n_enc,
        n_experts=experts,
        experts_per_token=draw(st.integers(1, experts)) if experts else 0,
        qkv_bias=variant == "qkv_bias",
    )


@settings(max_examples=40)
@given(hf_configs())
def test_drawn_configs_match_the_hugging_face_model(config: ModelConfig):
    """The same check over small drawn shapes: GQA, head_dim != hidden / heads, uneven widths."""
    assert_matches_hf(Preset(f"drawn {config}", config))
